"""The env-check task: `datagen env-check` -- will this spec run here? -- before any download.
The step task (``tasks/step.py``) under the name ``env-check``.

Not cached: it checks the machine, which changes without the spec changing. A failed check is
permanent (exit 3, the step says what to fix); a check that could not tell is transient (exit 75)
and retried. The task's result is the step's own, ``EnvReport``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from prefect.artifacts import create_table_artifact
from prefect.futures import PrefectFuture

from datagen.specs.source import LocalSource
from tasks.mounts import mounts_for
from tasks.pipeline_spec import PipelineSpec
from tasks.settings import HUB_AND_AWS_CREDENTIAL_ENV, s3_step_env
from tasks.step import StepCall, step_task

if TYPE_CHECKING:
    from datagen.envcheck.report import EnvReport

STEP = "env-check"
SECRET_ENV = HUB_AND_AWS_CREDENTIAL_ENV


env_check = step_task(STEP)


def start_env_check(spec: PipelineSpec) -> PrefectFuture:
    """`datagen env-check --spec SPEC` submitted: GPUs, engine and patches, model config, storage,
    credentials."""
    local_paths = [str(spec.source.path)] if isinstance(spec.source, LocalSource) else []
    local_paths += [spec.model_cache] if spec.model_cache else []
    if spec.model_cache:
        # a first run: the download makes it anyway, and a bind mount needs it to exist
        Path(spec.model_cache).mkdir(parents=True, exist_ok=True)
    call = StepCall(
        step=STEP,
        spec=spec.sources_spec(),
        mounts=mounts_for(read_only=tuple(local_paths)),
        env=s3_step_env(),  # an S3 mirror's endpoint and region (credentials are secret_env_names)
        secret_env_names=SECRET_ENV,
        gpus=spec.gpus,
    )
    return env_check.submit(call, runner=spec.runner)


def env_checked(started: PrefectFuture) -> EnvReport:
    """Wait for the env check (raises when it failed); what it found becomes the run's table."""
    report = started.result()
    if report.checks:
        create_table_artifact(
            [c.model_dump(mode="json", include={"name", "status", "detail", "fix"}) for c in report.checks],
            key="env-check",
            description="What the env check found on the host that runs the flow.",
        )
    return report
