"""Problem records and the validation report.

A problem names what is wrong and where: the shard (index and path) and the
dataset row it concerns, when it concerns one. The report is plain JSON so the
orchestration layer can turn it into a markdown artifact without importing
datagen.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class ProblemKind(str, enum.Enum):
    """Every kind of problem validation can report. The value is what the report shows."""

    # manifest.json on its own
    MANIFEST_MISSING = "manifest_missing"  # no manifest.json: the dataset is incomplete
    MANIFEST_INVALID = "manifest_invalid"  # not JSON, or not the contract's schema
    MANIFEST_CHANGED = "manifest_changed"  # manifest.json changed while it was validated
    FORMAT_VERSION = "format_version"  # a contract version this code does not read
    SPEC_INVALID = "spec_invalid"  # the recorded spec lacks a field validation needs
    FINGERPRINT = "fingerprint"  # fingerprints do not match the recorded spec
    TOTALS = "totals"  # totals do not add up from the shard records
    SHARD_RANGES = "shard_ranges"  # shard row ranges do not tile the dataset's rows
    SKIPPED = "skipped"  # a skipped-row record is invalid (no reason, out of range, twice)
    # shard files
    UNSAFE_PATH = "unsafe_path"  # a shard path escapes the dataset directory
    SHARD_MISSING = "shard_missing"  # listed but absent
    SHARD_SIZE = "shard_size"  # size differs from the manifest (truncated or grown)
    SHARD_CHECKSUM = "shard_checksum"  # sha256 differs from the manifest
    SHARD_HEADER = "shard_header"  # not a readable safetensors file (oversized/corrupt header)
    SHARD_TENSORS = "shard_tensors"  # tensor names, dtypes or shapes differ from the contract
    SHARD_FOREIGN = "shard_foreign"  # the shard belongs to another spec (shard key, layers)
    SHARD_RECORD = "shard_record"  # the manifest's record disagrees with the shard's contents
    OFFSETS = "offsets"  # sample_offsets not 0..T strictly increasing
    SAMPLE_INDEX = "sample_index"  # a stored row outside the shard's range, or stored twice
    LOSS_MASK_VALUES = "loss_mask_values"  # loss_mask holds a value other than 0 or 1
    # rows
    ROW_MISSING = "row_missing"  # a row in no shard and not listed as skipped
    ROW_DUPLICATED = "row_duplicated"  # a row stored in more than one shard
    ROW_SKIPPED_AND_STORED = "row_skipped_and_stored"  # listed as skipped but stored
    # the source rows
    SOURCE_UNAVAILABLE = "source_unavailable"  # model or dataset cannot be read (check needs it)
    SOURCE_CHANGED = "source_changed"  # the source dataset or model is not the one recorded
    TOKENS = "tokens"  # stored token ids differ from a fresh tokenization
    LOSS_MASK = "loss_mask"  # stored loss mask differs from a fresh tokenization
    # numerics
    NON_FINITE = "non_finite"  # NaN or Inf in hidden states
    STATS = "stats"  # recomputed per-layer statistics differ from the manifest
    DRIFT = "drift"  # per-layer statistics moved too far from the previous dataset
    PREVIOUS_INCOMPATIBLE = "previous_incompatible"  # --previous is of another model or layers
    # golden samples
    GOLDEN_MISMATCH = "golden_mismatch"  # stored states differ from a re-extraction
    GOLDEN_UNAVAILABLE = "golden_unavailable"  # the reference engine cannot run


class CheckStatus(str, enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    NOT_RUN = "not_run"  # could not run or was not asked for; the report says why


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a dataset."""

    kind: ProblemKind
    message: str  # what is wrong, in a sentence
    shard: int | None = None  # shard index in the manifest
    path: str | None = None  # shard path relative to the dataset root
    row: int | None = None  # dataset row (0-based line of the source JSONL)
    layer_id: int | None = None  # captured layer (vLLM numbering)

    def to_json(self) -> dict:
        d = {"kind": self.kind.value, "message": self.message}
        for k in ("shard", "path", "row", "layer_id"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        return d

    def __str__(self) -> str:
        where = [f"shard {self.shard}" if self.shard is not None else None,
                 f"row {self.row}" if self.row is not None else None,
                 f"layer {self.layer_id}" if self.layer_id is not None else None]
        loc = ", ".join(w for w in where if w)
        return f"[{self.kind.value}] {loc + ': ' if loc else ''}{self.message}"


@dataclass
class Check:
    """The outcome of one named check."""

    status: CheckStatus
    note: str = ""  # why it did not run, or a one-line summary

    def to_json(self) -> dict:
        return {"status": self.status.value, **({"note": self.note} if self.note else {})}


@dataclass
class Findings:
    """Problems and check outcomes collected while validating."""

    problems: list[Problem] = field(default_factory=list)
    checks: dict[str, Check] = field(default_factory=dict)

    def add(self, problem: Problem) -> None:
        self.problems.append(problem)

    def extend(self, problems) -> None:
        self.problems.extend(problems)

    def outcome(self, name: str, kinds: set[ProblemKind], *, note: str = "") -> None:
        """Record check ``name`` as failed if any problem of ``kinds`` was found, else passed."""
        failed = any(p.kind in kinds for p in self.problems)
        self.checks[name] = Check(CheckStatus.FAILED if failed else CheckStatus.PASSED, note)

    def not_run(self, name: str, why: str) -> None:
        self.checks[name] = Check(CheckStatus.NOT_RUN, why)
