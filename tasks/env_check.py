"""The env-check task: `datagen env-check` -- will this spec run here? -- before any download.

Not cached: it checks the machine, which changes without the spec changing. A failed check is
permanent (exit 3, the step says what to fix); a check that could not tell is transient (exit 75)
and retried. When this version has no env-check step, the task logs that and passes.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel, ConfigDict, Field

from tasks.pipeline_spec import PipelineSpec
from tasks._common import (
    STEP_RETRY_POLICY,
    HUB_AND_AWS_CREDENTIAL_ENV,
    make_runner, mounts_for, 
    run_step, spec_file, step_available,
)
from tasks.runners import StepInvocation
from tasks.settings import s3_step_env

STEP = "env-check"
SECRET_ENV = HUB_AND_AWS_CREDENTIAL_ENV


class EnvCheckOutcome(BaseModel):
    """What the env check found (empty when the step is not in this version)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    ran: bool = Field(description="False when this version has no env-check step.")
    ok: bool = Field(True, description="Every check ok or skipped.")
    checks: list[dict] = Field(default_factory=list, description="name, status, detail, fix of each check.")


@task(
    name=STEP,
    **STEP_RETRY_POLICY,
)
def env_check(spec: PipelineSpec) -> EnvCheckOutcome:
    """`datagen env-check --spec SPEC`: GPUs, engine and patches, model config, storage, credentials."""
    logger = get_run_logger()
    if not step_available(STEP):
        logger.info("env-check: this version has no `datagen env-check` step; skipped")
        return EnvCheckOutcome(ran=False)
    with spec_file(spec.sources_spec()) as path:
        local_paths = [p for p in (spec.model, spec.model_cache) if p and "://" not in p]
        if spec.model_cache:
            # a first run: the download makes it anyway, and a bind mount needs it to exist
            Path(spec.model_cache).mkdir(parents=True, exist_ok=True)
        invocation = StepInvocation(
            step=STEP,
            args=("--spec", str(path)),
            mounts=mounts_for(read_only=(path.parent, *local_paths)),
            env=s3_step_env(),  # an S3 mirror's endpoint and region (credentials are secret_env_names)
            secret_env_names=SECRET_ENV,
            gpus=spec.gpus,
            labels={"task": STEP},
        )
        result = run_step(invocation, make_runner(spec.runner, gpu=spec.gpus > 0), log=logger.info)
    outcome = EnvCheckOutcome(ran=True, ok=bool(result.get("ok", True)), checks=result.get("checks", []))
    if outcome.checks:
        create_table_artifact(
            [{k: c.get(k) for k in ("name", "status", "detail", "fix")} for c in outcome.checks],
            key="env-check",
            description="What the env check found on the host that runs the flow.",
        )
    return outcome
