"""A shard's file image, filled as its states arrive, and written from its start as its bytes
become final.

A shard's layout is known before any of its states exist: every row's token count is fixed at
plan time, so the safetensors header, each tensor's place in the file and the small tensors
(token ids, loss mask, sample index and offsets) are written into the image when it is made.
The states then go straight to their place, piece by piece, in whatever order the engine
produces them (``ShardImage.put``); nothing holds a shard's pieces until its last row is in.

The file's bytes are final from its start up to ``ShardImage.ready()``: the tensors set when
the image is made, then the states (token-major) up to the first token not yet put. While the
shard fills, ``stream`` writes and hashes that final prefix to the shard's temporary file
(``ImageFile``: direct I/O, sequential, hashed from the same memory), so that when the last
row comes in only the bytes after the prefix are left to write. ``finish`` adds up the
statistics, writes the rest, fsyncs once, renames the file into place and returns its record.
fp8 shards keep their scales ahead of the states in the file (safetensors orders tensors by
alignment), so their prefix is final only once every token is in: they are written whole by
``finish``. The bytes are those ``safetensors.torch.save_file`` writes (tests/test_shards.py),
however much was streamed.

``ImagePool`` hands the capture its images: page-aligned anonymous memory, reused from shard to
shard (fresh memory costs a page fault per page on first touch), within a byte budget.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from datagen import settings
from datagen.data.contract import ShardRecord
from datagen.data.files import fsync_dir
from datagen.data.shards.format import FP8, SCALE_TENSOR, SHARD_FORMAT, STORAGE_DTYPES, ShardJob, safetensors_layout
from datagen.data.shards.image_file import ALIGN, WRITE_PIECE, ImageFile
from datagen.data.shards.kernels import fp8_token_stats, layer_stats, token_stats



@dataclass(frozen=True)
class Layout:
    """Where everything of one shard lies in its file: the header bytes, each tensor's [start, end)
    and its dtype and shape, and each row's first token."""

    head: bytes
    spans: dict[str, tuple[int, int]]
    entries: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    offsets: np.ndarray  # int64 [S+1]: row i is tokens [offsets[i], offsets[i+1])
    size: int  # bytes of the file

    @classmethod
    def of(cls, job: ShardJob) -> "Layout":
        L, H = len(job.layer_ids), job.hidden_size
        offsets = np.zeros(len(job.input_ids) + 1, dtype=np.int64)
        np.cumsum([len(x) for x in job.input_ids], out=offsets[1:])
        T = int(offsets[-1])
        entries = {
            "input_ids": (torch.int32, (T,)),
            "loss_mask": (torch.uint8, (T,)),
            "hidden_states": (STORAGE_DTYPES[job.storage_dtype], (T, L, H)),
            "sample_index": (torch.int64, (len(job.sample_rows),)),
            "sample_offsets": (torch.int64, (len(offsets),)),
        }
        meta = {"format": SHARD_FORMAT, "shard_key": job.shard_key, "layer_ids": list(job.layer_ids)}
        if job.storage_dtype == FP8:
            entries[SCALE_TENSOR] = (torch.float32, (T, L))
            meta["storage_dtype"] = FP8
        # One metadata key: safetensors writes a map's keys in no fixed order, and shards must be
        # byte-identical across runs.
        head, spans = safetensors_layout(entries, {"datagen": json.dumps(meta, sort_keys=True, ensure_ascii=False)})
        size = max(b for _, b in spans.values()) if spans else len(head)
        return cls(head, spans, entries, offsets, size)


def shard_bytes(job: ShardJob) -> int:
    """Bytes of the shard's file (what an image for it must hold)."""
    return Layout.of(job).size


def _view(buf: mmap.mmap, span: tuple[int, int], dtype: torch.dtype, shape) -> torch.Tensor:
    a, b = span
    return torch.frombuffer(buf, dtype=torch.uint8, count=b - a, offset=a).view(dtype).view(*shape) if b > a \
        else torch.empty(shape, dtype=dtype)


