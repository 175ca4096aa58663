"""The publish step's task, and the announcement that follows it: publish the dataset where training
reads it, then announce it.

``publish`` (the step task under that name, ``tasks/step.py``) runs `datagen publish DATASET --to
s3://...` when the spec names a destination (cached on the manifest's bytes and the destination:
re-publishing an unchanged dataset costs nothing); its result is the step's own, ``PublishResult``.
``announce`` emits the event ``datagen.dataset.ready`` whose resource is the dataset's fingerprint,
so a training deployment can trigger on it (prefect.yaml: deployment ``train``). The label
``datagen.dataset.changed`` says whether this run wrote anything: the training trigger matches
only changed datasets, so a nightly run with nothing new does not start a training run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefect import get_run_logger, task
from prefect.events import emit_event

from tasks.cache_keys import cache_key
from tasks.mounts import mounts_for
from tasks.pipeline_spec import Runner
from tasks.settings import AWS_CREDENTIAL_ENV, s3_step_env
from tasks.step import STEP_CACHE, StepCall, step_task

if TYPE_CHECKING:
    from datagen.steps.publish import PublishResult

EVENT_READY = "datagen.dataset.ready"
RESOURCE_PREFIX = "datagen.dataset."
SECRET_ENV = AWS_CREDENTIAL_ENV


def publish_cache_key(*, manifest_sha256: str, destination: str) -> str:
    return cache_key("publish", manifest_sha256, destination)


publish = step_task("publish", cache_policy=STEP_CACHE)


def publish_dataset(
    dataset: str, *, destination: str, cache_key: str, runner: Runner, task_options: dict[str, Any] | None = None
) -> PublishResult:
    """`datagen publish DATASET --to s3://...`: shards first, manifest last, only if validated.
    ``task_options``: options of this run of the task (``result_storage``)."""
    from datagen.steps.publish import Spec  # boto3: imported where a run publishes

    call = StepCall(
        step="publish",
        spec=Spec(dataset=dataset, to=destination).model_dump(mode="json"),
        mounts=mounts_for(read_only=(dataset,)),
        env=s3_step_env(),
        secret_env_names=SECRET_ENV,
    )
    return publish.with_options(**(task_options or {}))(call, cache_key=cache_key, runner=runner)


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
