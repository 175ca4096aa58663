"""Leases on shard ranges: one holder at a time, expiry frees a dead holder's range."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from datagen.pipeline_spec import ShardRange
from tasks.leases import LeaseLost, LeaseStore, hold_range


def r(a: int, b: int) -> ShardRange:
    return ShardRange(first=a, stop=b)


def test_a_range_is_held_by_one_run_at_a_time(tmp_path):
    store = LeaseStore(tmp_path / "ds")
    assert store.try_acquire(r(0, 2), "run-a", 60) == {}
    others = store.try_acquire(r(1, 3), "run-b", 60)
    assert set(others) == {1} and others[1].holder == "run-a"
    assert store.try_acquire(r(2, 4), "run-b", 60) == {}, "disjoint ranges do not conflict"


def test_nothing_is_taken_when_one_shard_is_held(tmp_path):
    store = LeaseStore(tmp_path / "ds")
    store.try_acquire(r(1, 2), "run-a", 60)
    assert store.try_acquire(r(0, 3), "run-b", 60)
    assert store.read(0) is None and store.read(2) is None


def test_an_expired_lease_is_free_for_the_next_run(tmp_path):
    store = LeaseStore(tmp_path / "ds")
    store.try_acquire(r(0, 2), "dead-run", 0.2)
    time.sleep(0.3)
    assert store.holders(r(0, 2)) == {}
    assert store.try_acquire(r(0, 2), "run-b", 60) == {}
    assert store.read(0).holder == "run-b"


def test_renewing_a_lease_taken_by_another_run_raises(tmp_path):
    store = LeaseStore(tmp_path / "ds")
    store.try_acquire(r(0, 1), "slow-run", 0.2)
    time.sleep(0.3)
    store.try_acquire(r(0, 1), "run-b", 60)
    with pytest.raises(LeaseLost):
        store.renew(r(0, 1), "slow-run", 60)


def test_release_gives_back_only_the_holders_own_leases(tmp_path):
    store = LeaseStore(tmp_path / "ds")
    store.try_acquire(r(0, 1), "run-a", 60)
    store.release(r(0, 1), "run-b")
    assert store.read(0).holder == "run-a"
    store.release(r(0, 1), "run-a")
    assert store.read(0) is None


def test_hold_range_renews_while_held_and_releases_at_the_end(tmp_path):
    store = LeaseStore(tmp_path / "ds")
    with hold_range(tmp_path / "ds", r(0, 2), holder="run-a", ttl_s=0.6):
        first = store.read(0).expires_at
        time.sleep(0.9)
        assert store.read(0).expires_at > first, "the lease was not renewed"
        assert store.holders(r(0, 2))
    assert store.holders(r(0, 2)) == {}


def _contend(path: str, holder: str, results) -> None:
    store = LeaseStore(path)
    results.put((holder, store.try_acquire(ShardRange(first=0, stop=4), holder, 60) == {}))


def test_of_two_processes_racing_for_a_range_exactly_one_wins(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(str(tmp_path / "ds"), f"run-{i}", results)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    wins = [h for h, won in (results.get(timeout=5) for _ in procs) if won]
    assert len(wins) == 1


def test_receipts_are_read_back_by_key(tmp_path):
    store = LeaseStore(tmp_path / "ds")
    assert store.read_receipt("k") is None
    store.write_receipt("k", {"worker": "run-a"})
    assert store.read_receipt("k") == {"worker": "run-a"}