class ShardImage:
    """One shard's file in memory while its states arrive.

    Not thread-safe: one thread puts (the capture's packer, or ``write_shard``), then one finishes.
    """

    def __init__(self, job: ShardJob, buf: mmap.mmap, layout: Layout | None = None):
        """``buf``: at least ``shard_bytes(job)`` bytes; the image's views live in it until ``finish``."""
        self.job = job
        self.layout = lay = layout or Layout.of(job)
        if len(buf) < lay.size:
            raise ValueError(f"shard {job.index}: an image of {len(buf)} bytes for a file of {lay.size}")
        self.buf = buf
        self.fp8 = job.storage_dtype == FP8
        buf[: len(lay.head)] = lay.head
        self.views = {name: _view(buf, lay.spans[name], d, shape) for name, (d, shape) in lay.entries.items()}
        T = self.tokens
        if T:
            self.views["input_ids"].copy_(torch.from_numpy(np.concatenate(job.input_ids).astype(np.int32, copy=False)))
            self.views["loss_mask"].copy_(torch.from_numpy(np.concatenate(job.loss_masks).astype(np.uint8, copy=False)))
        self.views["sample_index"].copy_(torch.tensor(job.sample_rows, dtype=torch.int64))
        self.views["sample_offsets"].copy_(torch.from_numpy(lay.offsets))
        self.stats: torch.Tensor | None = None  # [T, L, 3] per-token statistics, when the pieces bring them
        self.filled = 0  # tokens put
        self._have = np.zeros(T, dtype=bool)  # tokens put
        self._first_missing = 0  # every token before it is put
        self._file: ImageFile | None = None  # the temporary file, once ``stream`` has opened it
        self._io = threading.Lock()  # ``stream`` against ``finish``/``abandon``
        self._ended = False  # ``finish`` or ``abandon`` has begun: ``stream`` touches nothing more
        # the file in order: per span, its start, its end and its bytes per token (0: final when made)
        per_token = {"hidden_states", SCALE_TENSOR}
        self._spans = sorted((a, b, (b - a) // T if name in per_token and T else 0)
                             for name, (a, b) in lay.spans.items())

    @property
    def tokens(self) -> int:
        return int(self.layout.offsets[-1])

    def put(self, row: int, at: int, states: torch.Tensor, *, scale: torch.Tensor | None = None,
            stats: torch.Tensor | None = None) -> None:
        """Tokens [at, at + n) of the shard's ``row``-th stored row: ``states`` [n, L, H] in the
        storage dtype (fp8: quantized, with ``scale`` [n, L]); ``stats`` [n, L, 3] their per-token
        statistics (``token_stats``), given for every piece or for none."""
        n = int(states.shape[0])
        t = int(self.layout.offsets[row]) + at
        if at < 0 or t + n > int(self.layout.offsets[row + 1]):
            raise ValueError(f"shard {self.job.index} row {self.job.sample_rows[row]}: tokens [{at}, {at + n}) "
                             f"outside its {int(self.layout.offsets[row + 1] - self.layout.offsets[row])}")
        self.views["hidden_states"][t:t + n].copy_(states)
        if self.fp8:
            self.views[SCALE_TENSOR][t:t + n].copy_(scale)
        if stats is not None:
            if self.stats is None:
                L = len(self.job.layer_ids)
                self.stats = torch.empty((self.tokens, L, 3), dtype=torch.float32)
            self.stats[t:t + n].copy_(stats)
        self.filled += n
        self._have[t:t + n] = True
        if t <= self._first_missing < t + n:
            rest = np.flatnonzero(~self._have[t + n:])
            self._first_missing = t + n + int(rest[0]) if rest.size else self.tokens

    def ready(self) -> int:
        """Bytes of the file, from its start, that are final: the spans set when the image was made,
        and the per-token spans up to the first token not yet put (where such a span ends early,
        the prefix ends there)."""
        pos, k = len(self.layout.head), self._first_missing
        for a, b, per_token in self._spans:
            if per_token and k < self.tokens:
                return a + k * per_token
            pos = b
        return pos

    def stream(self, min_bytes: int = 0) -> bool:
        """Write (and hash) the next piece of the file's final prefix to its temporary file, if at
        least ``min_bytes`` of it (and one aligned piece) is waiting. True if it wrote. Safe to call
        from one thread while another puts; does nothing once ``finish`` or ``abandon`` has begun."""
        with self._io:
            if self._ended:
                return False
            done = self._file.pos if self._file else 0
            end = min(self.ready(), done + WRITE_PIECE) // ALIGN * ALIGN
            if end >= self.layout.size or end <= done or end - done < min(min_bytes, WRITE_PIECE):
                return False  # the last piece (and the padding after it) is ``finish``'s
            if self._file is None:
                self._file = ImageFile(self._tmp_path(), self.buf, direct=settings.direct_io())
            self._file.write(end)
            return True

    def streamed(self) -> int:
        """Bytes already in the temporary file."""
        return self._file.pos if self._file else 0

    def abandon(self) -> None:
        """The shard is dropped: stop streaming, remove its temporary file. The buffer may then go back."""
        with self._io:
            self._ended = True
            if self._file is not None:
                self._file.discard()

    def _tmp_path(self) -> Path:
        final = Path(self.job.path)
        final.parent.mkdir(parents=True, exist_ok=True)
        return final.with_name(f".{final.name}.tmp-{os.getpid()}")

    def finish(self) -> ShardRecord:
        """Write the complete image atomically (temporary name, fsync, rename) and return its record.

        Raises:
            RuntimeError: tokens are missing.
        """
        job, T = self.job, self.tokens
        with self._io:  # a ``stream`` under way ends its piece first; none starts after
            self._ended = True
        if self.filled != T:
            self.abandon()
            raise RuntimeError(f"shard {job.index}: {self.filled} of its {T} tokens' states were put")
        hs = self.views["hidden_states"]
        per_token = self.stats
        if per_token is None and T:
            per_token = fp8_token_stats(hs, self.views[SCALE_TENSOR]) if self.fp8 else token_stats(hs)
        record_stats = layer_stats(hs, job.layer_ids, per_token)
        self.views = {}  # the buffer goes back to its pool: no view of it may outlive the write
        final = Path(job.path)
        size = self.layout.size
        f = self._file
        try:
            if f is None:
                f = ImageFile(self._tmp_path(), self.buf, direct=settings.direct_io())
            f.write(size, final=True)
            digest = f.close()
        except BaseException:
            if f is not None:
                f.discard()  # a full disk must not keep the half-written file
            raise
        os.replace(f.tmp, final)
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


def new_buffer(size: int) -> mmap.mmap:
    """Page-aligned anonymous memory of at least ``size`` bytes (huge pages where the kernel gives them)."""
    buf = mmap.mmap(-1, max(ALIGN, -(-size // ALIGN) * ALIGN))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return buf


def close_buffer(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:  # a tensor still views it: the memory goes with the last view
        pass


class ImagePool:
    """The capture's shard images, reused, within a byte budget.

    ``take`` gives the smallest free buffer that holds the shard, else a new one. While the budget
    is spent it waits for a buffer to come back, but only while ``pending()`` says a write that
    will return one is on its way; when none is (every image belongs to a shard still being
    filled), it allocates over the budget, so the run goes on rather than stalls.
    """

    GRAIN = 64 << 20  # new buffers are rounded up to this, so that shards of about one size share them

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.free: list[mmap.mmap] = []
        self.held = 0  # bytes of every buffer this pool made and has not closed
        self.cond = threading.Condition()
        self.over_budget_bytes = 0  # allocated past the budget (for profiles)

    def take(self, size: int, pending: Callable[[], bool]) -> tuple[mmap.mmap, float]:
        """A buffer of at least ``size`` bytes, and the seconds waited for one."""
        t0 = time.perf_counter()
        with self.cond:
            while True:
                fits = [b for b in self.free if len(b) >= size]
                if fits:
                    buf = min(fits, key=len)
                    self.free.remove(buf)
                    return buf, time.perf_counter() - t0
                want = -(-size // self.GRAIN) * self.GRAIN
                while self.free and self.held + want > self.budget:  # too small for this shard: make room
                    small = self.free.pop(0)
                    self.held -= len(small)
                    close_buffer(small)
                if self.held + want <= self.budget or not pending():
                    if self.held + want > self.budget:
                        self.over_budget_bytes += want
                    self.held += want
                    break
                self.cond.wait(0.05)
        return new_buffer(want), time.perf_counter() - t0

    def give(self, buf: mmap.mmap) -> None:
        """A buffer back (its shard is written, or dropped)."""
        with self.cond:
            self.free.append(buf)
            self.free.sort(key=len)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            for b in self.free:
                self.held -= len(b)
                close_buffer(b)
            self.free.clear()
