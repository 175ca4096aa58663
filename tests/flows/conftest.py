"""Fixtures of the flow tests."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flows.extract import extract
from tasks import publish as publish_tasks
from tests.flows.builders import chat_rows, pipeline_spec
from tests.support.prefect_harness import prefect_harness  # noqa: F401


class Story:
    """The dataset the extract-flow tests share: 10 chat rows, extracted by the local runner."""

    def __init__(self, root: Path, model: Path) -> None:
        self.root = root
        self.model = model
        self.dataset = chat_rows(root / "chat.jsonl", rows=10)  # 4 shards of 3 rows: 2 ranges of 2
        self.original_rows = self.dataset.read_bytes()  # before any test appends to it
        self.output = root / "out"

    def spec(self, **overrides):
        return pipeline_spec(model=self.model, dataset=self.dataset, output=self.output, **overrides)

    def run(self, **overrides):
        t0 = time.monotonic()
        state = extract(self.spec(**overrides), return_state=True)
        return state, state.state_details.flow_run_id, time.monotonic() - t0


@dataclass
class Run:
    """One flow run of the story: its final state, its id, how long it took, the events it emitted."""

    state: object
    run_id: object
    seconds: float
    events: list[dict] = field(default_factory=list)


@dataclass
class Runs:
    story: Story
    first: Run
    cached: Run
    manifest: dict  # manifest.json and the validation report right after the first run
    validation: dict


def _recorded_run(story: Story) -> Run:
    events: list[dict] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(publish_tasks, "emit_event", lambda **kwargs: events.append(kwargs))
        state, run_id, seconds = story.run()
    return Run(state, run_id, seconds, events)


@pytest.fixture(scope="session")
def runs(tmp_path_factory, tiny_llama, prefect_harness) -> Runs:
    """A first run on a new dataset (the local runner), then a second run of the same spec right
    after it. The extract-flow tests read both; the docker-runner test compares its shards with
    the first run's (one local extraction for both modules)."""
    story = Story(tmp_path_factory.mktemp("flow"), tiny_llama)
    first = _recorded_run(story)
    assert first.state.is_completed(), first.state.message
    manifest = json.loads((story.output / "manifest.json").read_text())
    validation = json.loads((story.output / ".datagen" / "validation.json").read_text())
    cached = _recorded_run(story)
    return Runs(story, first, cached, manifest, validation)
