"""Checks of manifest.json on its own, and of row coverage once the shards are scanned."""

from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from datagen.data.contract import FORMAT_VERSION, MANIFEST_NAME, STORED_CODES, Manifest, state_bytes
from datagen.data.media import REASONS as MEDIA_SKIP_REASONS
from datagen.data.shards.kernels import combine_stats, stats_from_sums
from datagen.specs.extraction import canonical_json, sha256_hex
from datagen.validation.report import Findings, Problem, ProblemKind
from datagen.validation.scan import SUMS_RTOL, Expected, ShardScan, compare_stats

SKIP_REASONS = frozenset({"empty", "no_target", *MEDIA_SKIP_REASONS})


@dataclass(frozen=True)
class LoadedManifest:
    """A parsed manifest, the sha256 of its bytes, and the facts every check needs."""

    manifest: Manifest
    sha256: str  # of the manifest.json bytes that were parsed
    expected: Expected
    rows: int  # dataset rows
    samples_per_shard: int | None  # rows per shard, when the spec sized shards by rows
    shard_bytes: int | None  # target bytes of states per shard, when the spec sized shards by bytes
    num_hidden_layers: int
    compute_dtype: str = "bfloat16"  # the engine's dtype (expected.dtype is the storage dtype)


def manifest_sha256(root: Path) -> str | None:
    try:
        return hashlib.sha256((root / MANIFEST_NAME).read_bytes()).hexdigest()
    except OSError:
        return None


def load(root: Path, findings: Findings) -> LoadedManifest | None:
    """Read and parse manifest.json; None (with a problem recorded) when that is impossible."""
    path = root / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        findings.add(Problem(ProblemKind.MANIFEST_MISSING, f"{MANIFEST_NAME} does not exist: the dataset is "
                             "incomplete (it is written last) or this is not a dataset directory"))
        return None
    except OSError as e:
        findings.add(Problem(ProblemKind.MANIFEST_MISSING, f"{MANIFEST_NAME} cannot be read: {e}"))
        return None
    sha = hashlib.sha256(raw).hexdigest()
    try:
        m = Manifest.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"]) or "(root)"
        findings.add(Problem(ProblemKind.MANIFEST_INVALID, f"{MANIFEST_NAME} does not match the contract "
                             f"({e.error_count()} errors, first: {loc}: {first['msg']})"))
        return None
    if m.format_version != FORMAT_VERSION:
        findings.add(Problem(ProblemKind.FORMAT_VERSION, f"format version {m.format_version}; this datagen "
                             f"reads version {FORMAT_VERSION}"))
        return None
    spec = m.spec
    layer_ids = spec.layer_ids
    hidden, n_layers = spec.model.hidden_size, spec.model.num_hidden_layers
    compute_dtype, dtype = spec.dtype, spec.storage_dtype
    pre = spec.preprocessing
    per_shard, target = (pre.samples_per_shard, pre.shard_bytes) if pre else (None, None)
    lacking = [name for name, value in (("dataset.rows", spec.dataset and spec.dataset.rows),
                                        ("preprocessing.samples_per_shard or shard_bytes",
                                         per_shard if per_shard is not None else target))
               if value is None]
    if lacking:
        findings.add(Problem(ProblemKind.SPEC_INVALID, f"the recorded spec lacks {', '.join(lacking)}"))
        return None
    rows = spec.dataset.rows
    sizing_ok = (per_shard is None) != (target is None) and (per_shard or target) >= 1
    if dtype not in STORED_CODES or not layer_ids or not sizing_ok or rows < 0:
        findings.add(Problem(ProblemKind.SPEC_INVALID, f"the recorded spec is inconsistent: dtype {dtype!r}, "
                             f"layer_ids {list(layer_ids)}, samples_per_shard {per_shard}, shard_bytes {target}, "
                             f"rows {rows}"))
        return None
    return LoadedManifest(m, sha, Expected(layer_ids, hidden, dtype), rows, per_shard, target, n_layers,
                          compute_dtype)


