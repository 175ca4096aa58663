"""The layer report attached to a flow run: the plot of this and the previous runs, drift marked."""

from __future__ import annotations

import base64
import re
import uuid

import pytest
from prefect import flow

from tasks import artifacts
from tasks.report import layer_report
from tests.support.synthetic_shards import make_synthetic_dataset, manifest_of, write_manifest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_artifacts(key: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                                     sort=ArtifactSort.CREATED_DESC)


def nightly(name: str):
    @flow(name=name)
    def run(dataset: str, previous: str | None = None) -> list[int]:
        return layer_report(dataset, previous=previous)

    return run


def shift_layer_mean(ds, layer_id: int, stds: float) -> None:
    m = manifest_of(ds)
    for s in m["layer_stats"]:
        if s["layer_id"] == layer_id:
            s["mean"] += stds * s["std"]
    write_manifest(ds, m)


def reports_of(flow_run_ids: list) -> list[str]:
    by_run = {a.flow_run_id: a.data for a in read_artifacts("layer-report")}
    return [by_run[i] for i in flow_run_ids]


@pytest.mark.prefect_server
def test_each_run_plots_itself_after_the_runs_before_and_marks_a_drifted_layer(prefect_harness, tmp_path):
    name = f"nightly-{uuid.uuid4().hex[:8]}"
    run = nightly(name)
    same = [make_synthetic_dataset(tmp_path / f"night{i}", rows=16, seed=0) for i in range(3)]
    drifted = make_synthetic_dataset(tmp_path / "night3", rows=16, seed=0)
    shift_layer_mean(drifted, layer_id=3, stds=1.0)

    states = [run(str(ds), return_state=True) for ds in [*same, drifted]]

    assert [s.result() for s in states] == [[], [], [], [3]]
    reports = reports_of([s.state_details.flow_run_id for s in states])
    assert [re.search(r"Runs: (\d+)", r)[1] for r in reports] == ["1", "2", "3", "4"]
    assert reports[2].startswith("# Layer statistics: no drift")
    assert reports[3].startswith("# Layer statistics: DRIFT in layers [3]")
    assert re.search(r"\| 3 \|[^\n]*\*\*DRIFT\*\*", reports[3]) and not re.search(r"\| 4 \|[^\n]*DRIFT", reports[3])
    png = base64.b64decode(re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)\)", reports[3])[1])
    assert png.startswith(PNG_MAGIC) and len(png) > 20_000
    history = read_artifacts(artifacts.stats_key(name, None))
    assert len(history) == 4  # one record per run: what the next run's report reads


@pytest.mark.prefect_server
def test_drift_is_measured_against_validations_previous_dataset_when_there_is_one(prefect_harness, tmp_path):
    run = nightly(f"nightly-{uuid.uuid4().hex[:8]}")
    base = make_synthetic_dataset(tmp_path / "base", rows=16, seed=0)
    moved = make_synthetic_dataset(tmp_path / "moved", rows=16, seed=0)
    shift_layer_mean(moved, layer_id=2, stds=-0.5)

    assert run(str(moved)) == []  # the first run of the deployment: nothing before it
    assert run(str(base), previous=str(moved)) == [2]

    other = make_synthetic_dataset(tmp_path / "other", rows=16, seed=0)
    shift_layer_mean(other, layer_id=4, stds=1.0)
    m = manifest_of(other)
    m["fingerprint"] = "another-dataset"
    write_manifest(other, m)
    state = run(str(base), previous=str(other), return_state=True)
    assert state.result() == [4]
    report = reports_of([state.state_details.flow_run_id])[0]
    # the two runs before, validation's previous (not one of them: drawn too), this run
    assert "Runs: 4" in report


@pytest.mark.prefect_server
def test_a_report_that_cannot_be_drawn_does_not_fail_the_run(prefect_harness, tmp_path):
    run = nightly(f"nightly-{uuid.uuid4().hex[:8]}")
    state = run(str(tmp_path / "missing"), return_state=True)
    assert state.is_completed() and state.result() == []


@pytest.mark.parametrize("flow_name, deployment, key", [
    ("extract", "tiny", "layer-stats-extract-tiny"),
    ("extract", "Kimi K2.5/nightly", "layer-stats-extract-kimi-k2-5-nightly"),
    ("extract", None, "layer-stats-extract-no-deployment"),
])
def test_the_history_key_is_a_valid_artifact_key_per_deployment(flow_name, deployment, key):
    assert artifacts.stats_key(flow_name, deployment) == key
