"""The `publish` step: copy a validated dataset to S3, shards first, manifest last.

``datagen publish DATASET --to s3://bucket/prefix``

The work is ``datagen.storage.publish.publish`` (the validation gate, the layout at the destination,
resuming, transfers: its module docstring); this module is its command line and result.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from datagen.steps._args import Arg, StepSpec

HELP = "Upload a validated dataset to s3://bucket/prefix: shards in parallel, manifest.json last."


class PublishResult(BaseModel):
    """What `datagen publish` returns."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: str = Field(description="Local dataset directory.")
    destination: str = Field(description="s3://bucket/prefix the dataset was published to.")
    manifest_uri: str = Field(description="s3:// URI of the published manifest.json.")
    manifest_sha256: str = Field(description="sha256 of manifest.json (what validation approved).")
    shards: int = Field(description="Shards in the dataset.")
    uploaded: list[str] = Field(description="Shard paths uploaded by this run.")
    skipped: list[str] = Field(description="Shard paths already at the destination with the same sha256.")
    manifest_uploaded: bool = Field(description="False when the same manifest was already there.")
    bytes_uploaded: int = Field(description="Bytes uploaded by this run (shards + manifest).")
    bytes_total: int = Field(description="Bytes of the dataset (shards + manifest).")
    aborted_stale_uploads: int = Field(description="Unfinished multipart uploads of killed runs, aborted.")
    seconds: float = Field(description="Wall time of the step.")
    upload_mb_per_s: float | None = Field(description="MB/s (1e6 bytes) of the shard uploads, when any.")


class Spec(StepSpec):
    """``datagen publish``'s input: the dataset and where to."""

    SPEC_FILE: ClassVar[bool] = True

    dataset: Annotated[str, Arg(positional=True)] = Field(
        description="local dataset directory (validated: see `datagen validate`)")
    to: Annotated[str, Arg(metavar="S3_URI")] = Field(description="destination s3://bucket/prefix")


Result = PublishResult


def run(spec: Spec) -> PublishResult:
    """``datagen publish DATASET --to S3_URI`` (``datagen.storage.publish.publish``)."""
    from datagen.storage.publish import publish  # boto3: imported where a run publishes

    return PublishResult(**asdict(publish(spec.dataset, to=spec.to)))
