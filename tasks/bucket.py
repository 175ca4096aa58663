"""The dataset's bucket as the fan-out's tasks reach it: one factory for the S3 client, the transfer
settings and the location (``bucket_of``), and the retry of the bucket calls a range run makes
outside any task (``retrying``; docs/decisions.md says why it is not Prefect's)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from datagen.errors import TransientError
from datagen.storage import fleet, s3
from datagen.specs.source import S3Source
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
    """``call()``, again after STEP_RETRY_DELAYS_S when the bucket fails transiently.

    Why not Prefect's retries: each call site is a bucket call made where a Prefect retry would
    redo much more than the call, or nothing at all.

    * The range's child (``tasks/fanout/child.py``: the bucket listings of ``extract_to_bucket``,
      the uploader's last pass, ``write_receipt``) runs in the `extract-shards` flow, not in a
      task: no task retry covers it, and a retry of that flow run would take the lease again and
      start another engine for a listing hiccup; a range run that fails is permanent to the parent
      (``dispatch_range`` fails the whole run on it).
    * The parent's ``dispatch_range`` (reading the range's receipt) is a task without retries on
      purpose: retrying it would submit the range as a new flow run although the range completed.

    Making each call a task of its own would add a task run per shard listing and receipt without
    changing what is retried (docs/decisions.md, "The bucket-call retry of a range run stays a
    loop of its own").
    """
    for delay in [*STEP_RETRY_DELAYS_S, None]:
        try:
            return call()
        except TransientError as e:
            if delay is None:
                raise
            log.warning("%s failed (%s); retrying in %d s", what, str(e).splitlines()[0], delay)
            time.sleep(delay)
