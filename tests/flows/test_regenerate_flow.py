"""The extract flow with ``regenerate: {...}`` on: the target model writes the assistant turns
(`datagen regenerate`, vLLM on the CPU) before the plan, and the extraction reads its chats; a
second run of the same spec finds the regeneration in the cache and starts no engine for it."""

from __future__ import annotations

import json

import pytest

from datagen.data.checksums import sha256_file
from flows.extract import extract
from tests.flows.builders import chat_rows, pipeline_spec
from tests.support.prefect_runs import state_names, task_runs

REGENERATE = {"max_new_tokens": 8, "rows_per_chunk": 2, "max_model_len": 512}


@pytest.fixture(scope="module")
def story(tmp_path_factory, tiny_llama, prefect_harness):
    root = tmp_path_factory.mktemp("regen-flow")
    data = chat_rows(root / "chat.jsonl", rows=5)
    spec = pipeline_spec(model=tiny_llama, dataset=data, output=root / "out", regenerate=REGENERATE)
    first = extract(spec, return_state=True)
    assert first.is_completed(), first.message
    second = extract(spec, return_state=True)
    assert second.is_completed(), second.message
    return root, data, first, second


def test_the_pipeline_spec_turns_regeneration_on_and_checks_its_settings(tmp_path):
    from datagen.errors import SpecError
    from tasks.pipeline_spec import parse_pipeline_spec

    base = {"model": str(tmp_path / "m"), "dataset": str(tmp_path / "d.jsonl"), "output": str(tmp_path / "out")}
    assert parse_pipeline_spec(base).regenerate is None
    spec = parse_pipeline_spec({**base, "regenerate": {"temperature": 0.7, "seed": 3}})
    assert spec.regenerate.sampling()["method"] == "sample"
    assert spec.regenerated_output() == str(tmp_path / "out-regenerated") and spec.regenerate_gpus == 0
    with pytest.raises(SpecError, match="regenerate.top_k"):
        parse_pipeline_spec({**base, "regenerate": {"top_k": -1}})


@pytest.mark.engine
@pytest.mark.prefect_server
def test_the_flow_regenerates_the_chats_and_extracts_the_regenerated_ones(story):
    root, data, first, _ = story
    summary = first.result()
    regen = root / "out-regenerated"
    assert summary["regenerated"]["dataset"] == str(regen / "chats.jsonl")
    m = json.loads((regen / "manifest.json").read_text())
    assert m["source"]["sha256"] == sha256_file(data) and m["source"]["rows"] == 5
    assert m["sampling"] == {"method": "greedy", "max_new_tokens": 8}
    extracted = json.loads((root / "out" / "manifest.json").read_text())
    assert sha256_file(regen / "chats.jsonl") in json.dumps(extracted["spec"])  # its dataset fingerprint
    assert summary["totals"]["samples"] == m["totals"]["rows"] == 5
    [task] = task_runs(first.state_details.flow_run_id)["regenerate"]
    assert task.state.name == "Completed"


@pytest.mark.engine
@pytest.mark.prefect_server
def test_a_second_run_finds_the_regeneration_in_the_cache(story):
    _, _, first, second = story
    tasks = task_runs(second.state_details.flow_run_id)
    assert state_names(tasks["regenerate"]) == ["Cached"]
    assert set(state_names(tasks["extract-range"])) == {"Cached"}
    assert second.result()["fingerprint"] == first.result()["fingerprint"]
