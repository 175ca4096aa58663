"""The plan file (``datagen.specs.plan``) and a plan at work on a host (``datagen.extraction.host``):
written once by `datagen plan`, read whole by every later step, which checks only that its host
matches it (model, engine, dataset) before any weight loads, and works nothing out again."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from datagen.specs.extraction import ExtractSpec
from datagen.errors import CannotRunHereError, DatasetError, ModelError, SpecError
from datagen.extraction import run as extraction_run
from datagen.extraction.plan import plan
from datagen.specs.plan import ExtractionPlan, read_plan_file, write_plan_file
from tests.builders import chat_dataset, make_model_dir
from tests.support.plan_records import plan_record


@pytest.fixture()
def planned(tiny_llama, tmp_path) -> ExtractionPlan:
    """The plan of 8 chat rows of the tiny Llama, 2 rows a shard, for the transformers engine."""
    rows = chat_dataset(tmp_path / "rows.jsonl", rows=8, seed=5)
    spec = ExtractSpec(model=str(tiny_llama), dataset=str(rows), out=str(tmp_path / "out"), samples_per_shard=2,
                       engine={"name": "hf", "dtype": "float32"})
    return plan(spec).record


@pytest.fixture()
def no_engine(monkeypatch):
    """Fails the test if an engine is made (a host refused after that would have loaded weights)."""
    def refuse(p):
        raise AssertionError("an engine was made")

    monkeypatch.setattr(extraction_run, "make_engine", refuse)


def test_a_plan_file_is_read_back_as_written(tmp_path):
    p = plan_record()
    assert read_plan_file(write_plan_file(p, tmp_path / "plan.json")) == p
    assert (p.layer_ids, p.storage_dtype, p.num_shards, p.rows) == ((1, 3), "bfloat16", 2, 4)
    assert p.shard_state_bytes == (10 * 2 * 8 * 2, 20 * 2 * 8 * 2)  # tokens x layers x hidden x 2 bytes


def test_a_plan_file_of_another_version_or_no_plan_is_refused(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**plan_record().model_dump(mode="json"), "format_version": 2}))
    with pytest.raises(SpecError, match="format_version"):
        read_plan_file(path)
    with pytest.raises(SpecError, match="cannot read the plan file"):
        read_plan_file(tmp_path / "missing.json")


def test_a_host_sets_only_where_it_finds_the_model_and_where_it_writes():
    p = plan_record()
    here = p.on_host(model="/cache/m", out="/spool/ds")
    assert (here.spec.model, here.spec.out) == ("/cache/m", "/spool/ds")
    assert here.model_copy(update={"spec": p.spec}) == p and p.on_host() is p


def test_a_range_checks_nothing_against_the_model_and_writes_the_plans_shards(planned):
    from datagen.extraction.plan import plan_header
    from datagen.models.modelinfo import check_layer_ids

    watched = {check_layer_ids.__code__: "check_layer_ids", plan_header.__code__: "plan_header"}
    calls = []

    def hook(frame, event, _arg):
        if event == "call" and frame.f_code in watched:
            calls.append(watched[frame.f_code])

    sys.setprofile(hook)
    try:
        result = extraction_run.extract_planned(planned, shards=(1, 3))
    finally:
        sys.setprofile(None)
    assert calls == []  # the layer ids were resolved and checked against the model once, by the plan
    assert (result["fingerprint"], tuple(result["layer_ids"]), result["shards_extracted"]) == (
        planned.fingerprint, planned.layer_ids, [1, 2])


def test_a_host_whose_engine_is_not_the_plans_is_refused_before_any_weight_loads(planned, no_engine):
    other = planned.model_copy(update={"engine": {**planned.engine, "version": "0.0.1"}})
    with pytest.raises(CannotRunHereError, match="engine is not the one the plan was made for: version '"):
        extraction_run.extract_planned(other, shards=(0, 1))


def test_a_host_whose_model_is_not_the_plans_is_refused_before_any_weight_loads(planned, tmp_path, no_engine):
    other = make_model_dir(tmp_path / "other", arch="llama", num_layers=6, seed=1)  # same shape, other weights
    with pytest.raises(ModelError, match="is not the one the plan was made for: content"):
        extraction_run.extract_planned(planned.on_host(model=str(other)), shards=(0, 1))
    deeper = make_model_dir(tmp_path / "deeper", arch="llama", num_layers=8)
    with pytest.raises(ModelError, match="num_hidden_layers 8 \\(the plan's: 6\\)"):
        extraction_run.extract_planned(planned.on_host(model=str(deeper)), shards=(0, 1))


def test_a_dataset_changed_since_the_plan_is_refused(planned, no_engine):
    with open(planned.spec.dataset, "a") as f:
        f.write(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    with pytest.raises(DatasetError, match="is not the one planned"):
        extraction_run.extract_planned(planned, shards=(0, 1))


def test_a_host_without_the_stored_plan_tokenizes_again_and_writes_the_same_shards(planned, tmp_path):
    whole = extraction_run.extract_planned(planned)  # the first range kept the rows in the output
    assert planned.stored_plan and (tmp_path / "out" / ".datagen" / "plan" / planned.fingerprint).is_dir()
    shutil.rmtree(planned.stored_plan)
    again = extraction_run.extract_planned(planned.on_host(out=str(tmp_path / "elsewhere")))
    assert [s["sha256"] for s in again["shards"]] == [s["sha256"] for s in whole["shards"]]


def test_a_range_outside_the_plan_is_refused():
    with pytest.raises(SpecError, match="--shards 1:3 is outside 0:2"):
        extraction_run.extract_planned(plan_record(), shards=(1, 3))


def test_datagen_plan_writes_the_plan_file_extract_reads(planned, tmp_path):
    from datagen.cli import main

    spec = planned.spec
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", spec.model, "--dataset", spec.dataset, "--out", spec.out, "--engine", "hf",
                 "--dtype", "float32", "--samples-per-shard", "2", "--plan-file", str(path)]) == 0
    assert read_plan_file(path) == planned
    assert main(["extract", "--plan", str(path), "--shards", "0:1"]) == 0
    assert main(["extract", "--plan", str(path), "--layers", "1,2"]) == 2  # the plan fixes them
