"""The reader as torch datasets.

* ``SampleDataset``: map-style. Any sampler works; with ``torch.utils.data.DistributedSampler``
  (``shuffle=True, seed=...``) every rank gets its share of a seeded permutation of all samples.
  Each read is one ranged read of that sample's states.
* ``ShardStreamDataset``: iterable, for streaming from S3 or from datasets larger than a node's
  page cache. Each epoch, a seeded permutation of the shards is dealt to the ranks
  (``torch.distributed``) and, within a rank, to the DataLoader workers; a worker walks its
  shards ``shards_in_flight`` at a time and yields their samples in a seeded random order, with
  ``prefetch`` reads in flight. Every rank yields the same number of samples per epoch (the
  smallest share; the few samples past it are left out of that epoch, a different few each epoch),
  so collective training steps stay in step.

Both yield dicts: ``row`` (int), ``input_ids`` int64 [T], ``loss_mask`` int64 [T],
``hidden_states`` [T, L, H].
"""

from __future__ import annotations

import random
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

from torch.utils.data import Dataset, IterableDataset, get_worker_info

from datagen.errors import SpecError
from datagen.reader._dataset import DatasetReader, Sample


def _as_dict(sample: Sample) -> dict:
    # not dataclasses.asdict: it deep-copies every tensor
    return {"row": sample.row, "input_ids": sample.input_ids, "loss_mask": sample.loss_mask,
            "hidden_states": sample.hidden_states}


class SampleDataset(Dataset):
    """Map-style: ``dataset[i]`` is sample i of the reader (dataset-row order)."""

    def __init__(self, reader: DatasetReader) -> None:
        self.reader = reader

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int) -> dict:
        return _as_dict(self.reader[i])


