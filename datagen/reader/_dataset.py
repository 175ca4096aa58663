"""``DatasetReader``: every sample of a dataset by number, read straight from its shards."""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from pydantic import ValidationError

from datagen.data.contract import FORMAT_VERSION, MANIFEST_NAME, STORED_CODES, Manifest
from datagen.data.shards.format import SAFETENSORS_DTYPES
from datagen.errors import DatasetError
from datagen.reader._shards import (
    FP8_CODES, Expected, OpenShard, open_shard, verify_content,
)
from datagen.reader._store import LocalStore, open_store

log = logging.getLogger(__name__)
IOV_MAX = os.sysconf("SC_IOV_MAX")  # buffers one preadv takes


class Verify(str, enum.Enum):
    """How a shard's content is checked against the manifest's sha256 before it is trained on.

    Size, header, shard key, layers and tensor shapes are checked in every mode, when the
    dataset is opened.
    """

    AUTO = "auto"  # FULL for a local dataset, STORED for S3
    FULL = "full"  # hash the whole shard the first time one of its samples is read (once per process)
    STORED = "stored"  # S3 only: the object's sha256 metadata must equal the manifest's; reads pinned to its ETag
    NONE = "none"  # no content check (the dataset was validated where it lies and cannot change)


@dataclass(frozen=True)
class Sample:
    """One training sample."""

    row: int  # dataset row (line of the source JSONL)
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # int64 [T], 1 on assistant tokens
    hidden_states: torch.Tensor  # [T, L, H] in the reader's dtype (bf16 by default), layers in layer_ids order
    # the row's images (contract.ImageRecord: url, sha256, offset, tokens), () for a text row; their
    # placeholder tokens are in input_ids (loss_mask 0 there), as the decoder saw them
    images: tuple = ()


def _expected(m: Manifest, where: str) -> Expected:
    spec = m.spec
    layer_ids, hidden, name = spec.layer_ids, spec.model.hidden_size, spec.storage_dtype
    if name not in STORED_CODES:
        raise DatasetError(f"hidden states stored as {name!r}, which this reader does not know", path=where,
                           hint=f"known: {', '.join(sorted(STORED_CODES))}; update datagen")
    return Expected(layer_ids=layer_ids, hidden_size=hidden, storage_code=STORED_CODES[name])


