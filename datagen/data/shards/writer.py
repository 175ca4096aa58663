"""Writing shards: packing samples, atomic writes, checksums and statistics.

Used by every engine, in whichever process holds the hidden states (the vLLM
worker writes its shards itself). A shard appears under its final name only
when it is complete and fsynced: a reader never sees half a shard, and a crash
never leaves a truncated file that a resume would count as done. The file image
and its write are ``datagen.data.shards.image``'s; ``write_shard`` fills one from
a shard's states at once (the vLLM capture fills one piece by piece).
"""

from __future__ import annotations

import mmap
import threading

import torch

from datagen.data.contract import ShardRecord
from datagen.data.shards.format import FP8, ShardJob
from datagen.data.shards.image import Layout, ShardImage, close_buffer, new_buffer
from datagen.data.shards.kernels import quantize_fp8


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
        buf = getattr(cls._local, "buf", None)
        if buf is None or len(buf) < size:
            if buf is not None:
                cls._local.buf = None
                close_buffer(buf)
            buf = cls._local.buf = new_buffer(size)
        return buf


def _pieces(x) -> list[torch.Tensor]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


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
    L = len(job.layer_ids)
    for row, ids, st in zip(job.sample_rows, job.input_ids, states):
        n = sum(int(c.shape[0]) for c in st)
        if n != len(ids) or any(c.dim() != 3 or c.shape[1] != L for c in st):
            shapes = [tuple(c.shape) for c in st]
            raise ValueError(
                f"shard {job.index} row {row}: states of shape {shapes[0] if len(shapes) == 1 else shapes} "
                f"for {len(ids)} tokens and {L} layers"
            )
    fp8 = job.storage_dtype == FP8
    stats = [_pieces(x) for x in per_sample_stats] if per_sample_stats is not None else None
    scales = [_pieces(x) for x in per_sample_scales] if per_sample_scales is not None else None
    if fp8 and scales is None:  # states from an engine that does not quantize (the reference)
        q = [[quantize_fp8(c) for c in st] for st in states]
        states = [[a for a, _ in s] for s in q]
        scales = [[b for _, b in s] for s in q]
        stats = None  # statistics describe the stored values
    layout = Layout.of(job)
    image = ShardImage(job, _Buffer.get(layout.size), layout)
    for i, st in enumerate(states):
        at = 0
        for j, c in enumerate(st):
            image.put(i, at, c, scale=scales[i][j] if fp8 else None, stats=stats[i][j] if stats else None)
            at += int(c.shape[0])
    return image.finish()
