"""The on-disk data contract that training consumes.

A dataset is a directory (or an S3 prefix)::

    <dataset>/manifest.json                    written LAST; its presence means "complete"
    <dataset>/shards/shard-000000.safetensors  packed samples, see SHARD_TENSORS

This module holds the names, dtypes and records of that contract and nothing
that does I/O.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

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
# The stored form of hidden_states by storage dtype (the spec's storage_dtype): the tensor's
# safetensors dtype code and the bytes of one value. The one table of them: the writer's torch dtypes
# (datagen.data.shards.format), the reader's and validation's expected codes derive from it.
STORED_FORMS: dict[str, tuple[str, int]] = {
    "bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4), "fp8_e4m3": ("F8_E4M3", 1),
}
STORED_VALUE_BYTES = {name: nbytes for name, (_, nbytes) in STORED_FORMS.items()}
STORED_CODES = {name: code for name, (code, _) in STORED_FORMS.items()}
TOKEN_OVERHEAD_BYTES = 5  # input_ids int32 + loss_mask uint8 per token
# The capture's and the writer's float32 workspace, in elements: statistics and fp8 scales are
# computed over chunks of this many values (tokens x hidden), never a float32 copy of the whole step.
WORK_ELEMENTS = 8 << 20  # 32 MiB


def token_bytes(storage_dtype: str, *, n_layers: int, hidden_size: int) -> int:
    """Bytes one token costs in a shard: its states in ``storage_dtype`` (fp8_e4m3: with its float32
    scale per layer), its id and its loss mask.

    Raises:
        KeyError: a dtype the contract does not store.
    """
    states = n_layers * hidden_size * STORED_VALUE_BYTES[storage_dtype]
    scales = n_layers * 4 if storage_dtype == "fp8_e4m3" else 0
    return states + scales + TOKEN_OVERHEAD_BYTES


def state_bytes(storage_dtype: str, *, n_layers: int, hidden_size: int) -> int:
    """Bytes of stored states per token: L x H x the storage dtype's bytes (fp8: and its float32
    scale per layer). The shard file's ids and loss mask (5 bytes a token) are not counted."""
    return token_bytes(storage_dtype, n_layers=n_layers, hidden_size=hidden_size) - TOKEN_OVERHEAD_BYTES


@dataclass(frozen=True)
class ShardFormat:
    """What every shard of one extraction shares, fixed by its plan: the captured layers (the order of
    the states' L axis, the header's ``layer_ids``), the stored dtype of hidden_states (a STORED_FORMS
    name) and H. The one form these take from the plan to the shard header: an engine is given it
    once, when it starts (a worker sizes its buffers by it before any shard is announced), and every
    ``ShardJob`` of the run holds the same object, so a shard's message to a worker carries only
    what is the shard's own."""

    layer_ids: tuple[int, ...]
    storage_dtype: str
    hidden_size: int

    def __post_init__(self) -> None:
        if self.storage_dtype not in STORED_FORMS:
            raise ValueError(f"storage dtype {self.storage_dtype!r}: not one of {sorted(STORED_FORMS)}")

    def to_wire(self) -> dict:
        """Plain lists and numbers (JSON in vLLM's additional_config)."""
        return {"layer_ids": list(self.layer_ids), "storage_dtype": self.storage_dtype, "hidden_size": self.hidden_size}

    @classmethod
    def from_wire(cls, d: dict) -> "ShardFormat":
        return cls(layer_ids=tuple(int(i) for i in d["layer_ids"]), storage_dtype=str(d["storage_dtype"]),
                   hidden_size=int(d["hidden_size"]))


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

    index: int = Field(description="Shard number k: it holds the dataset rows [first_sample, first_sample + rows), "
                       "the plan's k-th cut (shards close by bytes, rows whole).")
    path: str = Field(description="Path relative to the dataset root.")
    first_sample: int = Field(description="First dataset row of the shard's range (the plan's k-th boundary).")
    rows: int = Field(description="Dataset rows in the shard's range (kept + skipped).")
    samples: int = Field(description="Samples stored (rows not skipped).")
    tokens: int = Field(description="Tokens stored (T).")
    bytes: int = Field(description="File size in bytes.")
    sha256: str = Field(description="sha256 of the file.")
    shard_key: str = Field(
        description="Cache key: extraction fingerprint + hash of the shard's input rows."
    )
    layer_stats: list[LayerStats] = Field(description="Per-layer statistics of this shard.")
    volume: int = Field(0, ge=0, description="Output volume holding the file: 0 the dataset directory, i >= 1 the "
                        "manifest's volumes[i-1]; ``path`` is relative to that volume.")
    written_by: int | None = Field(None, ge=0, description="Tensor-parallel rank whose worker wrote the file "
                                   "(shard k: rank k mod TP); None for engines without ranks.")


