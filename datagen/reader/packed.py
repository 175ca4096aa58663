"""The packed batch: ``datagen train``'s batches built where the shards are read, imported without speculators.

``PackedBatches`` packs each batch of a ``SpeculatorsDataset``'s samples (``datagen.reader.for_speculators``)
exactly as speculators' ``CollateFn(max_len, ..., preprocess=shift_batch)`` packs them. Its states are
written once: every token's stored bytes are read by ``os.preadv`` straight into their rows of the batch
(the aux layers into ``hidden_states``, the final layer one row earlier into
``verifier_last_hidden_states``: ``shift_batch``'s shift), and only the padding tail is zeroed.

The states' memory is reused (``_Ring``): fresh memory costs a page fault per 4 KiB on its first
touch, about as much as the read itself. A DataLoader worker packs into shared memory (sending it
then passes a descriptor, no copy) from a ring of buffers; the training process's tensors over a
buffer hand it back to the worker's ring when the last of them is freed (the DataLoader's pinned
copy made, or the batch dropped), never before. A training process that reads its own batches on
a CUDA machine packs into pinned memory from torch's caching host allocator (which knows when an
asynchronous copy to the GPU is done with it), so the DataLoader's pinning copies nothing.

A spawned DataLoader worker imports this module to unpickle its ``PackedBatches``, which carries the
samples as ``Samples`` (the reader, the split's indices, the dtype), not the ``SpeculatorsDataset``:
so the worker imports torch and the reader, not speculators' package (8-10 s a worker, before its
first batch; ``tests/reader/test_for_speculators.py`` holds that a worker never imports it).
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset, get_worker_info

from datagen.reader._dataset import DatasetReader


class SplitOfReader:
    """A split of a reader's samples (``reader``, ``indices``): its width, its aux layers and its length,
    for ``SpeculatorsDataset`` and for ``Samples`` alike."""

    reader: object
    indices: range

    @property
    def hidden_size(self) -> int:
        return self.reader.hidden_size

    @property
    def num_target_layers(self) -> int:
        """Aux layers speculators' collate function concatenates (all but the final one)."""
        return len(self.reader.layer_ids) - 1

    def __len__(self) -> int:
        return len(self.indices)


@dataclass(frozen=True)
class Samples(SplitOfReader):
    """What packing reads of a ``SpeculatorsDataset``: its reader, its split's sample numbers and the
    dtype it trains in (``pack`` takes either)."""

    reader: object  # a DatasetReader, or a view of some of its layers (datagen.training.layers.LayerView)
    indices: range
    hidden_states_dtype: torch.dtype

    @classmethod
    def of(cls, data) -> Samples:
        return cls(data.reader, data.indices, data.hidden_states_dtype)


def worker_init(worker_id: int) -> None:  # noqa: ARG001
    """What speculators' ``_worker_init_fn`` does in each worker (one thread, the rank's GPU), without
    importing speculators there (module docstring)."""
    torch.set_num_threads(1)
    if torch.accelerator.is_available():
        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))


class PackedBatches(Dataset):
    """A ``SpeculatorsDataset``'s packed batches, built where they are read (module docstring).

    The DataLoader hands ``__getitems__`` a batch's sample numbers (speculators' sampler); it returns
    what speculators' ``CollateFn(max_len, ..., preprocess=shift_batch)`` makes of those samples:
    the same keys in the same order, dtypes, shapes and bytes (``tests/reader/test_for_speculators.py``).
    States are read straight into the batch when the stored dtype is the one trained on (bf16 shards,
    the default); otherwise (fp8, another dtype) each sample is converted as ``SpeculatorsDataset``
    converts it and copied into its rows. ``buffers``: the states' buffers a process keeps for reuse
    (``_Ring``; a worker's batches in flight are the DataLoader's prefetch plus the one being pinned);
    0: a fresh buffer every batch (the benchmark's comparison).
    """

    def __init__(self, data, max_len: int, *, buffers: int = 3) -> None:
        self.data = data  # the SpeculatorsDataset (for_speculators.packable), in the process that made the loader
        self.samples = Samples.of(data)  # what a worker gets of it (module docstring)
        self.max_len = max_len
        self.buffers = buffers
        self._ring: _Ring | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        """One sample as speculators' dataset hands it (in the process that made the loader)."""
        if self.data is None:
            raise TypeError("a DataLoader worker packs whole batches (__getitems__); it holds no SpeculatorsDataset")
        return self.data[index]

    def __getitems__(self, indices) -> dict:
        if self._ring is None and self.buffers:  # made in the process that packs (each worker its own)
            self._ring = _Ring(self.buffers)
        return pack(self.samples, [int(i) for i in indices], self.max_len, ring=self._ring)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "data": None, "_ring": None}