def _rank_world(rank: int | None, world: int | None) -> tuple[int, int]:
    if rank is not None and world is not None:
        return rank, world
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ShardStreamDataset(IterableDataset):
    """Iterable: seeded shuffle across shards, split over ranks and workers (module docstring).

    On S3 a worker reads its shards in runs of consecutive samples of up to ``run_bytes`` (one
    ranged GET each, so S3 streams near its sequential rate instead of paying a request per
    sample); on a filesystem each sample is one ``pread`` (no second copy). The runs of the
    worker's window of shards are put in a seeded random order and taken ``mix_bytes`` at a time;
    the samples of each take are yielded in a seeded random order while the next take is read.

    Args:
        reader: the opened dataset.
        seed: the same on every rank.
        shards_in_flight: shards whose samples are mixed by one worker.
        run_bytes: largest ranged read; default 16 MiB on S3, one sample per read on a filesystem.
        mix_bytes: bytes of samples shuffled together (memory: about twice this per worker).
        prefetch: reads in flight per worker (threads).
        rank, world_size: default to ``torch.distributed``'s (make the dataset after
            ``init_process_group``), or 0 and 1.
    """

    def __init__(self, reader: DatasetReader, *, seed: int = 0, shards_in_flight: int = 4,
                 run_bytes: int | None = None, mix_bytes: int = 64 << 20, prefetch: int = 4,
                 rank: int | None = None, world_size: int | None = None) -> None:
        from datagen.reader._store import LocalStore

        self.reader = reader
        self.seed = seed
        self.shards_in_flight = max(1, shards_in_flight)
        if run_bytes is None:
            run_bytes = 1 if isinstance(reader.store, LocalStore) else 16 << 20
        self.run_bytes = max(1, run_bytes)
        self.mix_bytes = max(1, mix_bytes)
        self.prefetch = max(1, prefetch)
        # resolved here, in the training process: DataLoader workers do not see its process group
        self.rank, self.world_size = _rank_world(rank, world_size)
        self.epoch: int | None = None
        self._next_epoch = 0  # when set_epoch is not called, each pass is the next epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _runs(self, k: int, kept: set[int]) -> list[tuple[int, int, int]]:
        """Shard k's positions cut into runs (k, first, last) of at most run_bytes, kept samples only."""
        n = len(self.reader.shards[k].sample_index)
        out, first = [], None
        for p in range(n + 1):
            if first is not None and (p == n or p not in kept or
                                      self.reader.run_bytes(k, first, p + 1) > self.run_bytes):
                out.append((k, first, p))
                first = None
            if p < n and p in kept and first is None:
                first = p
        return out

    def groups(self, epoch: int, rank: int, world: int, worker: int, workers: int) -> list:
        """What worker ``worker`` of rank ``rank`` reads in ``epoch``: groups of runs, each with the order
        its samples are yielded in ((shard, position) pairs)."""
        positions = self.reader.positions()
        order = list(range(len(positions)))
        random.Random(f"{self.seed}/{epoch}/shards").shuffle(order)
        if world > len(positions):
            raise SpecError(f"{len(positions)} shards cannot be dealt to {world} ranks: each rank streams whole shards",
                            hint="use SampleDataset with a DistributedSampler, or write smaller shards")
        shares = [order[r::world] for r in range(world)]
        even = min(sum(len(positions[k]) for k in share) for share in shares)
        # the rank's shards in its order, each cut so that the rank yields exactly `even` samples
        keep, left = {}, even
        for k in shares[rank]:
            keep[k] = min(len(positions[k]), left)
            left -= keep[k]
        mine = [k for k in shares[rank][worker::workers] if keep[k]]
        out = []
        for w in range(0, len(mine), self.shards_in_flight):
            runs = []
            for k in mine[w:w + self.shards_in_flight]:
                picked = list(range(len(positions[k])))
                random.Random(f"{self.seed}/{epoch}/shard/{k}").shuffle(picked)
                runs.extend(self._runs(k, set(picked[:keep[k]])))
            rng = random.Random(f"{self.seed}/{epoch}/{rank}/{worker}/{w}")
            rng.shuffle(runs)
            group: list = []
            size = 0
            for run in runs:
                group.append(run)
                size += self.reader.run_bytes(*run)
                if size >= self.mix_bytes or run is runs[-1]:
                    samples = [(k, p) for k, a, b in group for p in range(a, b)]
                    rng.shuffle(samples)
                    # runs are read in the order their first sample is yielded: the first sample
                    # waits for its own read, not for the whole group
                    run_of = {(k, p): (k, a, b) for k, a, b in group for p in range(a, b)}
                    first_use: dict = {}
                    for sample in samples:
                        first_use.setdefault(run_of[sample], len(first_use))
                    out.append((sorted(group, key=first_use.__getitem__), samples))
                    group, size = [], 0
        return out

    def plan(self, epoch: int, rank: int, world: int, worker: int, workers: int) -> list[int]:
        """Sample numbers worker ``worker`` of rank ``rank`` yields in ``epoch``, in order."""
        positions = self.reader.positions()
        return [positions[k][p] for _, samples in self.groups(epoch, rank, world, worker, workers)
                for k, p in samples]

    def __len__(self) -> int:
        """Samples this rank yields per epoch (all its workers together)."""
        return sum(len(samples) for _, samples in self.groups(0, self.rank, self.world_size, 0, 1))

    def __iter__(self) -> Iterator[dict]:
        rank, world = self.rank, self.world_size
        info = get_worker_info()
        group_world = _rank_world(None, None)[1]
        if info is None and group_world != 1 and group_world != world:
            raise SpecError(f"the dataset was made for {world} ranks, torch.distributed has {group_world}",
                            hint="make ShardStreamDataset after init_process_group (or pass rank and world_size)")
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch = self.epoch if self.epoch is not None else self._next_epoch
        self._next_epoch = epoch + 1
        groups = self.groups(epoch, rank, world, worker, workers)
        r = self.reader
        with ThreadPoolExecutor(self.prefetch, thread_name_prefix="reader") as ex:
            def fetch(group):
                return {(k, a): ex.submit(r.read_run, k, a, b) for k, a, b in group}

            pending: deque = deque()
            for g in range(len(groups)):
                while len(pending) < 2 and g + len(pending) < len(groups):
                    pending.append(fetch(groups[g + len(pending)][0]))
                reads = pending.popleft()
                group, samples = groups[g]
                starts = {k: [] for k, _, _ in group}
                for k, a, _ in group:
                    starts[k].append(a)
                for k, p in samples:
                    a = p if (k, p) in reads else max(x for x in starts[k] if x <= p)
                    yield _as_dict(r.sample_in(k, p, reads[(k, a)].result(), a))