def check(lm: LoadedManifest, findings: Findings) -> None:
    """Fingerprints, shard ranges, totals, skipped rows, and statistics that must add up."""
    m, rows = lm.manifest, lm.rows
    _check_fingerprints(m, findings)
    if lm.samples_per_shard is not None:
        _check_row_ranges(m, rows, lm.samples_per_shard, findings)
    else:
        _check_byte_ranges(lm, findings)
    _check_skipped(m, rows, findings)
    totals = {
        "rows": rows, "shards": len(m.shards), "samples": sum(r.samples for r in m.shards),
        "tokens": sum(r.tokens for r in m.shards), "bytes": sum(r.bytes for r in m.shards),
        "skipped": len(m.skipped), "truncated": len(m.truncated),
    }
    for key, value in totals.items():
        if m.totals.get(key) != value:
            findings.add(Problem(ProblemKind.TOTALS, f"totals.{key} is {m.totals.get(key)}, the records add up "
                                 f"to {value}"))
    _check_writers(m, findings)
    _check_own_sums(m, findings)
    with_tokens = [r.layer_stats for r in m.shards if r.tokens]
    if all(len(s) == len(lm.expected.layer_ids) for s in with_tokens):
        combined = combine_stats(with_tokens, lm.expected.layer_ids)
        for msg, lid in compare_stats(combined, m.layer_stats, rtol=SUMS_RTOL):
            findings.add(Problem(ProblemKind.STATS, "dataset statistics do not combine from the shard records: "
                                 + msg, layer_id=lid))


