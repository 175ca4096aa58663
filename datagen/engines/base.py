"""The engine interface: turn shard jobs into written shards."""

from __future__ import annotations

import abc
import threading

from datagen.data.contract import ShardRecord
from datagen.data.shards.format import ShardJob


class Engine(abc.ABC):
    """Computes hidden states for shard jobs and writes the shards.

    ``submit`` may return before the shard is on disk (writes overlap compute);
    ``completed`` hands back the records of shards finished since the last call
    (the run calls it from a thread of its own while ``submit`` runs: engines keep
    their records in a ``Handout``), and ``finish`` waits for every submitted shard.
    An engine is a context manager: leaving it releases the model and any worker
    processes.
    """

    name: str

    @abc.abstractmethod
    def start(self) -> None:
        """Load the model. Called once, after every input has been checked."""

    @abc.abstractmethod
    def submit(self, job: ShardJob) -> None:
        """Compute and write one shard (possibly asynchronously)."""

    @abc.abstractmethod
    def completed(self) -> list[ShardRecord]:
        """Records of shards written since the last call."""

    @abc.abstractmethod
    def finish(self) -> list[ShardRecord]:
        """Wait for every submitted shard; return the records not yet handed back."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the model and workers."""

    @abc.abstractmethod
    def describe(self) -> dict:
        """Name, version and patches: recorded in the manifest and part of the fingerprint."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Handout:
    """Records written and not yet handed back: added by the thread that runs the engine, taken
    (``completed``) by the run's record keeper in another thread."""

    def __init__(self):
        self._records: list[ShardRecord] = []
        self._lock = threading.Lock()

    def add(self, records: list[ShardRecord]) -> None:
        with self._lock:
            self._records.extend(records)

    def take(self) -> list[ShardRecord]:
        with self._lock:
            done, self._records = self._records, []
        return done
