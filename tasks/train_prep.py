"""The training hand-off task: `datagen export --format speculators` of a dataset, the layout the
speculators library trains EAGLE-3 draft models from. Cached on the dataset's fingerprint and the
export directory: one export per dataset."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from pydantic import BaseModel, ConfigDict, Field

from tasks.pipeline_spec import Runner
from tasks._common import (
    STEP_RETRY_POLICY,
    cache_key, make_runner, mounts_for,
    run_step, step_available,
)
from tasks.runners import StepInvocation

STEP = "export"


class ExportOutcome(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    ran: bool = Field(description="False when this version has no export step.")
    out: str | None = Field(None, description="The speculators-layout directory.")


def export_cache_key(*, fingerprint: str, out: str) -> str:
    return cache_key("export", fingerprint, out)


def _key_from_parameter(context, parameters) -> str:
    return parameters["cache_key"]


@task(
    name=STEP,
    cache_key_fn=_key_from_parameter,
    persist_result=True,
    result_serializer="json",
    **STEP_RETRY_POLICY,
)
def export_speculators(dataset: str, out: str, *, cache_key: str, runner: Runner) -> ExportOutcome:
    """`datagen export --format speculators DATASET OUT` (OUT must not exist yet)."""
    logger = get_run_logger()
    if not step_available(STEP):
        logger.info("export: this version has no `datagen export` step; skipped")
        return ExportOutcome(ran=False)
    if Path(out).exists():
        logger.info("export: %s exists already; kept", out)
        return ExportOutcome(ran=True, out=out)
    invocation = StepInvocation(
        step=STEP,
        args=("--format", "speculators", dataset, out),
        mounts=mounts_for(Path(out).parent, read_only=(dataset,)),
        labels={"task": STEP},
    )
    run_step(invocation, make_runner(runner), log=logger.info)
    return ExportOutcome(ran=True, out=out)