class DatasetReader:
    """Samples of a dataset (a directory or ``s3://bucket/prefix``), numbered in dataset-row order.

    Sample ``i`` is the i-th stored sample in dataset-row order (skipped rows left out), the same
    numbering as ``datagen export``'s ``hs_<i>``. The reader pickles small (the manifest and each
    shard's header tensors), so DataLoader workers do not open the dataset again.
    """

    def __init__(self, location: str, *, verify: Verify = Verify.AUTO, dtype: torch.dtype = torch.bfloat16,
                 open_threads: int = 16) -> None:
        self.location = str(location)
        self.store = open_store(location)
        is_local = isinstance(self.store, LocalStore)
        if verify is Verify.AUTO:
            verify = Verify.FULL if is_local else Verify.STORED
        if verify is Verify.STORED and is_local:
            raise DatasetError("Verify.STORED needs an S3 dataset (objects record their sha256)",
                               path=self.location, hint="use Verify.FULL (or AUTO) for a local dataset")
        self.verify = verify
        self.dtype = dtype
        raw = self.store.read_text(MANIFEST_NAME)
        try:
            self.manifest = Manifest.model_validate_json(raw)
        except ValidationError as e:
            raise DatasetError(f"manifest.json does not match the contract: {e.errors()[0]['msg']}",
                               path=self.location, hint="run `datagen validate` for details") from e
        if self.manifest.format_version != FORMAT_VERSION:
            raise DatasetError(f"format version {self.manifest.format_version}; this reader reads {FORMAT_VERSION}",
                               path=self.location, hint="use the datagen release that wrote the dataset")
        self.expected = _expected(self.manifest, self.location)
        records = [r for r in self.manifest.shards if r.samples]
        _place_volumes(self.store, self.manifest, self.location)
        with ThreadPoolExecutor(max(1, min(open_threads, len(records))), thread_name_prefix="reader-open") as ex:
            self.shards: list[OpenShard] = list(ex.map(
                lambda r: open_shard(self.store, r, self.expected,
                                     stored_sha256_required=verify is Verify.STORED), records))
        if verify is Verify.NONE:
            for s in self.shards:
                s.verified = True
        # sample i -> (shard, position in the shard), in dataset-row order
        refs = [(int(row), k, pos) for k, s in enumerate(self.shards) for pos, row in enumerate(s.sample_index.tolist())]
        refs.sort()
        self._shard_of = torch.tensor([k for _, k, _ in refs], dtype=torch.int32)
        self._pos = torch.tensor([p for _, _, p in refs], dtype=torch.int32)
        self.rows = [r for r, _, _ in refs]
        self.lengths = [int(self.shards[k].offsets[p + 1] - self.shards[k].offsets[p]) for _, k, p in refs]
        self._locks: dict[int, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._by_pos: list[list[int]] | None = None
        self._offsets = [s.offsets.tolist() for s in self.shards]  # plain ints: indexing a tensor costs microseconds
        self.images = {m.row: tuple(m.images) for m in self.manifest.media}  # row -> its images (image rows only)
        log.info("opened %s: %d samples in %d shards (verify=%s)", self.location, len(refs), len(self.shards),
                 verify.value)

    # -- shape of the dataset -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.rows)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.expected.layer_ids

    @property
    def hidden_size(self) -> int:
        return self.expected.hidden_size

    @property
    def stored_dtype(self) -> torch.dtype:
        """The hidden states' dtype as the shards store them (``read_into`` hands out these bytes)."""
        return SAFETENSORS_DTYPES[self.expected.storage_code]

    def shard_samples(self) -> list[list[int]]:
        """For each opened shard, its sample numbers (in dataset-row order)."""
        out: list[list[int]] = [[] for _ in self.shards]
        for i, k in enumerate(self._shard_of.tolist()):
            out[k].append(i)
        return out

    # -- reading --------------------------------------------------------------------------------
    def ensure_verified(self, k: int) -> None:
        """Check shard k's content per ``verify`` before any of its samples is handed out."""
        s = self.shards[k]
        if s.verified:
            return
        with self._locks_guard:
            lock = self._locks.setdefault(k, threading.Lock())
        with lock:
            if not s.verified:
                verify_content(self.store, s)

    def verify_samples(self, samples=None, *, threads: int | None = None) -> int:
        """Check, per ``verify``, every shard that holds one of ``samples`` (every shard when None),
        ``threads`` shards at a time (default: up to 8, one per core); returns the bytes hashed here.

        A training run calls it before its DataLoader workers start: they inherit the checked shards
        (the reader pickles each shard's ``verified``), where each worker would otherwise hash every
        shard it touches once more, and the first batches would wait for those hashes.
        """
        wanted = range(len(self.shards)) if samples is None else {int(self._shard_of[i]) for i in samples}
        todo = sorted(k for k in wanted if not self.shards[k].verified)
        if not todo:
            return 0
        threads = threads or min(8, os.cpu_count() or 1)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max(1, min(threads, len(todo))), thread_name_prefix="reader-verify") as ex:
            list(ex.map(self.ensure_verified, todo))  # hashlib and the reads let go of the GIL
        hashed, seconds = sum(self.shards[k].record.bytes for k in todo), time.perf_counter() - t0
        log.info("checked %.2f GB of %d shards against the manifest in %.1f s (%.2f GB/s)", hashed / 1e9, len(todo),
                 seconds, hashed / 1e9 / max(seconds, 1e-9))
        return hashed

    def __getitem__(self, i: int) -> Sample:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        k, p = int(self._shard_of[i]), int(self._pos[i])
        return self.sample_in(k, p, self.read_run(k, p, p + 1), p)

    def tokens_of(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample i's token ids (int32 [T]) and loss mask (uint8 [T]) as stored: views of its shard's
        small tensors, no hidden states read."""
        k, p = int(self._shard_of[i]), int(self._pos[i])
        s, off = self.shards[k], self._offsets[k]
        return s.input_ids[off[p]:off[p + 1]], s.loss_mask[off[p]:off[p + 1]]

    def read_into(self, i: int, first: int, buffers: Sequence[memoryview]) -> None:
        """The stored bytes of sample i's states from its token ``first`` on (``row_bytes`` a token, in
        ``stored_dtype``), scattered over ``buffers`` in order, each filled whole before the next (one
        byte memoryview each, writable), after the shard's content check (``verify``).

        A local shard is read with ``os.preadv`` straight into the buffers (no buffer of the reader's
        own, no copy after the kernel's); an S3 one with one ranged read, then copied into them. What a
        caller does not want is read into a scratch buffer it passes among the others.

        Raises:
            ValueError: the buffers hold more than the sample's tokens from ``first`` on.
            DatasetError: the shard ends before the bytes (truncated since it was opened).
        """
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        k, p = int(self._shard_of[i]), int(self._pos[i])
        self.ensure_verified(k)
        s, off = self.shards[k], self._offsets[k]
        rb = s.row_bytes
        total = sum(v.nbytes for v in buffers)
        start = s.states.start + (off[p] + first) * rb
        if first < 0 or start + total > s.states.start + off[p + 1] * rb:
            raise ValueError(f"{total} bytes from token {first} of sample {i}: it holds "
                             f"{(off[p + 1] - off[p] - first) * rb} from there")
        if isinstance(self.store, LocalStore):
            _preadv_all(self.store, s.record.path, list(buffers), start)
            return
        data, pos = memoryview(self.store.read(s.record.path, start, start + total, etag=s.info.etag)), 0
        for v in buffers:
            v[:] = data[pos:pos + v.nbytes]
            pos += v.nbytes

    def positions(self) -> list[list[int]]:
        """For each opened shard, the sample number stored at each position (storage order)."""
        out = [[0] * len(s.sample_index) for s in self.shards]
        for i, (k, p) in enumerate(zip(self._shard_of.tolist(), self._pos.tolist())):
            out[k][p] = i
        return out

    def run_bytes(self, k: int, first: int, last: int) -> int:
        """Bytes of the states of positions [first, last) of shard k."""
        off = self._offsets[k]
        return (off[last] - off[first]) * self.shards[k].row_bytes

    def read_run(self, k: int, first: int, last: int) -> bytearray:
        """The states of the samples at positions [first, last) of shard k, in one ranged read
        (after the shard's content check, per ``verify``)."""
        self.ensure_verified(k)
        s = self.shards[k]
        a, b = self._offsets[k][first], self._offsets[k][last]
        buf = self.store.read(s.record.path, s.states.start + a * s.row_bytes, s.states.start + b * s.row_bytes,
                              etag=s.info.etag)
        return buf if isinstance(buf, bytearray) else bytearray(buf)

    def sample_in(self, k: int, p: int, run: bytearray, first: int) -> Sample:
        """Sample at position p of shard k, cut from ``run`` (``read_run(k, first, ...)``)."""
        s = self.shards[k]
        off = self._offsets[k]
        base, a, b = off[first], off[p], off[p + 1]
        _, layers, hidden = s.states.shape
        rb = s.row_bytes
        dtype = SAFETENSORS_DTYPES[s.states.dtype]
        if len(run) != (b - a) * rb:
            # a sample's own bytes (a memcpy; torch's copy would start its thread pool for it): a view
            # into the run would keep the whole run alive
            run = bytearray(memoryview(run)[(a - base) * rb:(b - base) * rb])
        hs = torch.frombuffer(run, dtype=dtype).view(b - a, layers, hidden)
        if s.states.dtype in FP8_CODES:
            hs = (hs.to(torch.float32) * s.scale[a:b].unsqueeze(-1)).to(self.dtype)
        elif hs.dtype != self.dtype:
            hs = hs.to(self.dtype)
        i = self.positions_index(k, p)
        return Sample(row=self.rows[i], input_ids=s.input_ids[a:b].to(torch.int64),
                      loss_mask=s.loss_mask[a:b].to(torch.int64), hidden_states=hs,
                      images=self.images.get(self.rows[i], ()))

    def positions_index(self, k: int, p: int) -> int:
        """Sample number of position p of shard k."""
        if self._by_pos is None:
            self._by_pos = self.positions()
        return self._by_pos[k][p]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_locks"], state["_locks_guard"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._locks, self._locks_guard = {}, threading.Lock()


def _preadv_all(store: LocalStore, rel: str, views: list[memoryview], pos: int) -> None:
    """Fill ``views`` in order from byte ``pos`` of ``rel`` with preadv, ``IOV_MAX`` buffers a call,
    resuming after a short read."""
    fd = store._fd(rel)  # noqa: SLF001 (the store's descriptor for this process)
    j = 0
    while j < len(views):
        chunk = views[j:j + IOV_MAX]
        n = os.preadv(fd, chunk, pos)
        if n <= 0:
            raise DatasetError(f"{rel} ended at byte {pos}", path=store.uri,
                               hint="the shard is truncated: run `datagen validate`, re-extract")
        pos += n
        while j < len(views) and n >= views[j].nbytes:  # the buffers filled whole
            n -= views[j].nbytes
            j += 1
        if n:  # one filled in part: the rest of it next
            views[j] = views[j][n:]


def open_dataset(location, *, verify: Verify = Verify.AUTO, dtype: torch.dtype = torch.bfloat16) -> DatasetReader:
    """Open the dataset at ``location`` (a directory or ``s3://bucket/prefix``) for reading.

    Args:
        location: the dataset's root (it holds ``manifest.json``).
        verify: how shard contents are checked against the manifest (``Verify``).
        dtype: dtype of the hidden states handed out (fp8 shards are dequantized to it).

    Raises:
        DatasetError: no manifest, or one this reader cannot read.
        ShardRefused: a shard's size, header, key, layers or tensors disagree with the manifest
            (when opening), or its sha256 (when first read, per ``verify``).
    """
    return DatasetReader(str(location), verify=verify, dtype=dtype)


def _place_volumes(store, manifest: Manifest, location: str) -> None:
    """Shards on further output volumes are read there (the manifest names each shard's volume)."""
    from datagen.data.contract import volume_root

    placed = {}
    for r in manifest.shards:
        if r.volume:
            try:
                placed[r.path] = volume_root(location, manifest.volumes, r.volume)
            except ValueError as e:
                raise DatasetError(f"shard {r.index}: {e}", path=location,
                                   hint="run `datagen validate` for details") from e
    if placed and not isinstance(store, LocalStore):
        raise DatasetError("the dataset's shards lie on several output volumes; only a local dataset can be read "
                           "that way", path=location, hint="read it from the machine that holds the volumes")
    if placed:
        store.place(placed)

