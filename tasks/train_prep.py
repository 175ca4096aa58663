"""The training hand-off task: `datagen export --format speculators` of a dataset, the layout the
speculators library trains EAGLE-3 draft models from. The step task (``tasks/step.py``) under the
name ``export``, cached on the dataset's fingerprint and the export directory: one export per
dataset."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger
from pydantic import BaseModel, ConfigDict, Field

from tasks._common import cache_key, mounts_for, step_available
from tasks.pipeline_spec import Runner
from tasks.step import STEP_CACHE, StepCall, step_task

STEP = "export"


class ExportOutcome(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    ran: bool = Field(True, description="False when this version has no export step.")
    out: str | None = Field(None, description="The speculators-layout directory.")


def export_cache_key(*, fingerprint: str, out: str) -> str:
    return cache_key("export", fingerprint, out)


export = step_task(STEP, cache_policy=STEP_CACHE)


def export_speculators(dataset: str, out: str, *, cache_key: str, runner: Runner) -> ExportOutcome:
    """`datagen export --format speculators DATASET OUT` (OUT must not exist yet)."""
    logger = get_run_logger()
    if not step_available(STEP):
        logger.info("export: this version has no `datagen export` step; skipped")
        return ExportOutcome(ran=False)
    if Path(out).exists():
        logger.info("export: %s exists already; kept", out)
        return ExportOutcome(ran=True, out=out)
    call = StepCall(
        step=STEP,
        result=ExportOutcome,
        args=("--format", "speculators", dataset, out),
        mounts=mounts_for(Path(out).parent, read_only=(dataset,)),
        known={"out": out},
    )
    return export(call, cache_key=cache_key, runner=runner)
