"""The handoff tasks: publish the dataset where training reads it, and announce it.

``publish`` runs `datagen publish DATASET --to s3://...` when the spec names a destination (cached
on the manifest's bytes and the destination: re-publishing an unchanged dataset costs nothing).
``announce`` emits the event ``datagen.dataset.ready`` whose resource is the dataset's fingerprint,
so a training deployment can trigger on it (prefect.yaml: deployment ``train``). The label
``datagen.dataset.changed`` says whether this run wrote anything: the training trigger matches
only changed datasets, so a nightly run with nothing new does not start a training run.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.events import emit_event
from pydantic import BaseModel, ConfigDict, Field

from tasks.pipeline_spec import Runner
from tasks._common import (
    STEP_RETRY_POLICY,
    AWS_CREDENTIAL_ENV,
    cache_key, make_runner, mounts_for,
    run_step, step_available,
)
from tasks.runners import StepInvocation
from tasks.settings import s3_step_env

EVENT_READY = "datagen.dataset.ready"
RESOURCE_PREFIX = "datagen.dataset."
SECRET_ENV = AWS_CREDENTIAL_ENV


class PublishOutcome(BaseModel):
    """Where the dataset was published (None when not)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    destination: str | None = Field(None, description="s3://bucket/prefix, or None when not published.")
    manifest_uri: str | None = Field(None, description="s3:// URI of the published manifest.json.")
    bytes_uploaded: int = Field(0, description="Bytes uploaded by this run.")


def publish_cache_key(*, manifest_sha256: str, destination: str) -> str:
    return cache_key("publish", manifest_sha256, destination)


def _key_from_parameter(context, parameters) -> str:
    return parameters["cache_key"]


@task(
    name="publish",
    cache_key_fn=_key_from_parameter,
    persist_result=True,
    result_serializer="json",
    **STEP_RETRY_POLICY,
)
def publish(dataset: str, *, destination: str, cache_key: str, runner: Runner) -> PublishOutcome:
    """`datagen publish DATASET --to s3://...`: shards first, manifest last, only if validated."""
    logger = get_run_logger()
    if not step_available("publish"):
        logger.warning("publish: this version has no `datagen publish` step; %s stays in %s", destination, dataset)
        return PublishOutcome()
    invocation = StepInvocation(
        step="publish",
        args=(dataset, "--to", destination),
        mounts=mounts_for(read_only=(dataset,)),
        env=s3_step_env(),
        secret_env_names=SECRET_ENV,
        labels={"task": "publish"},
    )
    result = run_step(invocation, make_runner(runner), log=logger.info)
    return PublishOutcome.model_validate(result)


@task(name="announce")
def announce(*, fingerprint: str, dataset: str, uri: str, changed: bool, tokens: int, shards: int) -> str:
    """Emit ``datagen.dataset.ready`` for the dataset. Returns the event's resource id."""
    resource_id = RESOURCE_PREFIX + fingerprint
    emit_event(
        event=EVENT_READY,
        resource={
            "prefect.resource.id": resource_id,
            "prefect.resource.name": uri,
            "datagen.dataset.uri": uri,
            "datagen.dataset.changed": "true" if changed else "false",
        },
        payload={"fingerprint": fingerprint, "dataset": dataset, "uri": uri, "tokens": tokens, "shards": shards,
                 "changed": changed},
    )
    get_run_logger().info("announced %s: %s (%s)", EVENT_READY, uri, "changed" if changed else "unchanged")
    return resource_id
