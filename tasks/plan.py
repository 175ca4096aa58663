"""The plan task: `datagen plan`, the step task (``tasks/step.py``) under the step's name. Its result is
the step's own, ``PlanResult``: fingerprints, each shard's key, and what is on disk. Never cached: it
is what notices that the dataset or the model changed."""

from __future__ import annotations

from datagen.specs.extraction import ExtractSpec
from datagen.steps.plan import PlanResult
from tasks.media import media_step_env
from tasks.mounts import extract_mounts
from tasks.step import StepCall, step_task

__all__ = ["PlanResult", "plan", "plan_call"]

plan = step_task("plan")  # not cached: it is what notices that the dataset or the model changed


def plan_call(spec: ExtractSpec, *, cuda: bool = False) -> StepCall:
    """`datagen plan`: fingerprints, shard keys, and what is on disk (the manifest, its validation).
    Loads no weights. ``cuda``: the ranges run on GPUs, so the plan is made in their image (the engine
    the plan names is the one they run), with no GPU reserved."""
    return StepCall(step="plan", spec=spec.model_dump(mode="json"), mounts=extract_mounts(spec),
                    cuda_image=cuda, **media_step_env(spec.dataset))
