"""Fan-out: one shard range as a flow run of the `extract-shards` deployment on a work pool.

``dispatch_range`` is the parent's task for one range. It has the same cache key as the local
``extract_range`` (and as the child's own ``extract_range``), so a range extracted by any of them
is Cached for all, and a second run submits nothing. It submits the range with
``run_deployment`` (a subflow of the parent: the UI shows the tree), then watches the child:

* Completed: the range is done; its outcome is read from the receipt the child left next to its
  leases (the child may run on another host; the output store is what both share).
* Crashed: its process or host died. The range is submitted again (``fan_out.max_resubmits``).
* Running, but its lease expired: the host is gone without a word (a killed worker cannot
  report). The child is marked Crashed and the range submitted again; the new run takes the
  expired lease and resumes (complete shards are kept).
* Failed or Cancelled: permanent (the child already retried its transient faults): the task
  fails with the child's message.

Scheduling is Prefect's: the pool's workers take ranges as they have room (``--limit``), the
deployment's and the pool's concurrency limits apply, and per-host GPU limits are global
concurrency limits the child takes (``flows/extract_shards.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from uuid import UUID

from prefect import get_client, get_run_logger, task
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.states import Crashed

from datagen.pipeline_spec import PipelineSpec, ShardRange
from tasks import artifacts
from tasks.extract import RangeResult
from tasks.leases import LeaseStore

WAITING_LOG_INTERVAL_S = 300.0  # how often "still waiting for a worker" is logged


class RangeRunFailed(RuntimeError):
    """The flow run of a range failed for a reason a re-run would not fix."""


def _key_from_parameter(context, parameters) -> str:
    return parameters["cache_key"]


@task(
    name="dispatch-range",
    task_run_name="dispatch-range-{shard_range}",
    cache_key_fn=_key_from_parameter,
    persist_result=True,
    result_serializer="json",
)
def dispatch_range(
    spec: PipelineSpec,
    shard_range: ShardRange,
    *,
    cache_key: str,
    fingerprint: str,
    model_revision: str | None = None,
    progress: UUID | None = None,
) -> RangeResult:
    """Run the range on the pool; re-submit it when its run's host is lost. See the module docstring."""
    logger = get_run_logger()
    store = LeaseStore(spec.output)
    fan = spec.fan_out
    for attempt in range(fan.max_resubmits + 1):
        child = run_deployment(
            fan.deployment,
            parameters={"spec": spec.model_dump(mode="json"), "shard_range": shard_range.model_dump(),
                        "cache_key": cache_key, "fingerprint": fingerprint, "model_revision": model_revision},
            timeout=0,
            flow_run_name=f"range-{shard_range.first}-{shard_range.stop}" + (f"-retry{attempt}" if attempt else ""),
        )
        logger.info("range %s: submitted as flow run %s (%s)", shard_range, child.name, child.id)
        outcome = _watch(child.id, shard_range, cache_key, store, spec, logger)
        if outcome == "completed":
            receipt = store.read_receipt(cache_key) or {}
            result = RangeResult.model_validate({"range": shard_range.arg, "shards_extracted": [],
                                                 "shards_cached": [], "tokens": 0, "seconds": 0.0, **receipt})
            board = artifacts.board(progress)
            if board is not None:
                board.set(shard_range.arg, 1.0, force=True)
            return result
        logger.warning("range %s: flow run %s was lost (%s); submitting the range again", shard_range, child.name, outcome)
    raise RangeRunFailed(
        f"range {shard_range}: its flow run was lost {fan.max_resubmits + 1} times; giving up "
        "(check the workers of the pool, then re-run: completed ranges are cached)"
    )


def _watch(run_id: UUID, shard_range: ShardRange, cache_key: str, store: LeaseStore, spec: PipelineSpec,
           logger) -> str:
    """Wait for the child's end. Returns "completed" or why it was lost; raises if it failed."""
    fan = spec.fan_out
    running_since: float | None = None
    last_waiting_log = time.monotonic()
    with get_client(sync_client=True) as client:
        while True:
            run: FlowRun = client.read_flow_run(run_id)
            state = run.state
            if state is None or state.is_scheduled() or state.is_pending():
                running_since = None
                if time.monotonic() - last_waiting_log > WAITING_LOG_INTERVAL_S:
                    logger.info("range %s: still waiting for a worker of the pool (%s)", shard_range,
                                state.name if state else "no state")
                    last_waiting_log = time.monotonic()
            elif state.is_completed():
                return "completed"
            elif state.is_crashed():
                return f"crashed: {state.message}"
            elif state.is_failed() or state.is_cancelled() or state.is_cancelling():
                raise RangeRunFailed(
                    f"range {shard_range}: flow run {run.name} ended {state.name}: {state.message}"
                )
            elif state.is_running():
                running_since = running_since or time.monotonic()
                if time.monotonic() - running_since > fan.lease_ttl_s and _lost(run_id, shard_range, cache_key, store):
                    client.set_flow_run_state(
                        run_id,
                        Crashed(message=f"lost its host: the lease on range {shard_range} expired "
                                        f"(not renewed for {fan.lease_ttl_s:.0f} s)"),
                        force=True,
                    )
                    return "lease expired"
            time.sleep(fan.poll_interval_s)


def _lost(run_id: UUID, shard_range: ShardRange, cache_key: str, store: LeaseStore) -> bool:
    """No live lease on the range, and no receipt from this run (it releases only after writing it)."""
    if store.holders(shard_range):
        return False
    receipt = store.read_receipt(cache_key) or {}
    return receipt.get("worker") != str(run_id)


def gpu_slots_name(host: str | None = None) -> str:
    """The global concurrency limit of one GPU host: its limit is the host's GPU count."""
    import socket

    return f"gpu-host-{host or socket.gethostname()}"


@contextmanager
def gpu_slots(gpus: int, *, log=None) -> Iterator[None]:
    """Hold ``gpus`` slots of this host's GPU limit while the block runs (nothing when 0).

    A host's limit is created once per host (``prefect gcl create gpu-host-<hostname> --limit
    <GPUs>``, docs/scale-out.md); without it there is nothing to hold and the worker's ``--limit``
    alone bounds the host.
    """
    if gpus <= 0:
        yield
        return
    from prefect.concurrency.sync import concurrency

    name = gpu_slots_name()
    if log is not None:
        log.info("taking %d slots of %s", gpus, name)
    with concurrency(name, occupy=gpus, strict=False):
        yield
