"""The reader as torch datasets: seeded shuffle across shards, split over ranks and DataLoader workers."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from datagen.reader import SampleDataset, ShardStreamDataset, open_dataset
from tests.support.synthetic_shards import make_synthetic_dataset, row_value

ROWS, PER_SHARD = 70, 8  # 9 shards, the last one short: ranks get unequal shares of samples


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    root = make_synthetic_dataset(tmp_path_factory.mktemp("stream") / "ds", rows=ROWS, samples_per_shard=PER_SHARD,
                                  skipped=(3, 17), tokens=(2, 6), hidden=8)
    return open_dataset(root)


def rows_of(loader) -> list[int]:
    return [int(x["row"]) for x in loader]


def stream(reader, *, rank=0, world=1, workers=0, seed=0, **kw) -> list[int]:
    ds = ShardStreamDataset(reader, seed=seed, rank=rank, world_size=world, **kw)
    return rows_of(DataLoader(ds, batch_size=None, num_workers=workers))


def test_one_process_yields_every_sample_once_with_its_own_states(reader):
    seen = []
    for x in ShardStreamDataset(reader, seed=3):
        seen.append(x["row"])
        assert abs(float(x["hidden_states"][:, 0].float().mean()) - row_value(x["row"])) < 0.05
    assert sorted(seen) == reader.rows


def test_ranks_and_workers_share_an_epoch_without_overlap_and_in_equal_parts(reader):
    world = 3
    per_rank = [stream(reader, rank=r, world=world, workers=2, seed=5) for r in range(world)]

    counts = Counter(row for rows in per_rank for row in rows)
    assert max(counts.values()) == 1  # no sample twice in an epoch
    assert len({len(rows) for rows in per_rank}) == 1  # every rank the same number of steps
    assert len(counts) >= len(reader) - world * PER_SHARD  # at most a shard's worth left out per rank
    assert len(per_rank[0]) == len(ShardStreamDataset(reader, seed=5, rank=0, world_size=world))


def test_the_order_is_seeded_mixes_shards_and_changes_with_the_epoch(reader):
    first = stream(reader, seed=1)
    assert first == stream(reader, seed=1)
    assert first != stream(reader, seed=2)
    assert sorted(first) == reader.rows

    ds = ShardStreamDataset(reader, seed=1)
    epoch0, epoch1 = [x["row"] for x in ds], [x["row"] for x in ds]  # no set_epoch: each pass is the next
    assert epoch0 == first and epoch1 != epoch0 and sorted(epoch1) == sorted(epoch0)
    ds.set_epoch(0)
    assert [x["row"] for x in ds] == first

    # samples of several shards are interleaved, not read shard after shard
    shard_changes = sum(a // PER_SHARD != b // PER_SHARD for a, b in zip(first, first[1:]))
    assert shard_changes > ROWS // PER_SHARD * 2


def test_the_map_style_dataset_works_with_the_distributed_sampler(reader):
    data = SampleDataset(reader)
    parts = []
    for rank in range(2):
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=7)
        loader = DataLoader(data, sampler=sampler, batch_size=None, num_workers=2)
        parts.append(rows_of(loader))
    assert len(parts[0]) == len(parts[1]) == -(-len(reader) // 2)
    assert set(parts[0]) | set(parts[1]) == set(reader.rows)
    x = data[5]
    assert x["row"] == reader.rows[5] and x["hidden_states"].shape[1:] == (4, 8)
    assert x["input_ids"].dtype == torch.int64


def test_more_ranks_than_shards_is_refused_with_what_to_do_instead(reader):
    from datagen.errors import SpecError

    with pytest.raises(SpecError, match="9 shards cannot be dealt to 10 ranks") as e:
        list(ShardStreamDataset(reader, rank=0, world_size=10))
    assert "DistributedSampler" in str(e.value)


def _rank_main(rank: int, world: int, init: str, root: str, out: str) -> None:
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        ds = ShardStreamDataset(open_dataset(root), seed=11)  # rank and world from torch.distributed
        rows = [int(x["row"]) for x in DataLoader(ds, batch_size=None, num_workers=2)]
        with open(f"{out}.{rank}", "w") as f:
            json.dump(rows, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_come_from_torch_distributed(reader, tmp_path):
    import json

    import torch.multiprocessing as mp

    world = 2
    root = reader.location
    mp.spawn(_rank_main, args=(world, f"file://{tmp_path / 'rendezvous'}", root, str(tmp_path / "rows")),
             nprocs=world, join=True)
    parts = [json.loads((tmp_path / f"rows.{r}").read_text()) for r in range(world)]

    assert len(parts[0]) == len(parts[1]) > 0 and not set(parts[0]) & set(parts[1])
    assert parts[0] == stream(reader, rank=0, world=world, workers=2, seed=11)
