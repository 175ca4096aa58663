"""Where the spec's rules run: where the spec enters a process, and in `datagen plan`; every step after
the plan is given the plan (``datagen.specs.plan.ExtractionPlan``), not the spec.

The spec's validator (``check_layer_ids``) is counted with a profile hook on its own code: nothing in
the product is patched. What these tests hold (docs/architecture.md, "Three values from the user's spec
to the shard header"): the flow validates the user's pipeline spec (its parameter) and the extraction
spec it makes of it for the plan step; the calls of the ranges, finalize and assemble carry the plan
whole and validate nothing; a step after the plan reads its plan file once, and checks nothing of the
spec against the model (``tests/test_plan_file.py``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from datagen.cli import build_parser, spec_from_namespace
from datagen.specs.extraction import ExtractSpec, check_layer_ids
from datagen.steps import load
from tasks.assemble import assemble_call
from tasks.extract import finalize_call, range_call
from tasks.pipeline_spec import ShardRange, parse_pipeline_spec
from tasks.plan import plan_call
from tests.support.plan_records import plan_record


@contextmanager
def validator_runs() -> Iterator[list[tuple[int, ...]]]:
    """The layer ids each run of the spec's validator (``check_layer_ids``) was given, while the block runs."""
    runs: list[tuple[int, ...]] = []
    code = check_layer_ids.__code__

    def hook(frame, event, _arg):
        if event == "call" and frame.f_code is code:
            runs.append(tuple(frame.f_locals["v"]))

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield runs
    finally:
        sys.setprofile(previous)


def user_spec(tmp_path, **overrides) -> dict:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"input_ids": [1, 2, 3]}\n')
    return {"model": str(tmp_path / "model"), "dataset": str(rows), "output": str(tmp_path / "out"),
            "layer_ids": [1, 3, 4], "samples_per_shard": 2, **overrides}


def step_spec(step: str, spec: dict, tmp_path):
    """The step's ``Spec`` as the step program reads it: ``datagen <step> --spec FILE``."""
    path = tmp_path / f"{step}.json"
    path.write_text(json.dumps(spec))
    args = build_parser(only=step).parse_args([step, "--spec", str(path)])
    return spec_from_namespace(step, load(step).Spec, args)


def test_the_flow_validates_the_spec_it_plans_and_passes_the_plan_on_without_validating(tmp_path):
    with validator_runs() as runs:
        spec = parse_pipeline_spec(user_spec(tmp_path)).resolved(tmp_path)
        assert runs == [(1, 3, 4)]  # the flow's parameter
        xspec = spec.extract_spec(model_dir=str(tmp_path / "model"), model_revision="abc")
        assert runs == [(1, 3, 4)] * 2  # the spec the plan step is given
        call = plan_call(xspec)
    assert runs == [(1, 3, 4)] * 2
    assert call.spec["layer_ids"] == [1, 3, 4]
    planned = plan_record(spec=xspec)
    with validator_runs() as runs:
        calls = [range_call(planned, ShardRange(first=0, stop=1)), finalize_call(planned),
                 assemble_call(planned, str(tmp_path / "records"))]
    assert runs == []  # the plan is passed whole
    assert [sorted(c.spec) for c in calls] == [["plan", "shards"], ["plan"], ["plan", "records"]]
    assert all(c.spec["plan"] == planned.model_dump(mode="json") for c in calls)


def test_a_step_after_the_plan_reads_its_plan_file_once(tmp_path):
    xspec = parse_pipeline_spec(user_spec(tmp_path)).resolved(tmp_path).extract_spec(
        model_dir=str(tmp_path / "model"), model_revision="abc")
    planned = plan_record(spec=xspec)
    for step, call in (("extract", range_call(planned, ShardRange(first=0, stop=1))),
                       ("extract", finalize_call(planned)),
                       ("assemble", assemble_call(planned, str(tmp_path / "records")))):
        with validator_runs() as runs:
            read = step_spec(step, call.spec, tmp_path)
        assert runs == [(1, 3, 4)], step  # the plan's spec, read with the plan
        assert read.plan == planned and read.plan.layer_ids == (1, 3), step  # the resolved ids are the plan's


def test_a_fanned_out_range_reads_the_plan_where_it_enters_the_child(tmp_path):
    from datagen.specs.plan import ExtractionPlan

    parent = parse_pipeline_spec(user_spec(tmp_path, ranges_in_flight=2, publish_to="s3://bucket/ds"))
    planned = plan_record(spec=parent.extract_spec(model_dir=str(tmp_path / "model"), model_revision="abc"))
    with validator_runs() as runs:  # the child flow's parameters: the parent's spec and plan as JSON
        parse_pipeline_spec(parent.model_dump(mode="json"))
        child_plan = ExtractionPlan.model_validate(planned.model_dump(mode="json"))
        call = range_call(child_plan, ShardRange(first=0, stop=1), model="/here/model", out=str(tmp_path / "spool"))
    assert runs == [(1, 3, 4)] * 2 and child_plan == planned
    assert call.spec["model"] == "/here/model" and call.spec["out"] == str(tmp_path / "spool")
    read = step_spec("extract", call.spec, tmp_path)
    assert read.plan.on_host(model=read.model, out=read.out).spec.out == str(tmp_path / "spool")


def test_a_spec_written_and_read_again_is_the_same_spec(tmp_path):
    spec = parse_pipeline_spec(user_spec(tmp_path, layer_ids=None, preprocessing={"max_seq_len": 64},
                                         engine={"max_num_batched_tokens": 64, "storage_dtype": "fp8_e4m3"}))
    xspec = spec.extract_spec(model_dir="/models/m", model_revision=None)
    assert ExtractSpec.model_validate(xspec.model_dump()) == xspec
    assert ExtractSpec.model_validate_json(xspec.model_dump_json()) == xspec
