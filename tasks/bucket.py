"""The dataset's bucket as the fan-out's tasks reach it: one factory for the S3 client, the transfer
settings and the location (``bucket_of``), and the retry of the bucket calls a range run makes
outside any task (``retrying``; docs/decisions.md says why it is not Prefect's)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from datagen.errors import TransientError
from datagen.storage import fleet, s3
from datagen.storage.sources import S3Source
from tasks.pipeline_spec import PipelineSpec
from tasks.retries import STEP_RETRY_DELAYS_S

T = TypeVar("T")


class Bucket(NamedTuple):
    """What a task needs to reach the dataset's bucket (``spec.publish_to``)."""

    client: Any  # a boto3 S3 client (datagen.storage.s3.make_client)
    transfer: s3.TransferSettings  # part sizes and concurrency of uploads and downloads
    dest: S3Source  # the dataset's location in the bucket


def bucket_of(spec: PipelineSpec) -> Bucket:
    """The client, transfer settings and location of the dataset's bucket of ``spec``; the S3
    endpoint and credentials are the process's (``datagen.settings``)."""
    transfer = s3.TransferSettings.from_settings()
    return Bucket(s3.make_client(transfer), transfer, fleet.location(spec.publish_to))


def retrying(call: Callable[[], T], what: str, log) -> T:
    """``call()``, again after STEP_RETRY_DELAYS_S when the bucket fails transiently (a range run
    is a flow, not a task: nothing else would retry it, and a failed range fails the parent)."""
    for delay in [*STEP_RETRY_DELAYS_S, None]:
        try:
            return call()
        except TransientError as e:
            if delay is None:
                raise
            log.warning("%s failed (%s); retrying in %d s", what, str(e).splitlines()[0], delay)
            time.sleep(delay)
