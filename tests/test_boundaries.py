"""Where a plan cuts shards: by bytes of states (content-defined, rows whole) or by rows, and the
shard group it resolves."""

from __future__ import annotations

import hashlib
import random

import pytest

from datagen.data.contract import state_bytes
from datagen.extraction.boundaries import byte_boundaries, byte_shard_group, row_boundaries
from datagen.specs.plan import ShardCut, check_boundaries


def rows_of(n: int, *, seed: int = 0, tokens: tuple[int, int] = (1_000, 8_000)) -> tuple[list[int], list[bytes]]:
    """``n`` rows: token counts drawn in ``tokens`` and distinct identities."""
    rng = random.Random(seed)
    return ([rng.randint(*tokens) for _ in range(n)],
            [hashlib.sha256(f"row {seed} {i}".encode()).digest() for i in range(n)])


def shards_of(b: tuple[int, ...]) -> list[tuple[int, int]]:
    return list(zip(b, b[1:]))


def test_byte_shards_hold_whole_rows_and_close_near_the_target():
    tokens, ids = rows_of(3_000)
    target = 60_000  # bytes; 2 bytes a token: about 7 rows a shard
    b = byte_boundaries(tokens, ids, bytes_per_token=2, target=target)
    check_boundaries(b, len(tokens))
    sizes = [2 * sum(tokens[a:z]) for a, z in shards_of(b)]
    assert all(s <= 2 * target for s in sizes), "a shard of several rows never passes twice the target"
    assert all(s >= target // 2 for s in sizes[:-1]) or max(tokens) * 2 > target, sizes
    mean = sum(sizes) / len(sizes)
    assert 0.8 * target < mean < 1.1 * target, mean


def test_a_row_past_twice_the_target_is_a_shard_alone():
    tokens = [10, 10, 500, 10, 10]
    ids = [bytes([i]) * 32 for i in range(5)]
    b = byte_boundaries(tokens, ids, bytes_per_token=1, target=100)
    assert (2, 3) in shards_of(b)


def test_skipped_rows_weigh_nothing_and_an_all_skipped_dataset_is_one_shard():
    assert byte_boundaries([0, 0, 0], [b"a" * 32, b"b" * 32, b"c" * 32], bytes_per_token=10, target=100) == (0, 3)


def test_the_cut_is_a_function_of_the_rows_alone():
    tokens, ids = rows_of(500, seed=1)
    assert (byte_boundaries(tokens, ids, bytes_per_token=3, target=50_000)
            == byte_boundaries(list(tokens), list(ids), bytes_per_token=3, target=50_000))


def test_an_edited_row_re_cuts_its_shard_and_a_few_after_then_the_boundaries_are_the_old_ones():
    """Nightly re-extraction: the shards whose rows change are the edited row's and a bounded few
    after it; every later boundary is where it was (here: 200 edits, each a row's tokens and identity)."""
    tokens, ids = rows_of(2_000, seed=2)
    target = 40_000
    old = byte_boundaries(tokens, ids, bytes_per_token=1, target=target)
    rng = random.Random(7)
    worst = 0
    for trial in range(200):
        i = rng.randrange(len(tokens))
        t2, i2 = list(tokens), list(ids)
        t2[i] = max(0, tokens[i] + rng.choice([-1, 1]) * rng.randint(1, 4_000))
        i2[i] = hashlib.sha256(f"edit {trial}".encode()).digest()
        new = byte_boundaries(t2, i2, bytes_per_token=1, target=target)
        first = max(x for x in old if x <= i)  # the edited row's shard starts where it started
        assert new[: new.index(first) + 1] == old[: old.index(first) + 1]
        # re-extracted: the edited row's shard and every shard whose rows are not an old shard's
        redo = [s for s in shards_of(new) if s not in set(shards_of(old)) or s[0] <= i < s[1]]
        assert redo[0][0] == first and redo == shards_of(new)[new.index(first): new.index(first) + len(redo)]
        # after them the old boundaries come back, to the end
        resync = redo[-1][1]
        assert resync in old and new[new.index(resync):] == old[old.index(resync):]
        worst = max(worst, len(redo))
    assert worst <= 10, worst


def test_appended_rows_move_only_the_last_shards_end():
    tokens, ids = rows_of(800, seed=3)
    more, more_ids = rows_of(300, seed=4)
    old = byte_boundaries(tokens, ids, bytes_per_token=1, target=30_000)
    new = byte_boundaries(tokens + more, ids + more_ids, bytes_per_token=1, target=30_000)
    assert new[: len(old) - 1] == old[:-1], "every shard but the last is the same"


def test_rows_per_shard_cut_k_times_s():
    assert row_boundaries(10, 4) == (0, 4, 8, 10)
    assert row_boundaries(8, 4) == (0, 4, 8)
    assert row_boundaries(3, 8) == (0, 3)


def test_a_cut_knows_each_shards_tokens():
    assert ShardCut.of_rows((0, 2, 5), [1, 2, 3, 0, 4]).tokens == (3, 7)


@pytest.mark.parametrize("bad", [(0,), (1, 5), (0, 3, 3, 5), (0, 4)])
def test_boundaries_that_do_not_cut_every_row_once_are_refused(bad):
    with pytest.raises(ValueError, match="do not cut rows 0:5"):
        check_boundaries(bad, 5)


def test_state_bytes_count_the_layers_values_and_fp8_scales():
    assert state_bytes("bfloat16", n_layers=4, hidden_size=7168) == 57_344
    assert state_bytes("fp8_e4m3", n_layers=4, hidden_size=7168) == 28_672 + 16


def test_the_shard_group_holds_64_steps_of_the_token_budget():
    # Kimi's width, 1 GiB shards, 8192-token steps: bf16 18,724 tokens a shard -> 29; fp8 37,428 -> 15
    assert byte_shard_group(1 << 30, bytes_per_token=57_344, step_tokens=8192) == 29
    assert byte_shard_group(1 << 30, bytes_per_token=28_688, step_tokens=8192) == 15
    # a shard that alone holds 64 steps needs no group; a tiny shard is capped at the setting's bound
    assert byte_shard_group(1 << 40, bytes_per_token=57_344, step_tokens=8192) == 1
    assert byte_shard_group(1_000, bytes_per_token=1_000, step_tokens=8192) == 4096
