"""The measure-draft task: `datagen measure-draft DRAFT DATASET`, the step task (``tasks/step.py``) under
the step's name, not cached. Its result is the step's own, ``MeasureResult``: the draft's agreement
with the target on held-out rows, and the stored states' distance from the target's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tasks.mounts import mounts_for
from tasks.pipeline_spec import Runner
from tasks.step import StepCall, step_task

if TYPE_CHECKING:
    from datagen.steps.measure_draft import MeasureResult

measure_step = step_task("measure-draft")


def measure_draft(draft: str, dataset: str, *, model: str | None, acceptance: str, runner: Runner,
                  device: str = "cpu") -> MeasureResult:
    """`datagen measure-draft DRAFT DATASET` (without a model: the one the draft's lineage names), in the
    image of ``device`` (cuda: the CUDA train image, with a GPU for vLLM's speculative decoding)."""
    from datagen.steps.measure_draft import Spec

    spec = Spec(draft=draft, dataset=dataset, model=model, acceptance=acceptance)
    call = StepCall(step="measure-draft", spec=spec.model_dump(mode="json"),
                    mounts=mounts_for(read_only=(draft, dataset, *([model] if model else []))),
                    gpus=1 if device == "cuda" else 0)
    return measure_step(call, runner=runner)
