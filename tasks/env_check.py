"""The env-check task: `datagen env-check` -- will this spec run here? -- before any download.
The step task (``tasks/step.py``) under the name ``env-check``.

Not cached: it checks the machine, which changes without the spec changing. A failed check is
permanent (exit 3, the step says what to fix); a check that could not tell is transient (exit 75)
and retried. When this version has no env-check step, the check is skipped (and says so).
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.futures import PrefectFuture
from pydantic import BaseModel, ConfigDict, Field

from tasks._common import HUB_AND_AWS_CREDENTIAL_ENV, mounts_for, step_available
from tasks.pipeline_spec import PipelineSpec
from tasks.settings import s3_step_env
from tasks.step import StepCall, step_task

STEP = "env-check"
SECRET_ENV = HUB_AND_AWS_CREDENTIAL_ENV


class EnvCheckOutcome(BaseModel):
    """What the env check found (empty when the step is not in this version)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    ran: bool = Field(True, description="False when this version has no env-check step.")
    ok: bool = Field(True, description="Every check ok or skipped.")
    checks: list[dict] = Field(default_factory=list, description="name, status, detail, fix of each check.")


env_check = step_task(STEP)


def start_env_check(spec: PipelineSpec) -> PrefectFuture | None:
    """`datagen env-check --spec SPEC` submitted: GPUs, engine and patches, model config, storage,
    credentials. None when this version has no env-check step."""
    if not step_available(STEP):
        return None
    local_paths = [p for p in (spec.model, spec.model_cache) if p and "://" not in p]
    if spec.model_cache:
        # a first run: the download makes it anyway, and a bind mount needs it to exist
        Path(spec.model_cache).mkdir(parents=True, exist_ok=True)
    call = StepCall(
        step=STEP,
        result=EnvCheckOutcome,
        spec=spec.sources_spec(),
        mounts=mounts_for(read_only=tuple(local_paths)),
        env=s3_step_env(),  # an S3 mirror's endpoint and region (credentials are secret_env_names)
        secret_env_names=SECRET_ENV,
        gpus=spec.gpus,
    )
    return env_check.submit(call, runner=spec.runner)


def env_checked(started: PrefectFuture | None) -> EnvCheckOutcome:
    """Wait for the env check (raises when it failed); what it found becomes the run's table."""
    if started is None:
        get_run_logger().info("env-check: this version has no `datagen env-check` step; skipped")
        return EnvCheckOutcome(ran=False)
    outcome = started.result()
    if outcome.checks:
        create_table_artifact(
            [{k: c.get(k) for k in ("name", "status", "detail", "fix")} for c in outcome.checks],
            key="env-check",
            description="What the env check found on the host that runs the flow.",
        )
    return outcome