def as_packed(batch: dict) -> dict:
    """The DataLoader's collate function: ``PackedBatches.__getitems__`` already packed the batch."""
    return batch


class _Ring:
    """The states' buffers one process packs into, each reused once the batch made in it is freed.

    ``lease[j]`` is 1 while a batch made in buffer j may still be read: set when it is taken, cleared
    by ``_release`` when the last tensor over it is freed (in the training process, for a worker's
    batch: ``lease`` is in shared memory). When every buffer is leased (batches held, e.g. a list of
    them), a fresh one is allocated and not kept.
    """

    def __init__(self, size: int) -> None:
        self.shared = get_worker_info() is not None
        self.buffers: list[torch.Tensor] = []
        self.lease = torch.zeros(max(1, size), dtype=torch.int32)
        if self.shared:
            self.lease.share_memory_()
        self._flags = self.lease.numpy()

    def take(self, nbytes: int) -> tuple[torch.Tensor, int | None]:
        """A uint8 [nbytes] buffer and its slot (None: not kept for reuse)."""
        flags = self._flags
        for j, b in enumerate(self.buffers):
            if not flags[j] and b.numel() == nbytes:
                flags[j] = 1
                return b, j
        b = _allocate(nbytes, shared=self.shared, pinned=False)
        if len(self.buffers) == len(flags):
            return b, None
        self.buffers.append(b)
        flags[len(self.buffers) - 1] = 1
        return b, len(self.buffers) - 1


def _allocate(nbytes: int, *, shared: bool, pinned: bool) -> torch.Tensor:
    if shared:  # default_collate's way for a worker's batch
        return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))  # noqa: SLF001
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def _release(flags, slot: int) -> None:
    flags[slot] = 0


def _over(buffer: torch.Tensor, layout: list, lease: torch.Tensor | None, slot: int | None) -> list[torch.Tensor]:
    """Tensors ``layout`` ([(offset, dtype, shape)]) over ``buffer``'s bytes; when the last of them is
    freed, ``lease[slot]`` is cleared. They share ``buffer``'s memory through one numpy array, which
    each tensor's storage holds: its finalizer runs when the last storage lets go of it."""
    array = buffer.numpy()
    if slot is not None:
        weakref.finalize(array, _release, lease.numpy(), slot)
    return [torch.frombuffer(array, dtype=dtype, count=math.prod(shape), offset=offset).view(shape)
            for offset, dtype, shape in layout]


def _views(buffer: torch.Tensor, layout: list) -> list[torch.Tensor]:
    """Tensors ``layout`` ([(offset, dtype, shape)]) as plain views of ``buffer``."""
    return [buffer[o:].view(dt)[:math.prod(sh)].view(sh) for o, dt, sh in layout]


class _FromWorker(dict):
    """A batch packed in a worker's ring buffer, as it is sent: the training process rebuilds it as a
    plain dict whose states are tensors over the shared buffer (``_received``), leased until freed."""

    def __init__(self, items: dict, buffer: torch.Tensor, layout: list, lease: torch.Tensor, slot: int | None):
        super().__init__(items)
        self.sent = (buffer, layout, lease, slot)

    def __reduce__(self):
        return _received, (list(self.items()), *self.sent)


def _received(items: list, buffer: torch.Tensor, layout: list, lease: torch.Tensor, slot: int | None) -> dict:
    states = iter(_over(buffer, layout, lease, slot))
    return {k: next(states) if v is None else v for k, v in items}


