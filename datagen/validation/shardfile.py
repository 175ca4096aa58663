"""Reading shard files safely: a bounded header parser, memory-mapped tensors, a one-pass scan.

The header is parsed here, not by the safetensors library, so that a hostile or
corrupt file is refused with a named problem before anything large is read: the
8-byte length prefix is checked against a small limit (a shard's header holds five
tensors) and against the file size before the header itself is read.

``scan`` reads the file once, in order: each block feeds the sha256 and, where it holds
hidden states, the caller's per-token callback, while it is still in the CPU cache.
Reading the bytes twice (hash, then tensors) would halve throughput on datasets larger
than memory. Small tensors and single samples are read through a memory map.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from datagen.data.contract import STORED_CODES
from datagen.data.shards.format import SAFETENSORS_DTYPES
from datagen.errors import ValidationFailed
from datagen.validation.report import Problem, ProblemKind

# A shard's header holds five tensors and three metadata strings (about 500 bytes).
SHARD_HEADER_LIMIT = 1 << 20
# Bytes per read of a scan: large enough for sequential-read throughput, small enough to
# still be in the CPU cache when the hidden-state callback reads it after hashing (with
# 8 MiB blocks, 8+ workers thrashed the shared cache and ran slower than 4).
SCAN_BLOCK = 2 << 20

@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a safetensors file."""

    dtype: str  # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute offset of the first byte in the file
    end: int  # absolute offset one past the last byte

    @property
    def torch_dtype(self) -> torch.dtype:
        return SAFETENSORS_DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return SAFETENSORS_DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class ShardHeader:
    """The parsed, checked header of a safetensors file."""

    file_size: int  # bytes on disk
    tensors: dict[str, TensorEntry]  # name -> entry
    metadata: dict[str, str]  # the __metadata__ strings


def _bad(message: str, kind: ProblemKind = ProblemKind.SHARD_HEADER) -> ValidationFailed:
    return ValidationFailed(message, problems=[Problem(kind, message)],
                            hint="the shard is corrupt: extract it again (datagen extract resumes)")


