"""The download task: `datagen download` -- the model into this host's model cache, verified.
The step task (``tasks/step.py``) under the name ``download``.

Not cached by Prefect: the model cache is per host (every GPU host downloads once), and the step
itself is idempotent: a model already in the cache costs a check of its files, not a transfer.
The task's result is the step's own, ``DownloadResult``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect import get_run_logger

from datagen.specs.source import LocalSource
from tasks.mounts import mounts_for
from tasks.pipeline_spec import PipelineSpec
from tasks.settings import HUB_AND_AWS_CREDENTIAL_ENV, s3_step_env
from tasks.step import StepCall, step_task

if TYPE_CHECKING:
    from datagen.steps.download import DownloadResult

STEP = "download"
SECRET_ENV = HUB_AND_AWS_CREDENTIAL_ENV


_download = step_task(STEP)  # not cached: the model cache is per host, and the step is idempotent


def download(spec: PipelineSpec) -> DownloadResult:
    """`datagen download --spec SPEC`: resolve the revision, fetch what is missing, verify."""
    logger = get_run_logger()
    from datagen.storage.model_cache import cache_root  # the host path the step writes to

    cache = cache_root(spec.model_cache)
    cache.mkdir(parents=True, exist_ok=True)
    source = spec.source
    local = (str(source.path),) if isinstance(source, LocalSource) else ()
    call = StepCall(
        step=STEP,
        spec={**spec.sources_spec(), "model_cache": str(cache)},
        mounts=mounts_for(cache, read_only=local),
        env=s3_step_env(),  # an S3 mirror's endpoint and region (credentials are secret_env_names)
        secret_env_names=SECRET_ENV,
    )
    downloaded = _download(call, runner=spec.runner)
    logger.info("model %s is at %s (revision %s)", spec.model, downloaded.model_dir, downloaded.model_revision)
    return downloaded


def model_location(spec: PipelineSpec, downloaded: DownloadResult) -> tuple[str, str | None]:
    """The model directory the extraction reads and its revision: the download's."""
    return downloaded.model_dir, downloaded.model_revision
