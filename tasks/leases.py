"""Leases on shard ranges, kept in the output store, so that two runs never write one shard at once.

A range's extraction (a flow run of `extract-shards`) holds a lease on each of its shards from its
first step to its last, renewed by a background thread every third of its time to live. A lease
that is not renewed expires: a host that died releases its ranges within ``ttl`` seconds, and the
run that re-submits the range (``tasks.fanout``) reads an expired lease as "this range's host is
gone". A second run of the same spec that reaches a leased shard waits for it and then finds the
shard complete.

The store is a directory next to the dataset (``.<dataset name>.leases/``; on storage every
worker mounts at the same path) with one JSON file per shard. Every read-modify-write of the
lease files happens under one ``flock`` of the directory's lock file: the kernel releases it when
its holder dies, so a crash can never leave the store locked, only leases that expire.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from datagen.pipeline_spec import ShardRange

logger = logging.getLogger(__name__)

WAIT_POLL_S = 2.0  # how often a waiting run looks at a leased shard again


@dataclass(frozen=True)
class Lease:
    """One shard's lease record."""

    shard: int  # shard index
    holder: str  # flow-run id (or another unique id) of the holder
    host: str  # hostname of the holder, for people reading the store
    pid: int  # process id of the holder on that host
    expires_at: float  # epoch seconds

    def alive(self, now: float | None = None) -> bool:
        return self.expires_at > (time.time() if now is None else now)


class LeaseLost(RuntimeError):
    """A lease this process held was taken by another run (it had expired)."""


class LeaseStore:
    """The leases of one dataset directory."""

    def __init__(self, dataset_dir: str | Path) -> None:
        out = Path(dataset_dir).absolute()
        self.root = out.parent / f".{out.name}.leases"

    def _path(self, shard: int) -> Path:
        return self.root / f"shard-{shard:06d}.json"

    def _lock(self) -> FileLock:
        self.root.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.root / ".lock"))

    def read(self, shard: int) -> Lease | None:
        try:
            raw = json.loads(self._path(shard).read_text())
            return Lease(**raw)
        except (OSError, ValueError, TypeError):
            return None

    def holders(self, shard_range: ShardRange) -> dict[int, Lease]:
        """The live leases on the range's shards."""
        now = time.time()
        leases = {k: self.read(k) for k in shard_range.shards}
        return {k: lease for k, lease in leases.items() if lease is not None and lease.alive(now)}

    def try_acquire(self, shard_range: ShardRange, holder: str, ttl_s: float) -> dict[int, Lease]:
        """Take every shard of the range, or none. Returns the live leases of others ({} = taken)."""
        with self._lock():
            now = time.time()
            others = {k: lease for k, lease in self.holders(shard_range).items() if lease.holder != holder}
            if others:
                return others
            for k in shard_range.shards:
                self._write(Lease(k, holder, socket.gethostname(), os.getpid(), now + ttl_s))
            return {}

    def renew(self, shard_range: ShardRange, holder: str, ttl_s: float) -> None:
        """Push the range's expiry out by ``ttl_s``.

        Raises:
            LeaseLost: a shard's lease is held by someone else now.
        """
        with self._lock():
            now = time.time()
            for k in shard_range.shards:
                lease = self.read(k)
                if lease is not None and lease.holder != holder and lease.alive(now):
                    raise LeaseLost(f"shard {k} is leased to {lease.holder} on {lease.host} now")
            for k in shard_range.shards:
                self._write(Lease(k, holder, socket.gethostname(), os.getpid(), now + ttl_s))

    def release(self, shard_range: ShardRange, holder: str) -> None:
        """Give the range's leases back (only those this holder still has)."""
        with self._lock():
            for k in shard_range.shards:
                lease = self.read(k)
                if lease is not None and lease.holder == holder:
                    self._path(k).unlink(missing_ok=True)

    def _write(self, lease: Lease) -> None:
        _atomic_write_json(self._path(lease.shard), lease.__dict__)

    # A range run's outcome, left for the run that submitted it (which may be on another host).
    def write_receipt(self, key: str, record: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        _atomic_write_json(self.root / f"receipt-{key}.json", record)

    def read_receipt(self, key: str) -> dict | None:
        try:
            return json.loads((self.root / f"receipt-{key}.json").read_text())
        except (OSError, ValueError):
            return None


def _atomic_write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextmanager
def hold_range(
    dataset_dir: str | Path, shard_range: ShardRange, *, holder: str, ttl_s: float, log=logger
) -> Iterator[LeaseStore]:
    """Hold the range's leases for the duration of the block; wait while another run holds them.

    A renewal thread keeps the leases alive. If a renewal finds a lease taken (this process was
    stalled longer than ``ttl_s`` and another run took over), it terminates this process: two
    writers of one shard must never run on, and the other run redoes the range.
    """
    store = LeaseStore(dataset_dir)
    waited_since = None
    while others := store.try_acquire(shard_range, holder, ttl_s):
        if waited_since is None:
            waited_since = time.monotonic()
            first = next(iter(others.values()))
            log.info("range %s is leased to %s on %s; waiting for it", shard_range, first.holder, first.host)
        time.sleep(WAIT_POLL_S)
    if waited_since is not None:
        log.info("range %s: lease taken after waiting %.0f s", shard_range, time.monotonic() - waited_since)
    stop = threading.Event()
    renewer = threading.Thread(
        target=_renew_until, args=(store, shard_range, holder, ttl_s, stop), name=f"lease-{shard_range}", daemon=True
    )
    renewer.start()
    try:
        yield store
    finally:
        stop.set()
        renewer.join(timeout=5)
        store.release(shard_range, holder)


def _renew_until(store: LeaseStore, shard_range: ShardRange, holder: str, ttl_s: float, stop: threading.Event) -> None:
    while not stop.wait(ttl_s / 3):
        try:
            store.renew(shard_range, holder, ttl_s)
        except LeaseLost as e:
            logger.error("lease on range %s lost (%s): stopping this process", shard_range, e)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        except OSError as e:  # the store is briefly unreachable: the next renewal may succeed
            logger.warning("renewing the lease on range %s failed: %s", shard_range, e)
