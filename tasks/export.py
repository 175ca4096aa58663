"""The training hand-off task: `datagen export --format speculators` of a dataset, the layout the
speculators library trains EAGLE-3 draft models from. The step task (``tasks/step.py``) under the
name ``export``, cached on the dataset's fingerprint and the export directory: one export per
dataset. Its result is the step's own, ``ExportResult``; None when the step did not run (the
export directory is there already and is kept)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from prefect import get_run_logger

from tasks.cache_keys import cache_key
from tasks.mounts import mounts_for
from tasks.pipeline_spec import Runner
from tasks.step import STEP_CACHE, StepCall, step_task

if TYPE_CHECKING:
    from datagen.steps.export import ExportResult

STEP = "export"


def export_cache_key(*, fingerprint: str, out: str) -> str:
    return cache_key("export", fingerprint, out)


export = step_task(STEP, cache_policy=STEP_CACHE)


def export_speculators(dataset: str, out: str, *, cache_key: str, runner: Runner) -> ExportResult | None:
    """`datagen export --format speculators DATASET OUT` (OUT must not exist yet). None when it did
    not run: OUT is there already (kept)."""
    logger = get_run_logger()
    if Path(out).exists():
        logger.info("export: %s exists already; kept", out)
        return None
    from datagen.export.speculators import ExportFormat  # torch: imported where a run exports
    from datagen.steps.export import Spec

    call = StepCall(
        step=STEP,
        spec=Spec(fmt=ExportFormat.SPECULATORS, dataset=dataset, out=out).model_dump(mode="json"),
        mounts=mounts_for(Path(out).parent, read_only=(dataset,)),
        known={"out": out},
    )
    return export(call, cache_key=cache_key, runner=runner)
