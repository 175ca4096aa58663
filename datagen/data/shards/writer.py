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
import threading
from pathlib import Path

import numpy as np
import torch

from datagen import settings
from datagen.data.contract import ShardRecord
from datagen.data.files import fsync_dir
from datagen.data.shards.format import (
    FP8,
    SCALE_TENSOR,
    SHARD_FORMAT,
    STORAGE_DTYPES,
    ShardJob,
    safetensors_layout,
)
from datagen.data.shards.kernels import fp8_token_stats, layer_stats, quantize_fp8, token_stats

ALIGN = 4096  # direct I/O: buffer address, length and file offset aligned to this
WRITE_PIECE = 64 << 20  # bytes per write call (and per hash update)


def writer_rank(index: int, tensor_parallel_size: int) -> int:
    """The tensor-parallel rank that writes shard ``index``: every rank holds the full states after
    the all-reduce, so the writes are shared out by index."""
    return index % tensor_parallel_size


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