def _check_row_ranges(m: Manifest, rows: int, S: int, findings: Findings) -> None:
    """Shards sized by rows: shard k holds rows [k*S, (k+1)*S)."""
    want_shards = -(-rows // S)
    if len(m.shards) != want_shards:
        findings.add(Problem(ProblemKind.SHARD_RANGES, f"{len(m.shards)} shards listed; {rows} rows in shards of "
                             f"{S} need {want_shards}"))
    for k, rec in enumerate(m.shards):
        want = (k, k * S, min(S, rows - k * S))
        if (rec.index, rec.first_sample, rec.rows) != want:
            findings.add(Problem(ProblemKind.SHARD_RANGES, f"record {k} says index {rec.index}, rows "
                                 f"[{rec.first_sample}, {rec.first_sample + rec.rows}); expected index {k}, "
                                 f"rows [{want[1]}, {want[1] + want[2]})", shard=k, path=rec.path))


def _check_byte_ranges(lm: LoadedManifest, findings: Findings) -> None:
    """Shards sized by bytes: one after the other from row 0 to the last, none empty, none past twice
    the target unless it is one row. Where each cut falls follows from the rows' tokens and content:
    a fresh read of the source checks it (every shard key, ``datagen.validation.source``)."""
    m, rows, target = lm.manifest, lm.rows, lm.shard_bytes
    per_token = state_bytes(lm.expected.dtype, n_layers=len(lm.expected.layer_ids), hidden_size=lm.expected.hidden_size)
    at = 0
    for k, rec in enumerate(m.shards):
        if rec.index != k or rec.first_sample != at or rec.rows < 1:
            findings.add(Problem(ProblemKind.SHARD_RANGES, f"record {k} says index {rec.index}, rows "
                                 f"[{rec.first_sample}, {rec.first_sample + rec.rows}); expected index {k}, at least "
                                 f"one row from row {at}", shard=k, path=rec.path))
        elif rec.rows > 1 and rec.tokens * per_token > 2 * target:
            findings.add(Problem(ProblemKind.SHARD_RANGES, f"record {k} holds {rec.tokens * per_token} bytes of states "
                                 f"in {rec.rows} rows, past twice the target {target}: a shard of several rows closes "
                                 "before that", shard=k, path=rec.path))
        at = rec.first_sample + rec.rows
    if at != rows:
        findings.add(Problem(ProblemKind.SHARD_RANGES, f"the shards' rows end at row {at}; the dataset has {rows} rows"))


def _check_own_sums(m: Manifest, findings: Findings) -> None:
    """Each record's mean and std are what the writer computed from its count, sum and sumsq
    (``stats_from_sums``), so an edit of one of them alone is found even where the values cannot
    be read again."""
    records = [("the dataset", None, m.layer_stats)] + [(f"shard {r.index}", r, r.layer_stats) for r in m.shards]
    for where, rec, stats in records:
        for st in stats:
            own = stats_from_sums(st.layer_id, st.count, st.sum, st.sumsq, st.absmax)
            if (not math.isclose(own.mean, st.mean, rel_tol=SUMS_RTOL, abs_tol=1e-15)
                    or not math.isclose(own.std, st.std, rel_tol=SUMS_RTOL, abs_tol=1e-15)):
                findings.add(Problem(
                    ProblemKind.STATS, f"the statistics of {where} do not follow from their own sums: mean "
                    f"{st.mean:.10g} and std {st.std:.10g} recorded, {own.mean:.10g} and {own.std:.10g} from count "
                    f"{st.count}, sum {st.sum:.10g}, sumsq {st.sumsq:.10g}", layer_id=st.layer_id,
                    **({"shard": rec.index, "path": rec.path} if rec is not None else {})))


def _check_writers(m: Manifest, findings: Findings) -> None:
    ranks = m.spec.engine.tensor_parallel_size or 1
    for rec in m.shards:
        if rec.written_by is not None and rec.written_by >= ranks:
            findings.add(Problem(ProblemKind.SHARD_RANGES, f"record {rec.index} says tensor-parallel rank "
                                 f"{rec.written_by} wrote it; the engine had {ranks}", shard=rec.index, path=rec.path))


def _check_fingerprints(m: Manifest, findings: Findings) -> None:
    # The extraction fingerprint covers the spec without the dataset and without the
    # model's local path (datagen.extraction.plan builds it the same way).
    efp = sha256_hex(canonical_json(m.spec.extraction_record()))
    if efp != m.extraction_fingerprint:
        findings.add(Problem(ProblemKind.FINGERPRINT, "extraction_fingerprint does not match the recorded spec: the "
                             "spec or the fingerprint was edited"))
    fp = sha256_hex(canonical_json({"extraction": m.extraction_fingerprint, "dataset": m.spec.dataset.sha256 if m.spec.dataset else None}))
    if fp != m.fingerprint:
        findings.add(Problem(ProblemKind.FINGERPRINT, "fingerprint does not match the extraction fingerprint and the "
                             "dataset's sha256"))


def _check_skipped(m: Manifest, rows: int, findings: Findings) -> None:
    seen: set[int] = set()
    for s in m.skipped:
        if not 0 <= s.row < rows:
            findings.add(Problem(ProblemKind.SKIPPED, f"skipped row {s.row} is outside [0, {rows})", row=s.row))
        elif s.row in seen:
            findings.add(Problem(ProblemKind.SKIPPED, "listed as skipped more than once", row=s.row))
        if s.reason not in SKIP_REASONS:
            findings.add(Problem(ProblemKind.SKIPPED, f"skipped with reason {s.reason!r}; known reasons are "
                                 f"{sorted(SKIP_REASONS)}", row=s.row))
        seen.add(s.row)


def check_coverage(lm: LoadedManifest, scans: list[ShardScan], findings: Findings) -> None:
    """Every row of a readable shard's range is stored once or listed as skipped, not both.

    Rows in the range of a shard that could not be read are not listed one by one: the
    shard's own problem covers them.
    """
    rows = lm.rows
    stored = np.zeros(rows, dtype=np.int32)
    checked = np.zeros(rows, dtype=bool)
    for sc, rec in zip(scans, lm.manifest.shards):
        if sc.sample_rows is None:
            continue
        lo, hi = max(rec.first_sample, 0), min(rec.first_sample + rec.rows, rows)
        checked[lo:hi] = True
        np.add.at(stored, sc.sample_rows[(sc.sample_rows >= 0) & (sc.sample_rows < rows)], 1)
    skipped = np.zeros(rows, dtype=bool)
    for s in lm.manifest.skipped:
        if 0 <= s.row < rows:
            skipped[s.row] = True
    recs = sorted(lm.manifest.shards, key=lambda rec: rec.first_sample)
    firsts = [rec.first_sample for rec in recs]

    def where(r: int) -> dict:
        i = bisect.bisect_right(firsts, r) - 1
        rec = recs[i] if i >= 0 else None
        return {"shard": rec.index, "path": rec.path} if rec and r < rec.first_sample + rec.rows else {}

    for r in np.nonzero(checked & (stored == 0) & ~skipped)[0].tolist():
        findings.add(Problem(ProblemKind.ROW_MISSING, "in no shard and not listed as skipped", row=r, **where(r)))
    for r in np.nonzero(stored > 1)[0].tolist():
        findings.add(Problem(ProblemKind.ROW_DUPLICATED, f"stored {int(stored[r])} times", row=r, **where(r)))
    for r in np.nonzero((stored > 0) & skipped)[0].tolist():
        findings.add(Problem(ProblemKind.ROW_SKIPPED_AND_STORED, "listed as skipped but stored in a shard", row=r,
                             **where(r)))