class SkippedRow(BaseModel):
    """A dataset row that is not in any shard, and why."""

    model_config = ConfigDict(extra="forbid")

    row: int = Field(description="Dataset row (0-based line number of a non-blank line).")
    reason: str = Field(description="Why it was skipped: 'empty', 'no_target', or for an image row "
                                    "'media_missing', 'media_unreadable', 'media_too_long'.")


class ImageRecord(BaseModel):
    """One image of a row: which file, and the placeholder tokens it became in ``input_ids``."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="The image's url as the row wrote it.")
    sha256: str = Field(description="sha256 of the image file's bytes.")
    offset: int = Field(description="Position of its first placeholder token in the sample.")
    tokens: int = Field(description="Placeholder tokens it expanded to (vLLM's count; loss_mask 0 there).")


class MediaRecord(BaseModel):
    """A stored row that had images."""

    model_config = ConfigDict(extra="forbid")

    row: int = Field(description="Dataset row.")
    images: list[ImageRecord]


class TruncatedRow(BaseModel):
    """A dataset row that was cut to max_seq_len tokens."""

    model_config = ConfigDict(extra="forbid")

    row: int
    original_tokens: int
    kept_tokens: int


class _Recorded(BaseModel):
    """A part of the recorded spec: it serializes to exactly the keys it was given.

    The extraction fingerprint is the sha256 of the recorded spec (less the dataset and the model's
    local path), and validation recomputes it from the manifest: a key added on the way (a default
    written as null) would break that, so what was not given is never written. Unknown keys (a
    newer engine's description) are kept as they are, for the same reason.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    @model_serializer(mode="wrap")
    def _as_given(self, handler) -> dict[str, Any]:
        data = handler(self)
        given = self.model_fields_set
        return {k: v for k, v in data.items() if k in given or k not in type(self).model_fields}

    def record(self) -> dict[str, Any]:
        """The JSON object as recorded (the keys given, nothing added)."""
        return self.model_dump(mode="json")


class ResolvedModel(_Recorded):
    """The model as the recorded spec names it."""

    source: str | None = Field(None, description="Local directory extracted from (not in any fingerprint).")
    revision: str | None = Field(None, description="Resolved revision, or 'content:<sha256>' of its files.")
    architecture: str | None = Field(None, description="The config's architecture, e.g. LlamaForCausalLM.")
    num_hidden_layers: int = Field(description="Decoder layers N (layer id N: the last layer's output).")
    hidden_size: int = Field(description="H of a stored state.")


class ResolvedPreprocessing(_Recorded):
    """How the rows became tokens, and how they were cut into shards."""

    max_seq_len: int | None = Field(None, description="Tokens a row was truncated to (the value used).")
    chat_template_sha256: str | None = Field(None, description="sha256 of the chat template (chat rows).")
    tokenizer_sha256: str | None = Field(None, description="sha256 of the tokenizer (chat rows).")
    samples_per_shard: int | None = Field(None, description="Dataset rows per shard S (shards sized by rows).")
    shard_bytes: int | None = Field(None, description="Target bytes of stored states per shard (shards sized by "
                                    "bytes: boundaries cut by content, datagen.extraction.boundaries).")


class ResolvedDataset(_Recorded):
    """The dataset file extracted from."""

    source: str | None = Field(None, description="The JSONL file (absolute; not in the extraction fingerprint).")
    sha256: str | None = Field(None, description="sha256 of its bytes.")
    rows: int | None = Field(None, description="Its rows (non-blank lines).")
    format: str | None = Field(
        None, description="How its rows were stored and written, recognised at plan time: '<container>/<row formats>', "
                          "container jsonl, json, folder, hf-disk, parquet or arrow; row formats messages, sharegpt, "
                          "ultrachat, tokens joined by '+' (e.g. 'jsonl/sharegpt'). None: not recorded.")


class ResolvedEngine(_Recorded):
    """The engine as it was described and configured (its settings but dtype and storage_dtype)."""

    name: str | None = Field(None, description="vllm or hf.")
    version: str | None = Field(None, description="The engine's package version.")
    patches: list[str] | None = Field(None, description="Names of the vLLM patches applied.")
    attention_backend: str | None = Field(None, description="vLLM's attention backend (vllm only).")
    capture_path: str | None = Field(None, description="How the states left vLLM: internal (the worker extension "
                                     "on the V1 runner) or public (extract_hidden_states and the KV connector).")
    model_runner: str | None = Field(None, description="vLLM's model runner: v1, v2, or auto (vLLM's pick).")
    tensor_parallel_size: int | None = Field(None, description="GPUs per engine.")


class ResolvedSpec(_Recorded):
    """The spec a dataset was extracted with, everything resolved: what the manifest records as
    ``spec``, what `datagen plan` reports and every reader of a dataset reads.

    ``storage_dtype`` is resolved here, once: a recorded spec without one (manifests written before
    it existed) stored the compute dtype. The value filled in is not written back.
    """

    model: ResolvedModel = Field(description="The model: revision, architecture, layers, hidden size.")
    layer_ids: tuple[int, ...] = Field(description="Captured layers in vLLM numbering, the order of the layer axis.")
    layer_numbering: str | None = Field(None, description="The numbering rule of layer_ids.")
    dtype: str = Field(description="Compute dtype of the engine.")
    storage_dtype: str | None = Field(
        None, description="dtype of the stored hidden_states (bfloat16, float16, float32, fp8_e4m3); "
        "the compute dtype where the record names none.")
    preprocessing: ResolvedPreprocessing | None = Field(None, description="Tokenization and shard size.")
    engine: ResolvedEngine = Field(default_factory=ResolvedEngine, description="Engine description and settings.")
    dataset: ResolvedDataset | None = Field(None, description="The dataset file: source, sha256, rows.")

    @model_validator(mode="after")
    def _storage_dtype_resolved(self) -> "ResolvedSpec":
        if self.storage_dtype is None:
            self.__dict__["storage_dtype"] = self.dtype  # not marked given: not written back
        return self

    def extraction_record(self) -> dict[str, Any]:
        """The part the extraction fingerprint covers: the record without the dataset and without
        the model's local path."""
        rec = self.record()
        rec.pop("dataset", None)
        rec["model"] = {k: v for k, v in rec.get("model", {}).items() if k != "source"}
        return rec


class Manifest(BaseModel):
    """The manifest.json of a complete dataset."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = Field(FORMAT_VERSION, description="Version of this contract.")
    fingerprint: str = Field(description="sha256 of the full spec (the dataset's identity).")
    extraction_fingerprint: str = Field(
        description="sha256 of the spec without the dataset: shared by every shard key."
    )
    spec: ResolvedSpec = Field(description="The resolved spec: model, layers, dataset, preprocessing, engine.")
    shards: list[ShardRecord]
    volumes: list[str] = Field(default_factory=list, description="Absolute paths of the further output volumes "
                               "(volume i is volumes[i-1]); empty: every shard is in the dataset directory.")
    totals: dict = Field(description="rows, samples, tokens, bytes, shards, skipped, truncated.")
    skipped: list[SkippedRow]
    truncated: list[TruncatedRow]
    layer_stats: list[LayerStats] = Field(description="Per-layer statistics over the dataset.")
    media: list[MediaRecord] = Field(default_factory=list,
                                     description="The stored rows that had images, in row order (none: a text dataset).")
    created_at: str = Field(description="UTC time the manifest was written (ISO 8601).")


def volume_root(dataset: str | Path, volumes: list[str] | tuple[str, ...], volume: int) -> Path:
    """The directory a shard record's ``path`` is relative to: the dataset for volume 0, else
    ``volumes[volume - 1]``.

    Raises:
        ValueError: the volume is not in the list.
    """
    if volume == 0:
        return Path(dataset)
    if not 0 < volume <= len(volumes):
        raise ValueError(f"volume {volume} is not among the manifest's {len(volumes)} further volumes")
    return Path(volumes[volume - 1])


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


class Approval(enum.Enum):
    """What the validation record of a dataset says of the manifest bytes at hand."""

    APPROVED = "approved"  # a passing validation approved exactly these bytes
    NONE = "none"  # no passing validation is recorded
    STALE = "stale"  # a passing validation approved other bytes: the manifest changed since


def approval_of(dataset: str | Path, manifest_bytes: bytes) -> Approval:
    """Whether a passing validation of ``dataset`` approved exactly ``manifest_bytes`` (the bytes
    the caller read and will use, so that what is checked is what is used)."""
    approved = validated_manifest_sha256(dataset)
    if approved is None:
        return Approval.NONE
    return Approval.APPROVED if approved == hashlib.sha256(manifest_bytes).hexdigest() else Approval.STALE


def manifest_fingerprint(dataset: str | Path) -> str | None:
    """The fingerprint in ``dataset``'s manifest.json; None when there is no readable one."""
    try:
        found = json.loads((Path(dataset) / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return found.get("fingerprint") if isinstance(found, dict) else None