def _bytes(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's memory as one writable byte memoryview (no copy)."""
    return memoryview(t.view(torch.uint8).view(-1).numpy())


def pack(data: Samples, indices: list[int], max_len: int, *, ring: _Ring | None = None) -> dict:
    """Samples ``indices`` of ``data`` (a ``SpeculatorsDataset`` or its ``Samples``) as one packed batch, exactly as speculators'
    ``CollateFn(max_len, data.hidden_size, num_target_layers=data.num_target_layers,
    dtype=data.hidden_states_dtype, preprocess=shift_batch)`` packs ``[data[i] for i in indices]``.
    The states go into a buffer of ``ring`` (None: a fresh one), or pinned memory (module docstring)."""
    if not indices:  # a rank's empty share: speculators' own placeholder batch
        from speculators.models.eagle3.data import shift_batch
        from speculators.train.data import CollateFn

        return CollateFn(max_len, data.hidden_size, num_target_layers=data.num_target_layers,
                         dtype=data.hidden_states_dtype, preprocess=shift_batch)([])
    reader, dtype, hidden, aux = data.reader, data.hidden_states_dtype, data.hidden_size, data.num_target_layers
    samples = [data.indices[i] for i in indices]
    shifted = [max(reader.lengths[s] - 1, 0) for s in samples]  # shift_batch drops each sample's first token
    # the rows each sample fills: CollateFn copies samples until the batch is full, the last one cut
    placed, used = [], 0
    for s, n in zip(samples, shifted):
        n = min(n, max_len - used)
        placed.append((s, used, n))
        used += n
        if used == max_len:
            break
    # the states' memory: hidden_states [1, max_len, aux * H] then verifier_last_hidden_states [1, max_len, H]
    a_b, f_b = aux * hidden * dtype.itemsize, hidden * dtype.itemsize  # a row's aux / final bytes
    layout = [(0, dtype, (1, max_len, aux * hidden)), (max_len * a_b, dtype, (1, max_len, hidden))]
    nbytes = max_len * (a_b + f_b)
    in_worker = get_worker_info() is not None
    pinned = not in_worker and torch.cuda.is_available()
    if pinned or ring is None:
        buffer, slot = _allocate(nbytes, shared=in_worker, pinned=pinned), None
    else:
        buffer, slot = ring.take(nbytes)
    hidden_states, last = _views(buffer, layout)
    hidden_states[0, used:].zero_()
    last[0, used:].zero_()
    input_ids = torch.zeros(1, max_len, dtype=torch.int64)
    loss_mask = torch.zeros(1, max_len, dtype=torch.int64)
    position_ids = torch.zeros(1, max_len, dtype=torch.int64)
    # the stored bytes are a token's every layer in the shard's order: read straight into the batch only from
    # the reader itself, never from a view of some of its layers (datagen.training.layers.LayerView), whose
    # samples hand out the layers it takes
    direct = isinstance(reader, DatasetReader) and reader.stored_dtype == reader.dtype == dtype
    if direct:
        hs_bytes, last_bytes = _bytes(hidden_states), _bytes(last)
        scratch_a, scratch_f = memoryview(bytearray(a_b)), memoryview(bytearray(f_b))
    for s, at, n in placed:
        if not n:
            continue
        ids, mask = reader.tokens_of(s)
        input_ids[0, at:at + n] = ids[1:n + 1]
        loss_mask[0, at:at + n] = mask[1:n + 1]
        position_ids[0, at:at + n] = torch.arange(1, n + 1)
        if direct:
            # stored token t is [aux layers | final layer]; shifted, its aux goes to row at+t (t < n) and
            # its final layer to row at+t-1 (t >= 1): n+1 tokens read, 2(n+1) buffers
            views = [hs_bytes[at * a_b:(at + 1) * a_b], scratch_f]
            for r in range(at + 1, at + n):
                views.append(hs_bytes[r * a_b:(r + 1) * a_b])
                views.append(last_bytes[(r - 1) * f_b:r * f_b])
            views += [scratch_a, last_bytes[(at + n - 1) * f_b:(at + n) * f_b]]
            reader.read_into(s, 0, views)
        else:
            hs = reader[s].hidden_states.to(dtype)  # as SpeculatorsDataset converts it
            hidden_states[0, at:at + n] = hs[:n, :-1].flatten(1)
            last[0, at:at + n] = hs[1:n + 1, -1]
    del hidden_states, last
    if direct:
        del hs_bytes, last_bytes
    # CollateFn's lengths are the rows placed: whole samples while they fit, the last one cut, the rest dropped
    lengths = torch.tensor([n for _, _, n in placed], dtype=torch.long)
    document_ids = torch.repeat_interleave(torch.arange(lengths.shape[0], dtype=torch.long), lengths)
    document_ids = torch.cat([document_ids, -1 * torch.ones(max_len - document_ids.shape[0], dtype=torch.long)])
    items = {"input_ids": input_ids, "hidden_states": None, "verifier_last_hidden_states": None,
             "loss_mask": loss_mask, "position_ids": position_ids, "document_ids": document_ids.unsqueeze(0),
             "error_records": 0}
    if in_worker and slot is not None:
        return _FromWorker(items, buffer, layout, ring.lease, slot)  # rebuilt by _received where it arrives
    if slot is not None:
        hs, vl = _over(buffer, layout, ring.lease, slot)
    else:  # a buffer of its own: plain views (in a worker, its shared memory travels as any tensor's)
        hs, vl = _views(buffer, layout)
    return {**items, "hidden_states": hs, "verifier_last_hidden_states": vl}
