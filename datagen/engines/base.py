"""The engine interface: turn shard jobs into written shards."""

from __future__ import annotations

import abc

from datagen.data.contract import ShardRecord
from datagen.data.shards import ShardJob


class Engine(abc.ABC):
    """Computes hidden states for shard jobs and writes the shards.

    ``submit`` may return before the shard is on disk (writes overlap compute);
    ``completed`` hands back the records of shards finished since the last call
    (it is called from a thread of its own while ``submit`` runs: the records are
    handed over under a lock), and ``finish`` waits for every submitted shard. An engine is a context manager:
    leaving it releases the model and any worker processes.
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
