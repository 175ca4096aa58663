"""The download task: `datagen download` -- the model into this host's model cache, verified.

Not cached by Prefect: the model cache is per host (every GPU host downloads once), and the step
itself is idempotent: a model already in the cache costs a check of its files, not a transfer.
When this version has no download step, a local model directory is used in place and a remote
source fails with what to do.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from pydantic import BaseModel, ConfigDict, Field

from datagen.errors import CannotRunHereError, ModelNotFoundError
from datagen.storage.sources import LocalSource, parse_model_source
from tasks.pipeline_spec import PipelineSpec
from tasks._common import (
    STEP_RETRY_POLICY,
    HUB_AND_AWS_CREDENTIAL_ENV,
    make_runner, mounts_for, 
    run_step, spec_file, step_available,
)
from tasks.runners import StepInvocation
from tasks.settings import s3_step_env

STEP = "download"
SECRET_ENV = HUB_AND_AWS_CREDENTIAL_ENV


class ModelLocation(BaseModel):
    """Where the model is on this host, and which revision it is."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model_dir: str = Field(description="Local model directory (absolute).")
    resolved_revision: str | None = Field(
        None, description="Hub: the commit sha; S3: hash of the mirror's listing; local: content hash."
    )
    fingerprint: str | None = Field(None, description="Content fingerprint of the model files.")
    bytes: int = Field(0, description="Size of the model files.")
    cached: bool = Field(True, description="Nothing had to be fetched.")


@task(
    name=STEP,
    **STEP_RETRY_POLICY,
)
def download(spec: PipelineSpec) -> ModelLocation:
    """`datagen download --spec SPEC`: resolve the revision, fetch what is missing, verify."""
    logger = get_run_logger()
    if not step_available(STEP):
        return _without_download_step(spec, logger)
    from datagen.storage.model_cache import cache_root  # the host path the step writes to

    cache = cache_root(spec.model_cache)
    cache.mkdir(parents=True, exist_ok=True)
    source = parse_model_source(spec.model)
    with spec_file({**spec.sources_spec(), "model_cache": str(cache)}) as path:
        local = (str(source.path),) if isinstance(source, LocalSource) else ()
        invocation = StepInvocation(
            step=STEP,
            args=("--spec", str(path)),
            mounts=mounts_for(cache, read_only=(path.parent, *local)),
            env=s3_step_env(),  # an S3 mirror's endpoint and region (credentials are secret_env_names)
            secret_env_names=SECRET_ENV,
            labels={"task": STEP},
        )
        result = run_step(invocation, make_runner(spec.runner), log=logger.info)
    location = ModelLocation.model_validate(result)
    logger.info("model %s is at %s (revision %s)", spec.model, location.model_dir, location.resolved_revision)
    return location


def _without_download_step(spec: PipelineSpec, logger) -> ModelLocation:
    source = parse_model_source(spec.model)
    if not isinstance(source, LocalSource):
        raise CannotRunHereError(
            f"model {spec.model} must be downloaded, and this version has no `datagen download` step",
            hint="download it yourself and give the local directory as the spec's model",
        )
    if not Path(source.path).is_dir():
        raise ModelNotFoundError(
            f"model directory {source.path} does not exist",
            hint="for the tiny demo model run `python -m flows.demo --prepare`; else fix the spec's model",
        )
    logger.info("download: this version has no `datagen download` step; using %s in place", source.path)
    return ModelLocation(model_dir=str(source.path))
