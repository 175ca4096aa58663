"""Fan-out, the parent: shard ranges as flow runs of the `extract-shards` deployment, the dataset in a
bucket (the `extract` flow with ``ranges_in_flight > 1``); what those runs do is ``tasks/fanout/child.py``.

* ``bucket_state``: what the bucket holds (complete shards, a manifest of this dataset or of
  another, which is refused). A range whose shards are all there is never submitted.
* ``dispatch_range``: one range. It creates the range's global concurrency limit (limit 1,
  ``tasks/fanout/range_limit.py``), submits the range with ``run_deployment`` (a subflow of the
  parent: the UI shows the tree) and watches the child. Completed: the range is done (its receipt
  in the bucket says what it did). Crashed: its process or host died -- the worker reports a dead
  process; a dead host is marked Crashed by the lost-host automation when its heartbeats stop
  (``flows/automations.py``) -- and the range is submitted again (up to ``fan_out.max_resubmits``).
  Failed or Cancelled: permanent, the parent fails. Same cache key as ``extract_range``: a second
  run submits nothing.
* ``fetch_shards`` then the ``assemble`` step (``tasks/assemble.py``): every shard object checked
  and copied into the local dataset directory, the manifest written there; the flow validates that
  dataset (the bucket's bytes), and only then ``publish_manifest`` writes the manifest to the
  bucket, last.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from uuid import UUID

from prefect import get_client, get_run_logger, task
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from pydantic import ValidationError

from datagen.data.contract import MANIFEST_NAME, STATE_DIR
from datagen.specs.extraction import sha256_hex
from datagen.specs.plan import ExtractionPlan
from datagen.errors import StorageError
from datagen.steps.assemble import AssembleResult
from datagen.steps.plan import PlanResult
from datagen.storage import fleet, s3
from tasks import artifacts
from tasks.bucket import bucket_of
from tasks.extract import RangeOutcome
from tasks.fanout.range_limit import delete_limit, ensure_limit, range_limit_name
from tasks.pipeline_spec import PipelineSpec, ShardRange
from tasks.retries import STEP_RETRY_POLICY, retrying
from tasks.step import RESULT_SERIALIZER, STEP_CACHE

WAITING_LOG_INTERVAL_S = 300.0  # how often "still waiting for a worker" is logged


class RangeRunFailed(RuntimeError):
    """The flow run of a range failed for a reason a re-run would not fix."""


@task(name="bucket-state", **STEP_RETRY_POLICY)
def bucket_state(spec: PipelineSpec, planned: PlanResult) -> PlanResult:
    """The plan with what the dataset's bucket holds: its complete shards, and the fingerprint of
    its manifest. Refuses a bucket location that holds another dataset."""
    logger = get_run_logger()
    client, _, dest = bucket_of(spec)
    manifest = fleet.check_destination(client, dest, planned.fingerprint)
    done = fleet.shards_in_bucket(client, dest, dict(enumerate(planned.shard_keys)))
    logger.info("%s holds %d of %d shards%s", dest.uri, len(done), planned.num_shards,
                " and this dataset's manifest" if manifest else "")
    return planned.model_copy(update={
        "shards_complete": sorted(done),
        "manifest_fingerprint": manifest.fingerprint if manifest else None,
        "validated_manifest_sha256": None,
    })


@task(
    name="dispatch-range",
    task_run_name="dispatch-range-{shard_range}",
    cache_policy=STEP_CACHE,
    persist_result=True,
    result_serializer=RESULT_SERIALIZER,
)
def dispatch_range(
    spec: PipelineSpec,
    plan: ExtractionPlan,
    shard_range: ShardRange,
    *,
    cache_key: str,
    in_bucket: bool = False,
    progress: UUID | None = None,
) -> RangeOutcome:
    """Run the range of ``plan`` on the pool; submit it again when its run is lost. See the module
    docstring. ``in_bucket``: every shard of the range is in the bucket already; nothing is submitted."""
    logger = get_run_logger()
    fan = spec.fan_out
    client, _, dest = bucket_of(spec)
    board = artifacts.board(progress)
    if in_bucket:
        logger.info("range %s: every shard is in %s already; nothing to submit", shard_range, dest.uri)
        receipt = retrying(lambda: fleet.read_receipt(client, dest, cache_key), "reading the range's receipt", logger)
        return _outcome(shard_range, receipt).served_from_cache()
    limit = range_limit_name(plan.fingerprint, shard_range)
    ensure_limit(limit)
    for attempt in range(fan.max_resubmits + 1):
        child = run_deployment(
            fan.deployment,
            parameters={"spec": spec.model_dump(mode="json"), "plan": plan.model_dump(mode="json"),
                        "shard_range": shard_range.model_dump(), "cache_key": cache_key},
            timeout=0,
            flow_run_name=f"range-{shard_range.first}-{shard_range.stop}" + (f"-retry{attempt}" if attempt else ""),
        )
        logger.info("range %s: submitted as flow run %s (%s)", shard_range, child.name, child.id)
        outcome = _watch(child.id, shard_range, spec, logger)
        if outcome == "completed":
            receipt = retrying(lambda: fleet.read_receipt(client, dest, cache_key), "reading the range's receipt", logger)
            done = _outcome(shard_range, receipt)
            if board is not None:
                board.set(shard_range.arg, 1.0, force=True)
            delete_limit(limit)
            return done
        logger.warning("range %s: flow run %s was lost (%s); submitting the range again", shard_range, child.name, outcome)
    raise RangeRunFailed(
        f"range {shard_range}: its flow run was lost {fan.max_resubmits + 1} times; giving up "
        "(check the workers of the pool, then re-run: the shards in the bucket are kept)"
    )


def _outcome(shard_range: ShardRange, receipt: dict | None) -> RangeOutcome:
    """The range's outcome as its receipt records it; without a (readable) receipt, a range whose
    every shard is in the bucket, nothing known of how they got there."""
    try:
        outcome = RangeOutcome.model_validate(receipt) if receipt is not None else None
    except ValidationError:
        outcome = None  # a receipt of another version: it only said what the bucket now shows
    if outcome is None or outcome.range != shard_range:
        return RangeOutcome(range=shard_range, result=None)
    return outcome


def _watch(run_id: UUID, shard_range: ShardRange, spec: PipelineSpec, logger) -> str:
    """Wait for the child's end. Returns "completed" or why it was lost; raises if it failed."""
    last_waiting_log = time.monotonic()
    with get_client(sync_client=True) as client:
        while True:
            run: FlowRun = client.read_flow_run(run_id)
            state = run.state
            if state is None or state.is_scheduled() or state.is_pending():
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
            time.sleep(spec.fan_out.poll_interval_s)


