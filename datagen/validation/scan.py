"""Per-shard checks: one pass over each shard file.

``scan_shard`` runs in a worker thread (hashing and torch reductions release the
GIL). It checks, in this order: the path stays inside the dataset, the file exists
with the recorded size, the header is a sane safetensors header with the
contract's tensors, the shard belongs to this spec (shard key, layer ids), offsets
and sample rows are consistent, token ids and loss masks equal a fresh
tokenization (when the source was read), and finally one read of the whole file
computes its sha256 together with per-layer statistics and the positions of any
non-finite value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from datagen.data.contract import FP8_SCALE_TENSORS, SHARD_TENSORS, STORED_CODES, LayerStats, ShardRecord, volume_root
from datagen.data.dataset import Sample
from datagen.data.shards.format import SHARD_FORMAT
from datagen.errors import ValidationFailed
from datagen.validation.layer_sums import LayerSums
from datagen.validation.report import Problem, ProblemKind
from datagen.validation.shardfile import MappedShard, ShardHeader, read_header

# Relative tolerance of recomputed statistics: float32 partial sums against the
# writer's float64 sums differ by about 1e-6 of the standard deviation.
STATS_RTOL = 1e-4
# Relative tolerance of statistics combined from recorded float64 sums (dataset from shards, a
# record's mean and std from its own sums): the writer's arithmetic, so only summation order differs.
SUMS_RTOL = 1e-9
# At most this many problems of one kind are listed per shard; the rest are counted.
MAX_LISTED = 50


@dataclass(frozen=True)
class Expected:
    """What every shard of the dataset must agree with (from the manifest's spec)."""

    layer_ids: tuple[int, ...]  # order of the L axis
    hidden_size: int  # H
    dtype: str  # storage dtype name of hidden_states ("bfloat16", ..., "fp8_e4m3")

    @property
    def fp8(self) -> bool:
        return self.dtype == "fp8_e4m3"


@dataclass
class ShardScan:
    """What scanning one shard found."""

    index: int  # shard index in the manifest
    path: str  # as the manifest lists it
    root: Path | None = None  # the output volume the path is relative to (set by scan_shard)
    readable: bool = False  # tensors conform to the contract: rows and stats below are meaningful
    problems: list[Problem] = field(default_factory=list)
    bytes_read: int = 0
    sample_rows: np.ndarray | None = None  # int64 [S]: dataset row of each sample
    offsets: np.ndarray | None = None  # int64 [S+1]
    stats: list[LayerStats] | None = None  # recomputed over finite values
    non_finite_layers: set[int] = field(default_factory=set)  # layer ids holding NaN/Inf

    def problem(self, kind: ProblemKind, message: str, *, row: int | None = None,
                layer_id: int | None = None) -> None:
        self.problems.append(Problem(kind, message, shard=self.index, path=self.path, row=row,
                                     layer_id=layer_id))


def resolve_inside(root: Path, rel: str) -> Path | None:
    """``root/rel`` if it stays inside ``root`` after resolving links, else None."""
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts or not rel:
        return None
    root_r = root.resolve()
    full = (root / p).resolve()
    if full != root_r and root_r not in full.parents:
        return None
    return full


def scan_shard(root: Path, rec: ShardRecord, exp: Expected, *,
               fresh: dict[int, Sample] | None = None, fresh_key: str | None = None,
               volumes: list[str] | tuple[str, ...] = ()) -> ShardScan:
    """Run every per-shard check on shard ``rec`` of the dataset at ``root``.

    Args:
        fresh: row -> sample from a fresh tokenization of the source rows, or None when
            the source could not be read.
        fresh_key: the shard's cache key recomputed from the spec and the source rows.
    """
    out = ShardScan(index=rec.index, path=rec.path)
    try:
        out.root = volume_root(root, volumes, rec.volume)
    except ValueError as e:
        out.problem(ProblemKind.SHARD_MISSING, f"{rec.path}: {e}")
        return out
    full = resolve_inside(out.root, rec.path)
    if full is None:
        out.problem(ProblemKind.UNSAFE_PATH, f"path {rec.path!r} escapes the dataset directory; refused")
        return out
    if not full.is_file():
        out.problem(ProblemKind.SHARD_MISSING, f"{rec.path} does not exist")
        return out
    size = full.stat().st_size
    if size != rec.bytes:
        out.problem(ProblemKind.SHARD_SIZE, f"{size} bytes, the manifest says {rec.bytes}"
                    + (" (truncated)" if size < rec.bytes else ""))
    if fresh_key is not None and rec.shard_key != fresh_key:
        out.problem(ProblemKind.SHARD_FOREIGN, "the manifest's shard key does not match the spec and the "
                    "source rows of this shard's range")
    try:
        header = read_header(full)
    except ValidationFailed as e:
        for p in e.problems:
            out.problem(p.kind, p.message)
        _hash_only(full, rec, out)
        return out
    if not _conforms(header, rec, exp, out):
        with MappedShard(full, header) as m:
            _hash_and_compare(m, rec, out, None)
        return out
    with MappedShard(full, header) as m:
        out.readable = True
        _check_rows(m, rec, out)
        if fresh is not None and out.sample_rows is not None:
            _check_tokens(m, out, fresh)
        hs = m.header.tensors["hidden_states"]
        # fp8: the statistics are of the stored values, fp8 * scale (the scales are read here, [T, L])
        scale = m.tensor("hidden_states_scale").clone() if exp.fp8 else None
        acc = LayerSums(hs.shape[0], len(exp.layer_ids), exp.hidden_size, scale)
        _hash_and_compare(m, rec, out, lambda first, rows: acc.add(rows, first))
        acc.finish(lambda t: m.rows("hidden_states", t, t + 1)[0])
        out.stats = acc.stats(exp.layer_ids)
        out.non_finite_layers = {exp.layer_ids[j] for j in acc.bad_layers}
        _report_non_finite(acc, out, exp)
        if hs.shape[0] and out.stats is not None:
            for msg, lid in compare_stats(out.stats, rec.layer_stats, skip=out.non_finite_layers):
                out.problem(ProblemKind.STATS, msg, layer_id=lid)
    return out


def _hash_only(full: Path, rec: ShardRecord, out: ShardScan) -> None:
    import hashlib

    h = hashlib.sha256()
    with full.open("rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
            out.bytes_read += len(block)
    if h.hexdigest() != rec.sha256:
        out.problem(ProblemKind.SHARD_CHECKSUM, "sha256 differs from the manifest")


def _hash_and_compare(m: MappedShard, rec: ShardRecord, out: ShardScan, on_rows) -> None:
    try:
        sha = m.scan(rows_of="hidden_states" if on_rows else None, on_rows=on_rows)
    except ValidationFailed as e:
        for p in e.problems:
            out.problem(p.kind, p.message)
        return
    out.bytes_read += m.header.file_size
    if sha != rec.sha256:
        out.problem(ProblemKind.SHARD_CHECKSUM,
                    f"sha256 {sha[:16]}... differs from the manifest's {rec.sha256[:16]}...")


def _conforms(h: ShardHeader, rec: ShardRecord, exp: Expected, out: ShardScan) -> bool:
    """Tensor names, dtypes and shapes of the contract; metadata of this spec."""
    names = set(h.tensors)
    want = set(SHARD_TENSORS) | (set(FP8_SCALE_TENSORS) if exp.fp8 else set())
    if names != want:
        extra, missing = sorted(names - want), sorted(want - names)
        out.problem(ProblemKind.SHARD_TENSORS,
                    f"tensors differ from the contract: missing {missing}, unexpected {extra}")
        return False
    codes = {"input_ids": "I32", "loss_mask": "U8", "sample_index": "I64", "sample_offsets": "I64",
             "hidden_states": STORED_CODES.get(exp.dtype, "?"), **({"hidden_states_scale": "F32"} if exp.fp8 else {})}
    ok = True
    for name, code in codes.items():
        if h.tensors[name].dtype != code:
            out.problem(ProblemKind.SHARD_TENSORS,
                        f"{name} has dtype {h.tensors[name].dtype}, the contract says {code}")
            ok = False
    shp = {k: v.shape for k, v in h.tensors.items()}
    L, H = len(exp.layer_ids), exp.hidden_size
    if len(shp["input_ids"]) != 1:
        out.problem(ProblemKind.SHARD_TENSORS, f"input_ids has shape {list(shp['input_ids'])}, expected [T]")
        return False
    T = shp["input_ids"][0]
    if len(shp["sample_index"]) != 1:
        out.problem(ProblemKind.SHARD_TENSORS, f"sample_index has shape {list(shp['sample_index'])}, expected [S]")
        return False
    S = shp["sample_index"][0]
    shapes = (("loss_mask", (T,)), ("hidden_states", (T, L, H)), ("sample_offsets", (S + 1,)))
    for name, want_shape in shapes + ((("hidden_states_scale", (T, L)),) if exp.fp8 else ()):
        if shp[name] != want_shape:
            out.problem(ProblemKind.SHARD_TENSORS, f"{name} has shape {list(shp[name])}, expected {list(want_shape)} "
                        f"(T={T}, S={S}, L={L} layers, H={H})")
            ok = False
    meta = shard_metadata(h.metadata)
    if meta.get("format") != SHARD_FORMAT:
        out.problem(ProblemKind.SHARD_FOREIGN, f"metadata format is {meta.get('format')!r}, expected {SHARD_FORMAT!r}")
    if meta.get("shard_key") != rec.shard_key:
        out.problem(ProblemKind.SHARD_FOREIGN, "the file's shard key differs from the manifest's: it was extracted "
                    "for another spec or other rows")
    if meta.get("layer_ids") != list(exp.layer_ids):
        out.problem(ProblemKind.SHARD_FOREIGN, f"the file holds layers {meta.get('layer_ids')}, the spec "
                    f"{list(exp.layer_ids)}")
    if ok:
        if S != rec.samples:
            out.problem(ProblemKind.SHARD_RECORD, f"{S} samples, the manifest says {rec.samples}")
        if T != rec.tokens:
            out.problem(ProblemKind.SHARD_RECORD, f"{T} tokens, the manifest says {rec.tokens}")
    return ok


def shard_metadata(raw: dict[str, str]) -> dict:
    """format, shard_key and layer_ids (a list) from a shard's safetensors metadata.

    The writer stores them as one JSON string under "datagen" (one key keeps the file
    byte-identical across runs); early shards stored three strings, layer ids comma-joined.
    """
    if "datagen" in raw:
        try:
            meta = json.loads(raw["datagen"])
        except ValueError:
            return {}
        return meta if isinstance(meta, dict) else {}
    ids = raw.get("layer_ids")
    try:
        layers = [int(x) for x in ids.split(",")] if ids else None
    except ValueError:
        layers = None
    return {"format": raw.get("format"), "shard_key": raw.get("shard_key"), "layer_ids": layers}


def _check_rows(m: MappedShard, rec: ShardRecord, out: ShardScan) -> None:
    off = m.tensor("sample_offsets").numpy().copy()
    rows = m.tensor("sample_index").numpy().copy()
    T = m.header.tensors["input_ids"].shape[0]
    if off.size == 0 or off[0] != 0 or off[-1] != T or (off.size > 1 and np.any(np.diff(off) <= 0)):
        bad = np.nonzero(np.diff(off) <= 0)[0] if off.size > 1 else np.array([], dtype=np.int64)
        where = f"; sample {int(bad[0])} (row {int(rows[bad[0]])}) is empty or goes backwards" if bad.size else ""
        out.problem(ProblemKind.OFFSETS, f"sample_offsets must rise strictly from 0 to T={T}, "
                    f"got first {int(off[0]) if off.size else None}, last {int(off[-1]) if off.size else None}{where}")
    else:
        out.offsets = off
    lo, hi = rec.first_sample, rec.first_sample + rec.rows
    outside = rows[(rows < lo) | (rows >= hi)]
    for r in outside[:MAX_LISTED]:
        out.problem(ProblemKind.SAMPLE_INDEX, f"stores row {int(r)}, outside the shard's range [{lo}, {hi})",
                    row=int(r))
    uniq, counts = np.unique(rows, return_counts=True)
    for r in uniq[counts > 1][:MAX_LISTED]:
        out.problem(ProblemKind.SAMPLE_INDEX, f"stores row {int(r)} more than once", row=int(r))
    if out.offsets is not None and not outside.size and not np.any(counts > 1):
        out.sample_rows = rows
    mask = m.tensor("loss_mask")
    if mask.numel() and int(mask.max()) > 1:
        out.problem(ProblemKind.LOSS_MASK_VALUES, "loss_mask holds values other than 0 and 1")


def _check_tokens(m: MappedShard, out: ShardScan, fresh: dict[int, Sample]) -> None:
    ids = m.tensor("input_ids").numpy()
    mask = m.tensor("loss_mask").numpy()
    listed = {ProblemKind.TOKENS: 0, ProblemKind.LOSS_MASK: 0}

    def report(kind: ProblemKind, msg: str, row: int) -> None:
        listed[kind] += 1
        if listed[kind] <= MAX_LISTED:
            out.problem(kind, msg, row=row)

    for s, r in enumerate(out.sample_rows.tolist()):
        a, b = int(out.offsets[s]), int(out.offsets[s + 1])
        ref = fresh.get(r)
        if ref is None:
            report(ProblemKind.TOKENS, "stored, but a fresh tokenization skips this row", r)
            continue
        if b - a != len(ref.input_ids) or not np.array_equal(ids[a:b], ref.input_ids):
            n = min(b - a, len(ref.input_ids))
            diff = np.nonzero(ids[a:a + n] != ref.input_ids[:n])[0]
            first = int(diff[0]) if diff.size else n
            report(ProblemKind.TOKENS, f"{b - a} stored token ids differ from a fresh tokenization "
                   f"({len(ref.input_ids)} tokens) from position {first}", r)
        elif not np.array_equal(mask[a:b], ref.loss_mask):
            report(ProblemKind.LOSS_MASK, "stored loss mask differs from a fresh tokenization", r)
    for kind, n in listed.items():
        if n > MAX_LISTED:
            out.problem(kind, f"{n - MAX_LISTED} more rows of this shard have this problem (not listed)")


def _report_non_finite(acc: LayerSums, out: ShardScan, exp: Expected) -> None:
    if not acc.bad:
        return
    off, rows = out.offsets, out.sample_rows
    listed = 0
    for j, tokens in sorted(acc.bad.items()):
        tok = np.asarray(tokens, dtype=np.int64)
        if off is not None and rows is not None:
            samples = np.searchsorted(off, tok, side="right") - 1
            for s in np.unique(samples):
                hit = tok[samples == s]
                listed += 1
                if listed <= MAX_LISTED:
                    out.problem(ProblemKind.NON_FINITE,
                                f"NaN/Inf in {hit.size} token(s) of this sample, first at position "
                                f"{int(hit[0] - off[s])}", row=int(rows[s]), layer_id=exp.layer_ids[j])
        else:
            out.problem(ProblemKind.NON_FINITE, f"NaN/Inf in {tok.size} token(s), first at shard token {int(tok[0])}",
                        layer_id=exp.layer_ids[j])
    if listed > MAX_LISTED:
        out.problem(ProblemKind.NON_FINITE, f"{listed - MAX_LISTED} more samples hold NaN/Inf (not listed)")


def compare_stats(found: list[LayerStats], recorded: list[LayerStats], *, skip: set[int] = frozenset(),
                  rtol: float = STATS_RTOL) -> list[tuple[str, int | None]]:
    """Messages (and layer id) for each layer whose recorded statistics differ from ``found``.

    Every field is compared: count exactly, mean within ``rtol`` of the standard deviation, std
    and sumsq within ``rtol`` of themselves, sum within ``rtol`` of sqrt(count * sumsq) (a bound
    on the sum of the values' magnitudes), absmax within 1e-6. ``rtol``: STATS_RTOL for statistics
    recomputed from the values; SUMS_RTOL for statistics combined from recorded sums (the
    writer's own arithmetic, so only rounding may differ)."""
    if [s.layer_id for s in found] != [s.layer_id for s in recorded]:
        return [(f"statistics list layers {[s.layer_id for s in recorded]}, the data holds "
                 f"{[s.layer_id for s in found]}", None)]
    msgs = []
    for f, r in zip(found, recorded):
        if f.layer_id in skip:
            continue
        scale = max(abs(r.std), 1e-12)
        bad = []
        if f.count != r.count:
            bad.append(f"count {f.count} vs recorded {r.count}")
        if not math.isclose(f.mean, r.mean, rel_tol=0, abs_tol=rtol * scale):
            bad.append(f"mean {f.mean:.6g} vs recorded {r.mean:.6g}")
        if not math.isclose(f.std, r.std, rel_tol=rtol, abs_tol=1e-12):
            bad.append(f"std {f.std:.6g} vs recorded {r.std:.6g}")
        magnitude = math.sqrt(max(f.count, 0) * max(f.sumsq, 0.0))
        if not math.isclose(f.sum, r.sum, rel_tol=0, abs_tol=rtol * magnitude + 1e-12):
            bad.append(f"sum {f.sum:.10g} vs recorded {r.sum:.10g}")
        if not math.isclose(f.sumsq, r.sumsq, rel_tol=rtol, abs_tol=1e-12):
            bad.append(f"sumsq {f.sumsq:.10g} vs recorded {r.sumsq:.10g}")
        if not math.isclose(f.absmax, r.absmax, rel_tol=1e-6, abs_tol=1e-12):
            bad.append(f"absmax {f.absmax:.6g} vs recorded {r.absmax:.6g}")
        if bad:
            msgs.append(("recomputed statistics differ from the manifest: " + ", ".join(bad), f.layer_id))
    return msgs
