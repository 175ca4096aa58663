"""The capture's reply to the driver, declared once (no torch, no vLLM: the driver imports this).

The capture in each worker answers the driver's ``datagen_announce`` and ``datagen_collect``
(``datagen.engines.vllm_worker``) with a ``CaptureReply``. vLLM carries a worker extension's
return value from the worker to the driver through its own serializers (a pickle between
processes of the executor, msgpack between the engine core and the front end), and msgpack
turns a dataclass into a plain dict on the way. So the reply crosses as its wire form, plain
types only (``to_wire``), and is made back into its type in one place, where the driver reads
it (``from_wire``): no other code knows its keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from datagen.data.contract import ShardRecord


@dataclass(frozen=True)
class CaptureReply:
    """What one worker's capture has done since its last reply."""

    rank: int  # the worker's tensor-parallel rank
    records: tuple[ShardRecord, ...]  # the shards this rank wrote since its last reply (written_by = rank)
    errors: tuple[str, ...]  # one per failed shard write: "shard <k>: <error type>: <message>\n<traceback>"
    pending_requests: int  # captured requests whose shard is not yet complete
    pending_shards: tuple[int, ...]  # announced shards this rank writes that are not yet written
    backpressure_s: float  # seconds the steps waited for the writers (the host ring full), since the start
    host_outside_bytes: int  # bytes copied outside the pinned host ring (it was full), since the start

    def to_wire(self) -> dict:
        return {"rank": self.rank, "records": [r.model_dump() for r in self.records],
                "errors": list(self.errors), "pending_requests": self.pending_requests,
                "pending_shards": list(self.pending_shards), "backpressure_s": self.backpressure_s,
                "host_outside_bytes": self.host_outside_bytes}

    @classmethod
    def from_wire(cls, d: dict) -> "CaptureReply":
        rank = int(d["rank"])
        return cls(rank=rank,
                   records=tuple(ShardRecord.model_validate({**r, "written_by": rank}) for r in d["records"]),
                   errors=tuple(d["errors"]), pending_requests=int(d["pending_requests"]),
                   pending_shards=tuple(int(k) for k in d["pending_shards"]),
                   backpressure_s=float(d["backpressure_s"]), host_outside_bytes=int(d["host_outside_bytes"]))
