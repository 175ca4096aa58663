"""The assemble task: `datagen assemble`, the step task (``tasks/step.py``) under the step's name. Used
by a fanned-out run (``tasks/fanout/parent.py``) instead of finalize: the manifest of the bucket's shards,
from the records ``fetch_shards`` checked, written into the local dataset directory. Its result is
the step's own, ``AssembleResult``."""

from __future__ import annotations

from datagen.specs.plan import ExtractionPlan
from datagen.steps.assemble import Spec as AssembleSpec
from tasks.media import media_step_env
from tasks.mounts import extract_mounts
from tasks.step import StepCall, step_task

assemble = step_task("assemble")  # not cached: it is cheap, and what it writes is validated right after


def assemble_call(plan: ExtractionPlan, records: str, *, cuda: bool = False) -> StepCall:
    """`datagen assemble --plan`: the manifest of the bucket's shards, from their checked records, written
    into the plan's output (the local dataset directory). Its result: the step's ``AssembleResult``.
    ``cuda``: in the ranges' CUDA image (its host check compares that engine with the plan's), no GPU."""
    spec = AssembleSpec(plan=plan, records=records)
    return StepCall(step="assemble", spec=spec.model_dump(mode="json"), mounts=extract_mounts(plan.spec),
                    cuda_image=cuda,
                    **media_step_env(plan.spec.dataset))  # image rows are planned again: s3:// images need S3