@task(name="bucket-dataset", **STEP_RETRY_POLICY)
def bucket_dataset(spec: PipelineSpec) -> AssembleResult:
    """The account of the manifest the dataset's bucket holds (a run before validated it, then wrote it)."""
    client, _, dest = bucket_of(spec)
    found = fleet.manifest_in_bucket(client, dest)
    if found is None:
        raise StorageError(f"{dest.uri}/{MANIFEST_NAME} is gone since this run planned",
                           hint="run again: the dataset is assembled and validated again")
    get_run_logger().info("%s already holds this dataset's manifest", dest.uri)
    return AssembleResult.of_manifest(found[0], dataset=dest.uri)


@task(name="bucket-shards", **STEP_RETRY_POLICY)
def fetch_shards(spec: PipelineSpec, planned: PlanResult) -> str:
    """Every shard object of the dataset's bucket checked against its record (size, sha256 metadata),
    then copied into the local dataset directory (the plan's output), where the manifest is assembled and
    the dataset validated: validation reads the bytes the bucket holds. Returns the directory of the
    records found (the input of `datagen assemble`, which refuses a dataset that lacks one)."""
    logger = get_run_logger()
    client, transfer, dest = bucket_of(spec)
    fleet.check_destination(client, dest, planned.fingerprint)
    records = fleet.shards_in_bucket(client, dest, dict(enumerate(planned.shard_keys)))
    logger.info("%s: %d of %d shard objects checked (size, sha256)", dest.uri, len(records), planned.num_shards)
    out = Path(planned.plan.spec.out)
    t0 = time.monotonic()
    sent = fleet.download_shards(client, dest, records.values(), out, transfer=transfer)
    logger.info("copied %d shards (%.1f MB) from %s to %s for validation in %.1f s", len(records), sent / 1e6,
                dest.uri, out, time.monotonic() - t0)
    directory = out / STATE_DIR / BUCKET_RECORDS
    shutil.rmtree(directory, ignore_errors=True)
    fleet.write_records(records, directory)
    return str(directory)


BUCKET_RECORDS = "bucket-records"  # under the local dataset's .datagen: the records `datagen assemble` reads

@task(name="publish-manifest", **STEP_RETRY_POLICY)
def publish_manifest(spec: PipelineSpec, assembled: AssembleResult) -> AssembleResult:
    """Upload the validated manifest to the dataset's bucket, last: from now on it is complete there.
    Returns the assemble step's result with the bucket as its ``dataset``."""
    logger = get_run_logger()
    client, _, dest = bucket_of(spec)
    path = Path(assembled.dataset) / MANIFEST_NAME
    raw = path.read_bytes()
    if sha256_hex(raw) != assembled.manifest_sha256:
        raise StorageError(f"{path} is not the manifest `datagen assemble` reported writing",
                           hint="another run writes the same output directory; run one at a time")
    # Every range is done: multipart uploads still open were left by killed runs (they hold storage).
    if aborted := s3.abort_stale_uploads(client, dest):
        logger.info("aborted %d unfinished multipart uploads of lost range runs", aborted)
    fleet.put_manifest(client, dest, raw)
    logger.info("manifest written: %s/%s", dest.uri, MANIFEST_NAME)
    return assembled.model_copy(update={"dataset": dest.uri})
