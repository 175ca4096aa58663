"""Writing shards: packing samples, atomic writes, checksums and statistics.

Used by every engine, in whichever process holds the hidden states (the vLLM
worker writes its shards itself). A shard appears under its final name only
when it is complete and fsynced: a reader never sees half a shard, and a crash
never leaves a truncated file that a resume would count as done.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from datagen import settings
from datagen.data.files import atomic_write_bytes, atomic_write_json, fsync_dir  # noqa: F401 (re-exported)
from datagen.data.contract import WORK_ELEMENTS, LayerStats, ShardRecord

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# storage dtype name (the spec's storage_dtype) -> dtype of the stored hidden_states
STORAGE_DTYPES = {**TORCH_DTYPES, "fp8_e4m3": torch.float8_e4m3fn}
SHARD_FORMAT = "datagen-shard-1"


@dataclass(frozen=True)
class ShardJob:
    """Everything needed to write one shard except its hidden states."""

    index: int  # shard number k
    path: str  # absolute final path of the shard file
    first_row: int  # k * samples_per_shard
    rows: int  # rows in the shard's range (kept + skipped)
    sample_rows: tuple[int, ...]  # dataset rows stored, in order
    input_ids: tuple[np.ndarray, ...]  # int32 [T_i] per stored row
    loss_masks: tuple[np.ndarray, ...]  # uint8 [T_i] per stored row
    layer_ids: tuple[int, ...]  # captured layers, the order of the L axis
    dtype: str  # storage dtype of hidden_states (a STORAGE_DTYPES name)
    hidden_size: int  # H
    shard_key: str  # cache key of this shard
    # per stored row: its images (datagen.data.media.MediaItem), () for a text row; () for none at all
    media: tuple = ()

    @property
    def tokens(self) -> int:
        return int(sum(len(x) for x in self.input_ids))

    def to_wire(self) -> dict:
        """Plain lists and numbers, for an RPC that serializes with msgpack."""
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["input_ids"] = [x.tolist() for x in self.input_ids]
        d["loss_masks"] = [x.tolist() for x in self.loss_masks]
        d["sample_rows"] = list(self.sample_rows)
        d["layer_ids"] = list(self.layer_ids)
        d["media"] = [[m.to_wire() for m in items] for items in self.media]
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "ShardJob":
        return cls(**{
            **d,
            "input_ids": tuple(np.asarray(x, dtype=np.int32) for x in d["input_ids"]),
            "loss_masks": tuple(np.asarray(x, dtype=np.uint8) for x in d["loss_masks"]),
            "sample_rows": tuple(int(r) for r in d["sample_rows"]),
            "layer_ids": tuple(int(i) for i in d["layer_ids"]),
            "media": _media_from_wire(d.get("media") or []),
        })


def writer_rank(index: int, tensor_parallel_size: int) -> int:
    """The tensor-parallel rank that writes shard ``index``: every rank holds the full states after
    the all-reduce, so the writes are shared out by index."""
    return index % tensor_parallel_size


def _media_from_wire(rows: list) -> tuple:
    if not any(rows):
        return tuple(() for _ in rows)
    from datagen.data.media import MediaItem

    return tuple(tuple(MediaItem.from_wire(m) for m in items) for items in rows)


def token_stats(states: torch.Tensor) -> torch.Tensor:
    """[T, L, 3] float32 per-token, per-layer (sum, sum of squares, absmax) over H.

    Computed where the states are (on the GPU, before the copy to the host), so the writer
    only adds up T x L numbers per shard instead of reading every value again. The float32
    values pass through a workspace of ``WORK_ELEMENTS`` (stats_into), never a float32 copy
    of the whole tensor.
    """
    t, L, h = states.shape
    out = torch.zeros((3, t, L), dtype=torch.float32, device=states.device)
    if states.numel():
        work = torch.empty((work_rows(h, t), h), dtype=torch.float32, device=states.device)
        for j in range(L):
            stats_into(states[:, j], out[:, :, j], work)
    return out.permute(1, 2, 0).contiguous()




def work_rows(hidden: int, tokens: int | None = None) -> int:
    """Tokens per chunk of the float32 workspace: WORK_ELEMENTS // hidden (at most ``tokens``)."""
    rows = max(1, WORK_ELEMENTS // max(1, hidden))
    return max(1, min(rows, tokens)) if tokens is not None else rows


def _chunks(x: torch.Tensor, work: torch.Tensor):
    """(start, end, float32 copy of x[start:end] in the workspace) over ``x`` in chunks of work's rows."""
    n, c = x.shape[0], work.shape[0]
    for a in range(0, n, c):
        b = min(n, a + c)
        w = work[: b - a]
        w.copy_(x[a:b])
        yield a, b, w


def _sums_into(w: torch.Tensor, out: torch.Tensor, a: int, b: int, s: torch.Tensor | None = None) -> None:
    """out[:, a:b] = (sum, sum of squares, absmax) of the chunk ``w`` (consumed), times the scale s."""
    out[0, a:b] = w.sum(-1) if s is None else w.sum(-1) * s
    w.abs_()
    out[2, a:b] = w.amax(-1) if s is None else w.amax(-1) * s
    w.square_()
    out[1, a:b] = w.sum(-1) if s is None else w.sum(-1) * (s * s)


def _norms_into(x: torch.Tensor, out: torch.Tensor, a: int, b: int, s: torch.Tensor | None = None) -> None:
    """_sums_into without the workspace, for CUDA tensors: the reductions read ``x`` (bf16, fp16 or
    float32) once each and accumulate in float32 without a float32 copy (PyTorch's mixed-precision
    reductions on CUDA); the sum of squares is the squared 2-norm. Three kernels per call, however
    many tokens: the GPU path of the capture (CPU tensors would be cast whole, so they go through
    the chunked workspace instead)."""
    f32 = torch.float32
    su = torch.sum(x, -1, dtype=f32)
    sq = torch.linalg.vector_norm(x, 2, -1, dtype=f32).square_()
    mx = torch.linalg.vector_norm(x, float("inf"), -1, dtype=f32)
    if s is not None:
        su.mul_(s)
        mx.mul_(s)
        sq.mul_(s * s)
    out[0, a:b] = su
    out[1, a:b] = sq
    out[2, a:b] = mx


def stats_into(x: torch.Tensor, out: torch.Tensor, work: torch.Tensor) -> None:
    """Statistics of ``x`` [n, H] into ``out`` [3, n] (sum, sum of squares, absmax), through the
    float32 workspace ``work`` [C, H] in chunks of C tokens: nothing is allocated but the sums.
    On CUDA the reductions read ``x`` directly (_norms_into): no workspace pass, no chunks."""
    if x.is_cuda:
        _norms_into(x, out, 0, x.shape[0])
        return
    for a, b, w in _chunks(x, work):
        _sums_into(w, out, a, b)


def quantize_into(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None,
                  work: torch.Tensor) -> None:
    """fp8 of ``x`` [n, H] into ``q`` [n, H] (float8_e4m3fn) with its per-token ``scale`` [n]
    (absmax / 448, 1 for an all-zero vector) and, when ``out`` [3, n] is given, the statistics of
    the stored (dequantized) values, chunked through ``work`` [C, H] as stats_into."""
    if x.is_cuda:
        _quantize_cuda(x, q, scale, out, work)
        return
    for a, b, w in _chunks(x, work):
        s = torch.linalg.vector_norm(w, float("inf"), -1)  # absmax, no |w| copy
        s = torch.where(s == 0, torch.ones_like(s), s / FP8_MAX)
        scale[a:b] = s
        w.div_(s.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
        q[a:b] = w
        if out is not None:
            w.copy_(q[a:b])
            _sums_into(w, out, a, b, s)


_FP8_OUT: dict[str, bool] = {}


def _fp8_division_stores(device: torch.device) -> bool:
    """True when a division can store float8 directly (``torch.div(..., out=fp8)``: computed in
    float32, rounded once on store, as ``.to(float8)`` rounds) on this device; probed once."""
    key = str(device)
    if key not in _FP8_OUT:
        x = torch.tensor([[1.0, -3.0, 0.3]], device=device, dtype=torch.bfloat16)
        s = torch.tensor([0.01], device=device)
        try:
            q = torch.empty((1, 3), dtype=torch.float8_e4m3fn, device=device)
            torch.div(x, s.unsqueeze(-1), out=q)
            ref = (x.float() / s.unsqueeze(-1)).to(torch.float8_e4m3fn)
            _FP8_OUT[key] = bool(torch.equal(q.view(torch.uint8), ref.view(torch.uint8)))
        except (RuntimeError, TypeError):
            _FP8_OUT[key] = False
    return _FP8_OUT[key]


def _quantize_cuda(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None,
                   work: torch.Tensor) -> None:
    """quantize_into on CUDA with few passes over memory and few kernels: the scales from one
    absmax reduction of ``x`` itself (float32 accumulation, no copy); one division of the whole
    [n, H] that stores fp8 directly (no clamp: |x / (absmax / 448)| exceeds 448 by float32 rounding
    at most, which fp8 rounds to 448); the statistics of the stored values read back through the
    workspace as bfloat16 (every fp8 value is exact in bfloat16: twice the rows per chunk of a
    float32 copy), unscaled sums per chunk, scaled once at the end. Where a division cannot store
    fp8, it goes through the float32 workspace in chunks."""
    s = torch.linalg.vector_norm(x, float("inf"), -1, dtype=torch.float32)
    s = torch.where(s == 0, 1.0, s / FP8_MAX)
    scale.copy_(s)
    n = x.shape[0]
    if _fp8_division_stores(x.device):
        torch.div(x, s.unsqueeze(-1), out=q)
    else:
        c = work.shape[0]
        for a in range(0, n, c):
            b = min(n, a + c)
            w = work[: b - a]
            torch.div(x[a:b], s[a:b].unsqueeze(-1), out=w)
            q[a:b] = w
    if out is None:
        return
    wb = work.view(-1)[: work.numel()].view(torch.bfloat16).view(-1, x.shape[1])
    c = wb.shape[0]
    for a in range(0, n, c):
        b = min(n, a + c)
        w = wb[: b - a]
        w.copy_(q[a:b])
        _norms_into(w, out, a, b)
    out[0].mul_(s)
    out[2].mul_(s)
    out[1].mul_(s * s)


def layer_stats(hidden_states: torch.Tensor, layer_ids: tuple[int, ...],
                per_token: torch.Tensor | None = None) -> list[LayerStats]:
    """Per-layer count, mean, std, absmax of a [T, L, H] tensor, with float64 sums.

    ``per_token`` ([T, L, 3] from ``token_stats``) saves the pass over the values.
    """
    t, _, h = hidden_states.shape
    if per_token is None:
        per_token = token_stats(hidden_states) if t else torch.zeros((0, len(layer_ids), 3))
    p = per_token.to(torch.float64)
    out = []
    for j, lid in enumerate(layer_ids):
        n = t * h
        if t == 0:
            out.append(stats_from_sums(lid, 0, 0.0, 0.0, 0.0))
            continue
        out.append(stats_from_sums(lid, n, float(p[:, j, 0].sum()), float(p[:, j, 1].sum()), float(p[:, j, 2].max())))
    return out


def stats_from_sums(layer_id: int, count: int, s: float, ss: float, absmax: float) -> LayerStats:
    mean = s / count if count else 0.0
    var = max(ss / count - mean * mean, 0.0) if count else 0.0
    return LayerStats(layer_id=layer_id, count=count, mean=mean, std=var**0.5, absmax=absmax, sum=s, sumsq=ss)


def combine_stats(per_shard: list[list[LayerStats]], layer_ids: tuple[int, ...]) -> list[LayerStats]:
    """Dataset statistics from shard statistics (exact: sums add)."""
    out = []
    for j, lid in enumerate(layer_ids):
        parts = [s[j] for s in per_shard if s]
        n = sum(p.count for p in parts)
        out.append(
            stats_from_sums(
                lid, n, sum(p.sum for p in parts), sum(p.sumsq for p in parts),
                max((p.absmax for p in parts), default=0.0),
            )
        )
    return out


# --- fp8 storage ------------------------------------------------------------------------------
# ``storage_dtype`` fp8_e4m3: hidden_states float8_e4m3fn [T, L, H] and hidden_states_scale
# float32 [T, L], value = float(fp8) * scale, scale = absmax over H of that token's layer / 448
# (1 where the vector is all zeros). Statistics and validation describe the stored values.
FP8 = "fp8_e4m3"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_TENSOR = "hidden_states_scale"


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, L, H] states -> (float8_e4m3fn [n, L, H], float32 scale [n, L]), on x's device.

    A vector holding NaN or Inf gets a non-finite scale, so it dequantizes to NaN and
    validation still finds it. Chunked through a float32 workspace (quantize_into).
    """
    n, L, h = x.shape
    q = torch.empty((n, L, h), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.ones((n, L), dtype=torch.float32, device=x.device)
    if x.numel():
        work = torch.empty((work_rows(h, n), h), dtype=torch.float32, device=x.device)
        for j in range(L):
            quantize_into(x[:, j], q[:, j], scale[:, j], None, work)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [n, L, H] values of stored fp8 states and their [n, L] scales."""
    return q.float().mul_(scale.float().unsqueeze(-1))


def fp8_token_stats(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """token_stats of the dequantized values without materializing them: s*sum, s^2*sumsq, s*absmax."""
    st = token_stats(q)
    if not st.numel():
        return st
    s = scale.float()
    return torch.stack([st[..., 0] * s, st[..., 1] * (s * s), st[..., 2] * s], dim=-1)


def stored_states(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """hidden_states of a loaded shard as stored values: fp8 shards are dequantized (float32)."""
    hs = tensors["hidden_states"]
    if hs.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(hs, tensors[SCALE_TENSOR])
    return hs


# --- serialization ----------------------------------------------------------------------------
# The safetensors layout, written here so that the bytes go from the states to the disk once:
# an 8-byte little-endian header length, the JSON header padded with spaces to a multiple of 8,
# then the tensors ordered by safetensors' dtype order (descending) and name. The output is
# byte-identical to ``safetensors.torch.save_file`` (a test holds it to that).
_ST_CODE = {torch.int64: "I64", torch.float32: "F32", torch.int32: "I32", torch.bfloat16: "BF16",
            torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8"}
_ST_ORDER = {"U8": 4, "F8_E4M3": 7, "F16": 11, "BF16": 12, "I32": 13, "F32": 15, "I64": 18}  # Rust enum order
ALIGN = 4096  # direct I/O: buffer address, length and file offset aligned to this
WRITE_PIECE = 64 << 20  # bytes per write call (and per hash update)


def safetensors_layout(entries: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                       metadata: dict[str, str]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The header bytes (length prefix included) and each tensor's [start, end) in the file."""
    order = sorted(entries, key=lambda n: (-_ST_ORDER[_ST_CODE[entries[n][0]]], n))
    header: dict = {"__metadata__": metadata} if metadata else {}
    spans, pos = {}, 0
    for name in order:
        dtype, shape = entries[name]
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_CODE[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
        spans[name] = (pos, pos + n)
        pos += n
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    return head, {k: (a + len(head), b + len(head)) for k, (a, b) in spans.items()}


class _Buffer:
    """A page-aligned, reused file image (one per writer thread).

    Fresh anonymous memory costs a page fault per page on first touch (0.3 GB/s on a
    virtual machine); reusing the image makes packing a plain copy.
    """

    _local = threading.local()

    @classmethod
    def get(cls, size: int) -> mmap.mmap:
        size = max(ALIGN, -(-size // ALIGN) * ALIGN)
        buf = getattr(cls._local, "buf", None)
        if buf is None or len(buf) < size:
            if buf is not None:
                cls._local.buf = None
                try:
                    buf.close()
                except BufferError:  # a tensor still views it: the memory goes with the last view
                    pass
            buf = mmap.mmap(-1, size)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    buf.madvise(mmap.MADV_HUGEPAGE)
                except OSError:
                    pass
            cls._local.buf = buf
        return buf


def _view(buf: mmap.mmap, span: tuple[int, int], dtype: torch.dtype, shape) -> torch.Tensor:
    a, b = span
    return torch.frombuffer(buf, dtype=torch.uint8, count=b - a, offset=a).view(dtype).view(*shape) if b > a \
        else torch.empty(shape, dtype=dtype)


def _pieces(x) -> list[torch.Tensor]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _open_tmp(tmp: Path, direct: bool) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(tmp, flags | os.O_DIRECT, 0o644), True
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    return os.open(tmp, flags, 0o644), False


def write_image(tmp: Path, buf: mmap.mmap, size: int, *, direct: bool = True) -> tuple[str, bool]:
    """Write ``buf[:size]`` to ``tmp`` (created) and fsync it once; its sha256 is computed from the
    same memory by a thread of its own while the writes run (never read back from the file).

    Direct I/O (O_DIRECT) where the filesystem takes it: the pages go from the image to the
    device, not through the page cache. The last piece is padded to the alignment and the
    file truncated to ``size``. Filesystems without it (tmpfs, some network ones) get buffered
    writes. Returns the sha256 and whether direct I/O was used.
    """
    h = hashlib.sha256()
    mv = memoryview(buf)

    def hash_all() -> None:  # alongside the writes: both release the GIL, so they overlap
        for a in range(0, size, WRITE_PIECE):
            h.update(mv[a:min(size, a + WRITE_PIECE)])

    hasher = threading.Thread(target=hash_all, name="datagen-shard-hash", daemon=True)
    hasher.start()
    fd, used_direct = _open_tmp(tmp, direct)
    try:
        pos = 0
        while pos < size:
            end = min(size, pos + WRITE_PIECE)
            wend = -(-end // ALIGN) * ALIGN if used_direct else end
            if wend > end:
                buf[end:wend] = bytes(wend - end)  # zero the padding of a reused image
            while pos < wend:
                try:
                    n = os.write(fd, mv[pos:wend])
                except OSError as e:
                    if not used_direct or e.errno != errno.EINVAL or pos != 0:
                        raise
                    # the filesystem accepted O_DIRECT at open but not this alignment: start over buffered
                    os.close(fd)
                    fd, used_direct = _open_tmp(tmp, False)
                    wend = end
                    continue
                pos += n
            pos = end
        if used_direct and size % ALIGN:
            os.ftruncate(fd, size)
        os.fchmod(fd, 0o644)  # readable by others whatever the umask
        os.fsync(fd)
    finally:
        os.close(fd)
        hasher.join()
        mv.release()
    return h.hexdigest(), used_direct


def write_shard(job: ShardJob, per_sample_states: list, per_sample_stats: list | None = None,
                per_sample_scales: list | None = None) -> ShardRecord:
    """Pack the samples of ``job`` with their [T_i, L, H] states and write the shard atomically.

    Each sample's states (and stats, scales) may be one tensor or a list of chunks in token
    order (the vLLM capture's chunked-prefill steps); they are copied once, into the file
    image, which is hashed and written from there (no read-back), fsynced once, then renamed.

    ``per_sample_stats`` ([T_i, L, 3] from ``token_stats``), when the caller has them, spares
    a pass over the states for the statistics. For fp8 storage, states given with
    ``per_sample_scales`` are already quantized; states without are quantized here.
    """
    if len(per_sample_states) != len(job.sample_rows):
        raise ValueError(f"shard {job.index}: {len(per_sample_states)} state tensors for {len(job.sample_rows)} samples")
    states = [_pieces(x) for x in per_sample_states]
    L, H = len(job.layer_ids), job.hidden_size
    for row, ids, st in zip(job.sample_rows, job.input_ids, states):
        n = sum(int(c.shape[0]) for c in st)
        if n != len(ids) or any(c.dim() != 3 or c.shape[1] != L for c in st):
            shapes = [tuple(c.shape) for c in st]
            raise ValueError(
                f"shard {job.index} row {row}: states of shape {shapes[0] if len(shapes) == 1 else shapes} "
                f"for {len(ids)} tokens and {L} layers"
            )
    fp8 = job.dtype == FP8
    dtype = STORAGE_DTYPES[job.dtype]
    stats = [_pieces(x) for x in per_sample_stats] if per_sample_stats is not None else None
    scales = [_pieces(x) for x in per_sample_scales] if per_sample_scales is not None else None
    if fp8 and scales is None:  # states from an engine that does not quantize (the reference)
        q = [[quantize_fp8(c) for c in st] for st in states]
        states = [[a for a, _ in s] for s in q]
        scales = [[b for _, b in s] for s in q]
        stats = None  # statistics describe the stored values
    lengths = [len(x) for x in job.input_ids]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    T = int(offsets[-1])
    entries = {
        "input_ids": (torch.int32, (T,)),
        "loss_mask": (torch.uint8, (T,)),
        "hidden_states": (dtype, (T, L, H)),
        "sample_index": (torch.int64, (len(job.sample_rows),)),
        "sample_offsets": (torch.int64, (len(offsets),)),
    }
    meta = {"format": SHARD_FORMAT, "shard_key": job.shard_key, "layer_ids": list(job.layer_ids)}
    if fp8:
        entries[SCALE_TENSOR] = (torch.float32, (T, L))
        meta["storage_dtype"] = FP8
    # One metadata key: safetensors writes a map's keys in no fixed order, and shards must be
    # byte-identical across runs.
    head, spans = safetensors_layout(entries, {"datagen": json.dumps(meta, sort_keys=True, ensure_ascii=False)})
    size = max(b for _, b in spans.values()) if spans else len(head)
    buf = _Buffer.get(size)
    buf[: len(head)] = head
    views = {name: _view(buf, spans[name], d, shape) for name, (d, shape) in entries.items()}
    if T:
        views["input_ids"].copy_(torch.from_numpy(np.concatenate(job.input_ids).astype(np.int32, copy=False)))
        views["loss_mask"].copy_(torch.from_numpy(np.concatenate(job.loss_masks).astype(np.uint8, copy=False)))
    views["sample_index"].copy_(torch.tensor(job.sample_rows, dtype=torch.int64))
    views["sample_offsets"].copy_(torch.from_numpy(offsets))
    hs = views["hidden_states"]
    t = 0
    for i, st in enumerate(states):
        for j, c in enumerate(st):
            n = int(c.shape[0])
            hs[t:t + n].copy_(c)
            if fp8:
                views[SCALE_TENSOR][t:t + n].copy_(scales[i][j])
            t += n
    if stats is None and T:
        stats = [[fp8_token_stats(hs, views[SCALE_TENSOR]) if fp8 else token_stats(hs)]]
    per_token = torch.cat([c for s in stats for c in s], dim=0) if stats else None
    record_stats = layer_stats(hs, job.layer_ids, per_token)
    final = Path(job.path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        digest, _ = write_image(tmp, buf, size, direct=settings.direct_io())
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not keep the half-written file
        raise
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return ShardRecord(
        index=job.index,
        path=f"shards/{final.name}",
        first_sample=job.first_row,
        rows=job.rows,
        samples=len(job.sample_rows),
        tokens=T,
        bytes=size,
        sha256=digest,
        shard_key=job.shard_key,
        layer_stats=record_stats,
    )


# e4m3 keeps 3 mantissa bits: with a per-vector absmax scale, a token's stored vector differs from
# the bf16 one by 2.6% (relative L2) at the median and at most 3.6% in the measurements
# (docs/performance.md). Checks against a reference add this to their bounds for fp8 datasets.
FP8_REL_ERROR = 0.04


def fp8_allowance(criterion):
    """A golden criterion (datagen.validation.compare.GoldenCriterion) widened by fp8's rounding."""
    import dataclasses

    return dataclasses.replace(criterion, median_max=criterion.median_max + FP8_REL_ERROR,
                               quantile_max=criterion.quantile_max + FP8_REL_ERROR)
