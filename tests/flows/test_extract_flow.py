"""The extract flow under Prefect's test harness, with the real step programs (local runner) and
the transformers engine on a tiny Llama: caching by shard range, incremental re-extraction,
transient faults retried, permanent ones not, artifacts, log streaming, the dataset event.

The module's tests share one dataset: ``runs`` (tests/flows/conftest.py) extracts it and runs
the flow again at once (everything cached), and keeps what those two runs returned; ``fault_runs``
(a shard deleted, rows appended, faults injected) runs after both and leaves it complete, so any
test passes alone and in any order.
"""

from __future__ import annotations

import json
import re

import pytest

from datagen.errors import EXIT_BAD_INPUT, EXIT_TRANSIENT
from tasks import local_runner
from tests.flows.builders import append_rows
from tests.support.step_hooks import hooked_runner, write_faults
from tests.support.prefect_runs import artifacts_by_key, flow_run_logs, state_names, task_runs

pytestmark = [pytest.mark.prefect_server, pytest.mark.usefixtures("prefect_harness")]


def test_a_first_run_extracts_every_range_then_validates_and_announces(runs):
    state = runs.first.state
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["shards_extracted"] == [0, 1, 2, 3]
    assert summary["ranges"] == 2 and summary["ranges_cached"] == 0
    assert runs.manifest["fingerprint"] == summary["fingerprint"]
    assert runs.validation["ok"] is True
    tasks = task_runs(runs.first.run_id)
    assert state_names(tasks["extract-range"]) == ["Completed", "Completed"]
    for name in ("env-check", "download", "plan", "finalize", "validate", "announce"):
        assert state_names(tasks[name]) == ["Completed"], name
    [event] = runs.first.events
    assert event["event"] == "datagen.dataset.ready"
    assert event["resource"]["prefect.resource.id"] == f"datagen.dataset.{summary['fingerprint']}"
    assert event["resource"]["datagen.dataset.changed"] == "true"


def test_a_second_run_serves_every_range_from_the_cache_and_starts_no_engine(runs):
    state, run_id = runs.cached.state, runs.cached.run_id
    assert state.is_completed(), state.message
    assert state.result()["shards_extracted"] == []
    tasks = task_runs(run_id)
    assert state_names(tasks["extract-range"]) == ["Cached", "Cached"]
    assert state_names(tasks["finalize"]) == ["Cached"]
    assert state_names(tasks["validate"]) == ["Cached"]
    assert not [m for m in flow_run_logs(run_id) if "Loading weights" in m or " extract INFO " in m]
    [event] = runs.cached.events
    assert event["resource"]["datagen.dataset.changed"] == "false"
    print(f"fully cached re-run: {runs.cached.seconds:.1f} s")


def test_every_run_has_a_summary_a_shard_table_and_a_finished_progress_bar(runs):
    first, cached = artifacts_by_key(runs.first.run_id), artifacts_by_key(runs.cached.run_id)
    summary = cached["extract-summary"][-1].data
    assert "ranges served from the cache | 2 of 2" in summary and str(runs.story.output) in summary
    assert "ranges served from the cache | 0 of 2" in first["extract-summary"][-1].data
    for found, this_run in ((first, "extracted"), (cached, "cached")):
        table = found["extract-shards"][-1].data
        rows = json.loads(table) if isinstance(table, str) else table
        assert [r["shard"] for r in rows] == [0, 1, 2, 3] and {r["this run"] for r in rows} == {this_run}
        assert found["extract-progress"][-1].data == 100.0
    # the layer report: this run's statistics plotted after the runs before it, no drift between them
    counts = [int(re.search(r"Runs: (\d+);", a["layer-report"][-1].data)[1]) for a in (first, cached)]
    assert counts[1] == min(counts[0] + 1, 8)  # other tests' runs of the flow may come before (the same history)
    assert cached["layer-report"][-1].data.startswith("# Layer statistics: no drift")
    assert "data:image/png;base64," in cached["layer-report"][-1].data


