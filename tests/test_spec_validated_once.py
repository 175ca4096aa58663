"""The layer ids are validated once where a spec enters a process, and carried whole below that.

The flow's process validates the user's pipeline spec (its parameter); the extraction spec, the plan's,
a range's and the assemble step's specs are made of its values without validating them again
(``ExtractSpec.of_checked``). A step program validates its ``--spec`` file once; the extraction spec
it hands the library is carried over, not parsed again (docs/architecture.md, "Three values from the
user's spec to the shard header"). The validator's runs are counted with a profile hook on the
validator's own code: nothing in the product is patched.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from datagen.cli import build_parser, spec_from_namespace
from datagen.data.spec import ExtractSpec, check_layer_ids
from datagen.steps import load
from tasks.assemble import assemble_call
from tasks.extract import finalize_call, range_call
from tasks.pipeline_spec import PipelineSpec, ShardRange, parse_pipeline_spec
from tasks.plan import plan_call


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


def test_the_flow_validates_the_layer_ids_once_and_its_step_calls_add_none(tmp_path):
    with validator_runs() as runs:
        spec = parse_pipeline_spec(user_spec(tmp_path)).resolved(tmp_path)
        assert runs == [(1, 3, 4)]  # the flow's parameter
        xspec = spec.extract_spec(model_dir=str(tmp_path / "model"), model_revision="abc")
        calls = [plan_call(xspec), range_call(xspec, ShardRange(first=0, stop=1)), finalize_call(xspec),
                 assemble_call(xspec, str(tmp_path / "records"))]
    assert runs == [(1, 3, 4)]
    assert xspec.layer_ids is spec.layer_ids  # the same value, carried
    assert [c.spec["layer_ids"] for c in calls] == [[1, 3, 4]] * 4


def test_a_fanned_out_range_validates_them_once_in_each_process(tmp_path):
    parent = parse_pipeline_spec(user_spec(tmp_path, ranges_in_flight=2, publish_to="s3://bucket/ds"))
    with validator_runs() as runs:
        # the child flow's parameter: the parent's spec as JSON (run_deployment), validated in the child
        child = PipelineSpec.model_validate(parent.model_dump(mode="json")).resolved(tmp_path)
        spool = child.model_copy(update={"output": str(tmp_path / "spool")})
        call = range_call(spool.extract_spec(model_dir=str(tmp_path / "model"), model_revision="abc"),
                          ShardRange(first=0, stop=1))
    assert runs == [(1, 3, 4)]
    with validator_runs() as runs:  # the step program: its --spec file, then the library's spec
        spec = step_spec("extract", call.spec, tmp_path)
        extraction = spec.extraction()
    assert runs == [(1, 3, 4)]
    assert extraction.layer_ids is spec.layer_ids and spec.shards == (0, 1)


def test_each_step_validates_its_spec_file_once_and_hands_the_library_the_same_spec(tmp_path):
    xspec = parse_pipeline_spec(user_spec(tmp_path)).resolved(tmp_path).extract_spec(
        model_dir=str(tmp_path / "model"), model_revision="abc")
    for step, call in (("plan", plan_call(xspec)), ("extract", range_call(xspec, ShardRange(first=0, stop=1))),
                       ("assemble", assemble_call(xspec, str(tmp_path / "records")))):
        with validator_runs() as runs:
            extraction = step_spec(step, call.spec, tmp_path).extraction()
        assert runs == [(1, 3, 4)], step
        assert type(extraction) is ExtractSpec and extraction == xspec, step
        assert "shards" not in extraction.model_fields_set and "records" not in extraction.model_fields_set


def test_a_spec_carried_over_equals_the_same_spec_validated(tmp_path):
    # of_checked skips no rule: validating its result again gives the same spec
    spec = parse_pipeline_spec(user_spec(tmp_path, layer_ids=None, preprocessing={"max_seq_len": 64},
                                         engine={"max_num_batched_tokens": 64, "storage_dtype": "fp8_e4m3"}))
    xspec = spec.extract_spec(model_dir="/models/m", model_revision=None)
    assert ExtractSpec.model_validate(xspec.model_dump()) == xspec
    assert ExtractSpec.model_validate_json(xspec.model_dump_json()) == xspec


def test_the_extraction_spec_has_no_rule_across_fields_that_carrying_it_over_would_skip():
    # of_checked carries over values each validated by the same field's rules; a model validator
    # (a rule across fields) added to ExtractSpec would need it to validate instead
    assert ExtractSpec.__pydantic_decorators__.model_validators == {}
