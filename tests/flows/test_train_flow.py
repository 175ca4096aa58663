"""The `train` flow on the tiny model's dataset (local runner, Prefect's test server): it trains a draft
with `datagen train`, measures it with `datagen measure-draft`, attaches the night's report, announces
`datagen.draft.ready`, and a night whose acceptance length falls beyond the threshold fails naming the
dataset (after its report and event)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prefect import flow

from datagen.data.contract import MANIFEST_NAME
from datagen.training.draft import LINEAGE_NAME
from datagen.training.nightly import NightMeasurement
from flows.train import train
from tasks import train as train_tasks
from tests.support.extracted import copy_dataset, extracted_dataset

SETTINGS = {"steps": 3, "total_seq_len": 256, "ttt_steps": 2, "train_ratio": 0.75}
pytestmark = pytest.mark.prefect_server  # every test reads the nights run against Prefect's test harness


def _artifacts(key: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


@flow(name="record-night")
def record_night(night: NightMeasurement) -> None:
    """A night recorded as the train flow records one (its table artifact under the deployment's key)."""
    from prefect.artifacts import create_table_artifact

    create_table_artifact(night.to_rows(), key=train_tasks.nights_key("train", None))


@pytest.fixture(scope="module")
def nights(prefect_harness, tmp_path_factory):
    """Two runs of the flow on one dataset: a first night, then one after a (made-up) far better night."""
    root = tmp_path_factory.mktemp("train-flow")
    ds = copy_dataset(extracted_dataset(tmp_path_factory), root / "dataset")
    fingerprint = json.loads((ds / MANIFEST_NAME).read_text())["fingerprint"]
    events: list[dict] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_tasks, "emit_event", lambda **kw: events.append(kw))
        first = train(dataset=str(ds), fingerprint=fingerprint, settings=SETTINGS, return_state=True)
        better = NightMeasurement(label="better-night", dataset="/elsewhere", fingerprint="f" * 64,
                                  agreement=(0.9, 0.8), acceptance_length=2.9, spec_decode_acceptance=None)
        record_night(better)
        second = train(dataset=str(ds), fingerprint=fingerprint, settings=SETTINGS, return_state=True)
    return {"ds": ds, "fingerprint": fingerprint, "first": first, "second": second, "events": events}


def test_the_flow_trains_a_draft_next_to_the_dataset_and_measures_it(nights):
    assert nights["first"].is_completed(), nights["first"]
    summary = nights["first"].result()
    draft = Path(summary["draft"])
    assert draft.resolve() == Path(f"{nights['ds']}.draft-{nights['fingerprint'][:12]}").resolve()
    lineage = json.loads((draft / LINEAGE_NAME).read_text())
    assert lineage["dataset_fingerprint"] == nights["fingerprint"] and lineage["steps_done"] == SETTINGS["steps"]
    assert len(summary["agreement"]) == SETTINGS["ttt_steps"] and summary["acceptance_length"] >= 1.0


def test_the_draft_is_announced_with_its_figures(nights):
    ready = [e for e in nights["events"] if e["event"] == train_tasks.EVENT_DRAFT_READY]
    assert len(ready) == 2
    payload = ready[0]["payload"]
    assert payload["fingerprint"] == nights["fingerprint"] and payload["steps"] == SETTINGS["steps"]
    # the recipe as speculators resolved it (its default optimizer and norms here), and what was given
    assert set(payload["recipe_given"]) == {"total_seq_len", "ttt_steps"}
    assert payload["recipe"]["ttt_steps"] == 2 and payload["recipe"]["optimizer"] is not None
    assert ready[0]["resource"]["prefect.resource.id"] == "datagen.draft." + nights["fingerprint"]
    assert payload["acceptance_length"] == nights["first"].result()["acceptance_length"]


def test_each_night_leaves_its_report_and_its_figures_for_the_next(nights):
    reports = _artifacts("draft-report")
    assert len(reports) >= 2 and all("![agreement of the last nights](data:image/png;base64," in a.data for a in reports)
    recorded = _artifacts(train_tasks.nights_key("train", None))
    assert len(recorded) == 3  # the first night, the made-up one, the second night


def test_a_drop_beyond_the_threshold_fails_the_run_naming_the_dataset(nights):
    state = nights["second"]
    assert state.is_failed()
    with pytest.raises(train_tasks.AcceptanceDropped, match=str(nights["ds"])):
        state.result()
    assert any("DROP" in a.data for a in _artifacts("draft-report"))