def read_header(path: Path, *, limit: int = SHARD_HEADER_LIMIT) -> ShardHeader:
    """Parse and check the header of a safetensors file without reading its data.

    Raises:
        ValidationFailed: with one problem (kind shard_header or shard_size) when the file
            is not a complete, well-formed safetensors file.
    """
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _bad(f"{size} bytes: too short to hold a safetensors header", ProblemKind.SHARD_SIZE)
        (n,) = struct.unpack("<Q", prefix)
        if n > limit:
            # refused before reading: a hostile length prefix must not make us allocate it
            raise _bad(f"header claims {n} bytes, more than the {limit}-byte limit for a shard")
        if 8 + n > size:
            raise _bad(f"header claims {n} bytes but the file has {size}", ProblemKind.SHARD_SIZE)
        raw = f.read(n)
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(f"header is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise _bad("header is not a JSON object")
    meta = obj.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _bad("header __metadata__ is not a map of strings")
    base = 8 + n
    tensors: dict[str, TensorEntry] = {}
    for name, e in obj.items():
        tensors[name] = _entry(name, e, base)
    spans = sorted((t.start, t.end, name) for name, t in tensors.items())
    pos = base
    for start, end, name in spans:
        if start != pos:
            raise _bad(f"tensor {name} starts at byte {start}, expected {pos} (hole or overlap)")
        pos = end
    if pos > size:
        raise _bad(f"{size} bytes but the header describes {pos}: the file is truncated", ProblemKind.SHARD_SIZE)
    if pos < size:
        raise _bad(f"{size} bytes but the header describes {pos}: trailing bytes", ProblemKind.SHARD_SIZE)
    return ShardHeader(file_size=size, tensors=tensors, metadata=dict(meta))


def _entry(name: str, e, base: int) -> TensorEntry:
    if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
        raise _bad(f"tensor {name}: header entry must have exactly dtype, shape, data_offsets")
    dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
    if dtype not in SAFETENSORS_DTYPES:
        raise _bad(f"tensor {name}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _bad(f"tensor {name}: shape {shape!r} is not a list of non-negative integers")
    if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
            or not 0 <= offs[0] <= offs[1]):
        raise _bad(f"tensor {name}: data_offsets {offs!r} are not [begin, end] with begin <= end")
    numel = 1
    for d in shape:
        numel *= d
    if offs[1] - offs[0] != numel * SAFETENSORS_DTYPES[dtype].itemsize:
        raise _bad(f"tensor {name}: {offs[1] - offs[0]} bytes for shape {shape} of {dtype}")
    return TensorEntry(dtype=dtype, shape=tuple(shape), start=base + offs[0], end=base + offs[1])


class MappedShard:
    """A shard file mapped into memory (private copy-on-write: tensors may be viewed, never written back)."""

    def __init__(self, path: Path, header: ShardHeader):
        self.path = path
        self.header = header
        with path.open("rb") as f:
            # ACCESS_COPY gives a writable buffer, which torch.frombuffer wants, without
            # ever writing to the file.
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if len(self._mm) != header.file_size:
            self.close()
            raise _bad(f"file changed size while being read ({header.file_size} -> {len(self._mm)})",
                       ProblemKind.SHARD_SIZE)
        if hasattr(mmap, "MADV_SEQUENTIAL"):
            self._mm.madvise(mmap.MADV_SEQUENTIAL)

    def __enter__(self) -> "MappedShard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:
            pass  # a tensor still views the map; it is unmapped when that tensor is freed

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (a view of the map when aligned, else a copy)."""
        t = self.header.tensors[name]
        return self._view(t, t.start, t.end, t.shape)

    def rows(self, name: str, first: int, last: int) -> torch.Tensor:
        """Rows [first, last) of tensor ``name`` along its first axis."""
        t = self.header.tensors[name]
        row = (t.end - t.start) // t.shape[0] if t.shape and t.shape[0] else 0
        return self._view(t, t.start + first * row, t.start + last * row, (last - first, *t.shape[1:]))

    def _view(self, t: TensorEntry, start: int, end: int, shape: tuple[int, ...]) -> torch.Tensor:
        if end == start:
            return torch.empty(shape, dtype=t.torch_dtype)
        if start % t.itemsize:
            buf = bytearray(self._mm[start:end])
            return torch.frombuffer(buf, dtype=t.torch_dtype).view(shape)
        return torch.frombuffer(self._mm, dtype=t.torch_dtype, count=(end - start) // t.itemsize,
                                offset=start).view(shape)

    def scan(self, *, rows_of: str | None = None,
             on_rows: Callable[[int, torch.Tensor], None] | None = None, block: int = SCAN_BLOCK) -> str:
        """Read the whole file once, in order, and return its sha256 hex digest.

        With ``rows_of``, the bytes of that tensor are read in blocks of whole rows along its
        first axis, and ``on_rows(first_row, rows)`` is called with each block as a tensor
        while it is still in the CPU cache (the tensor is only valid during the call).

        The scan reads with ``readinto`` into one reused buffer rather than through the map:
        on many threads, page faults on one process's mappings contend, while reads scale.

        Raises:
            ValidationFailed: (shard_size) the file became shorter or longer while read.
        """
        h = hashlib.sha256()
        size = self.header.file_size
        t = self.header.tensors.get(rows_of) if rows_of else None
        n_rows = t.shape[0] if t is not None and t.shape else 0
        row_bytes = (t.end - t.start) // n_rows if n_rows else 0
        per_block = max(1, block // row_bytes) if row_bytes else 0
        buf = bytearray(max(block, per_block * row_bytes))
        mv = memoryview(buf)
        with self.path.open("rb", buffering=0) as f:
            pos = 0

            def take(n: int) -> memoryview:
                nonlocal pos
                got = 0
                while got < n:
                    k = f.readinto(mv[got:n])
                    if not k:
                        raise _bad(f"the file ended at byte {pos + got} while being read (header says {size})",
                                   ProblemKind.SHARD_SIZE)
                    got += k
                pos += n
                h.update(mv[:n])
                return mv[:n]

            plain_end = t.start if (on_rows is not None and row_bytes) else size
            while pos < plain_end:
                take(min(len(buf), plain_end - pos))
            if on_rows is not None and row_bytes:
                for first in range(0, n_rows, per_block):
                    k = min(per_block, n_rows - first)
                    take(k * row_bytes)
                    rows = torch.frombuffer(buf, dtype=t.torch_dtype, count=k * row_bytes // t.itemsize)
                    on_rows(first, rows.view(k, *t.shape[1:]))
                    del rows
                while pos < size:
                    take(min(len(buf), size - pos))
            if f.read(1):
                raise _bad(f"the file grew past {size} bytes while being read", ProblemKind.SHARD_SIZE)
        mv.release()
        return h.hexdigest()
