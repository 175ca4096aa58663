"""The dataset's bucket as the fan-out's tasks reach it: one factory (``bucket_of``) for the S3 client,
the transfer settings and the location. A bucket call made outside any task is retried by
``tasks.retries.retrying``."""

from __future__ import annotations

from typing import Any, NamedTuple

from datagen.storage import fleet, s3
from datagen.specs.source import S3Source
from tasks.pipeline_spec import PipelineSpec


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
