"""The on-disk data contract that training consumes.

A dataset is a directory (or an S3 prefix)::

    <dataset>/manifest.json                    written LAST; its presence means "complete"
    <dataset>/shards/shard-000000.safetensors  packed samples, see SHARD_TENSORS

This module holds the names, dtypes and records of that contract and nothing
that does I/O.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SHARDS_DIR = "shards"
# Private state of an extraction in progress (spec lock, per-shard records). Not part of
# the contract: readers ignore it, and `datagen publish` does not upload it.
STATE_DIR = ".datagen"
# The report of a passing `datagen validate`, kept in the dataset: the gate of publish and export,
# and what tells the orchestration that this manifest was validated.
VALIDATION_REPORT = f"{STATE_DIR}/validation.json"
LAYER_NUMBERING = (
    "vllm: id k is the residual stream entering decoder layer k (hidden_states + residual); "
    "id N = num_hidden_layers is the last layer's output before the final norm"
)

# tensor name -> (dtype, shape description). hidden_states' dtype is the spec's storage_dtype
# (the engine's dtype unless the spec names another).
SHARD_TENSORS = {
    "input_ids": ("int32", "[T]"),
    "loss_mask": ("uint8", "[T]"),
    "hidden_states": ("<spec storage_dtype>", "[T, L, H]"),
    "sample_index": ("int64", "[S]"),
    "sample_offsets": ("int64", "[S+1]"),
}
# storage_dtype fp8_e4m3: hidden_states is float8_e4m3fn and this tensor is added; the stored value
# of hidden_states[t, l, h] is float(hidden_states[t, l, h]) * hidden_states_scale[t, l]
# (scale = absmax over H / 448, 1 for an all-zero vector).
FP8_SCALE_TENSORS = {"hidden_states_scale": ("float32", "[T, L]")}


def shard_name(index: int) -> str:
    """File name of shard ``index`` relative to the dataset root."""
    return f"{SHARDS_DIR}/shard-{index:06d}.safetensors"


class LayerStats(BaseModel):
    """Statistics of one captured layer over every token of a shard or dataset."""

    model_config = ConfigDict(extra="forbid")

    layer_id: int = Field(description="Layer id in vLLM numbering.")
    count: int = Field(description="Number of values (tokens x hidden size).")
    mean: float = Field(description="Mean of all values.")
    std: float = Field(description="Standard deviation of all values.")
    absmax: float = Field(description="Largest absolute value.")
    # sums kept so that shard statistics combine exactly into dataset statistics
    sum: float = Field(description="Sum of all values (float64).")
    sumsq: float = Field(description="Sum of squares of all values (float64).")


class ShardRecord(BaseModel):
    """One shard as the manifest lists it."""

    model_config = ConfigDict(extra="forbid")

    index: int = Field(description="Shard number k: it holds dataset rows [k*S, (k+1)*S).")
    path: str = Field(description="Path relative to the dataset root.")
    first_sample: int = Field(description="First dataset row of the shard's range (k*S).")
    rows: int = Field(description="Dataset rows in the shard's range (kept + skipped).")
    samples: int = Field(description="Samples stored (rows not skipped).")
    tokens: int = Field(description="Tokens stored (T).")
    bytes: int = Field(description="File size in bytes.")
    sha256: str = Field(description="sha256 of the file.")
    shard_key: str = Field(
        description="Cache key: extraction fingerprint + hash of the shard's input rows."
    )
    layer_stats: list[LayerStats] = Field(description="Per-layer statistics of this shard.")


class SkippedRow(BaseModel):
    """A dataset row that is not in any shard, and why."""

    model_config = ConfigDict(extra="forbid")

    row: int = Field(description="Dataset row (0-based line number of a non-blank line).")
    reason: str = Field(description="Why it was skipped: 'empty' or 'no_target'.")


class TruncatedRow(BaseModel):
    """A dataset row that was cut to max_seq_len tokens."""

    model_config = ConfigDict(extra="forbid")

    row: int
    original_tokens: int
    kept_tokens: int


class Manifest(BaseModel):
    """The manifest.json of a complete dataset."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = Field(FORMAT_VERSION, description="Version of this contract.")
    fingerprint: str = Field(description="sha256 of the full spec (the dataset's identity).")
    extraction_fingerprint: str = Field(
        description="sha256 of the spec without the dataset: shared by every shard key."
    )
    spec: dict = Field(description="The resolved spec: model, layers, dataset, preprocessing, engine.")
    shards: list[ShardRecord]
    totals: dict = Field(description="rows, samples, tokens, bytes, shards, skipped, truncated.")
    skipped: list[SkippedRow]
    truncated: list[TruncatedRow]
    layer_stats: list[LayerStats] = Field(description="Per-layer statistics over the dataset.")
    created_at: str = Field(description="UTC time the manifest was written (ISO 8601).")


def validation_path(dataset: str | Path) -> Path:
    """Where a passing validation of ``dataset`` is recorded (``VALIDATION_REPORT``)."""
    return Path(dataset) / VALIDATION_REPORT


def validated_manifest_sha256(dataset: str | Path) -> str | None:
    """The sha256 of the manifest a passing validation of ``dataset`` approved; None when none did."""
    try:
        report = json.loads(validation_path(dataset).read_text())
    except (OSError, ValueError):
        return None
    return report.get("manifest_sha256") if isinstance(report, dict) and report.get("ok") is True else None


def manifest_fingerprint(dataset: str | Path) -> str | None:
    """The fingerprint in ``dataset``'s manifest.json; None when there is no readable one."""
    try:
        found = json.loads((Path(dataset) / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return found.get("fingerprint") if isinstance(found, dict) else None
