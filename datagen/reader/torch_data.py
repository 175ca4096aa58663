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
from dataclasses import asdict
from typing import Iterator

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from datagen.reader._dataset import DatasetReader


def _as_dict(reader: DatasetReader, i: int) -> dict:
    return asdict(reader[i])


class SampleDataset(Dataset):
    """Map-style: ``dataset[i]`` is sample i of the reader (dataset-row order)."""

    def __init__(self, reader: DatasetReader) -> None:
        self.reader = reader

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int) -> dict:
        return _as_dict(self.reader, i)


def _rank_world(rank: int | None, world: int | None) -> tuple[int, int]:
    if rank is not None and world is not None:
        return rank, world
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ShardStreamDataset(IterableDataset):
    """Iterable: seeded shuffle across shards, split over ranks and workers (module docstring).

    Args:
        reader: the opened dataset.
        seed: the same on every rank.
        shards_in_flight: shards whose samples are shuffled together by one worker.
        prefetch: sample reads in flight per worker (threads; hides S3 latency).
        rank, world_size: default to ``torch.distributed``'s, or 0 and 1.
    """

    def __init__(self, reader: DatasetReader, *, seed: int = 0, shards_in_flight: int = 4, prefetch: int = 8,
                 rank: int | None = None, world_size: int | None = None) -> None:
        self.reader = reader
        self.seed = seed
        self.shards_in_flight = max(1, shards_in_flight)
        self.prefetch = max(1, prefetch)
        self.rank, self.world_size = rank, world_size
        self.epoch: int | None = None
        self._next_epoch = 0  # when set_epoch is not called, each pass is the next epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def plan(self, epoch: int, rank: int, world: int, worker: int, workers: int) -> list[int]:
        """Sample numbers worker ``worker`` of rank ``rank`` yields in ``epoch``, in order."""
        per_shard = self.reader.shard_samples()
        order = list(range(len(per_shard)))
        random.Random(f"{self.seed}/{epoch}/shards").shuffle(order)
        shares = [order[r::world] for r in range(world)]
        even = min(sum(len(per_shard[k]) for k in share) for share in shares)
        # the rank's shards in its order, each cut so that the rank yields exactly `even` samples
        keep, left = {}, even
        for k in shares[rank]:
            keep[k] = min(len(per_shard[k]), left)
            left -= keep[k]
        mine = [k for k in shares[rank][worker::workers] if keep[k]]
        out: list[int] = []
        for w in range(0, len(mine), self.shards_in_flight):
            window = []
            for k in mine[w:w + self.shards_in_flight]:
                samples = list(per_shard[k])
                random.Random(f"{self.seed}/{epoch}/shard/{k}").shuffle(samples)
                window.extend(samples[:keep[k]])
            random.Random(f"{self.seed}/{epoch}/{rank}/{worker}/{w}").shuffle(window)
            out.extend(window)
        return out

    def __len__(self) -> int:
        """Samples this rank yields per epoch (all its workers together)."""
        rank, world = _rank_world(self.rank, self.world_size)
        return len(self.plan(0, rank, world, 0, 1))

    def __iter__(self) -> Iterator[dict]:
        rank, world = _rank_world(self.rank, self.world_size)
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch = self.epoch if self.epoch is not None else self._next_epoch
        self._next_epoch = epoch + 1
        todo = self.plan(epoch, rank, world, worker, workers)
        with ThreadPoolExecutor(self.prefetch, thread_name_prefix="reader") as ex:
            pending: deque = deque()
            it = iter(todo)
            for i in it:
                pending.append(ex.submit(_as_dict, self.reader, i))
                if len(pending) >= self.prefetch:
                    break
            for i in it:
                yield pending.popleft().result()
                pending.append(ex.submit(_as_dict, self.reader, i))
            while pending:
                yield pending.popleft().result()