def test_step_output_reaches_the_run_log_line_by_line(runs):
    logs = flow_run_logs(runs.first.run_id)
    assert any(m.startswith("datagen-result: ") for m in logs), logs[:40]
    assert any(" env-check INFO " in m for m in logs), "each line of the step is a log entry of its task"
    assert any(" extract INFO progress " in m for m in logs), "the extraction's progress lines too"


@pytest.fixture(scope="module")
def fault_runs(runs, tmp_path_factory) -> dict:
    """Two runs on the extracted dataset with its shard 0 deleted and two rows appended (shard 3,
    rows 9..11, gains them), with faults injected into the plan step: a permanent one (the run fails
    at once), then a transient one in the run right after it (retried, and that run completes,
    extracting shard 0 again and shard 3, nothing else). The fault tests, the gone-shard test and
    the appended rows' test read them: one run for the retry, the gone shard and the appended rows,
    not three. That appending rows leaves the other shards' cache keys (and so their ranges' keys)
    as they were is tests/test_stored_plan.py's; that only a range with a shard gone is refreshed,
    tests/test_plan.py's."""
    story = runs.story
    faults = tmp_path_factory.mktemp("faults") / "faults.json"
    (story.output / "shards" / "shard-000000.safetensors").unlink()  # the transient run puts it back
    append_rows(story.dataset, rows=2)  # the dataset stays complete after the transient run
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(local_runner, "LocalRunner", hooked_runner(local_runner.LocalRunner, faults=faults))
        write_faults(faults, plan={"exit_code": EXIT_BAD_INPUT, "times": 1, "message": "row 7 is not JSON"})
        permanent, permanent_id, _ = story.run()
        write_faults(faults, plan={"exit_code": EXIT_TRANSIENT, "times": 1, "message": "storage hiccup"})
        transient, transient_id, _ = story.run()
    return {"permanent": (permanent, permanent_id), "transient": (transient, transient_id)}


def test_a_range_whose_shards_are_gone_is_extracted_again(fault_runs):
    state, run_id = fault_runs["transient"]  # the first run that completes after shard 0 was deleted
    assert state.is_completed(), state.message
    # range 0:2's rows did not change (its cache key neither): only its deleted shard runs it again
    assert state.result()["shards_extracted"] == [0, 3]
    assert sorted((r.name, r.state.name) for r in task_runs(run_id)["extract-range"]) == [
        ("extract-range-0:2", "Completed"), ("extract-range-2:4", "Completed"),
    ]


def test_appending_rows_re_extracts_only_the_shards_whose_rows_changed(fault_runs):
    state, run_id = fault_runs["transient"]  # the first run that completes after two rows were appended
    assert state.is_completed(), state.message
    # shard 3 gained rows; shard 2, in the same range, is not extracted again (nor shard 1)
    assert state.result()["shards_extracted"] == [0, 3]  # and shard 0, deleted before the run
    assert "extract-range-2:4" in {r.name for r in task_runs(run_id)["extract-range"] if r.state.name == "Completed"}


def test_a_transient_fault_is_retried_and_the_run_completes(fault_runs):
    state, run_id = fault_runs["transient"]
    assert state.is_completed(), state.message
    assert state.result()["shards_extracted"] == [0, 3]  # the shard deleted and the one that gained rows
    [plan] = task_runs(run_id)["plan"]
    assert plan.run_count == 2
    assert any("storage hiccup" in m for m in flow_run_logs(run_id))


def test_a_permanent_fault_fails_the_run_at_once_with_the_steps_message(fault_runs):
    state, run_id = fault_runs["permanent"]
    assert state.is_failed()
    assert "row 7 is not JSON" in state.message and "bad input" in state.message
    [plan] = task_runs(run_id)["plan"]
    assert plan.run_count == 1, "a permanent fault must not be retried"
    again, _ = fault_runs["transient"]  # the next run, on the same dataset: the failed run changed nothing
    assert again.is_completed() and again.result()["shards_extracted"] == [0, 3]  # only what changed before it
