"""Fan-out, the child: what one flow run of the `extract-shards` deployment (``flows/extract_shards.py``)
does with its range, and what it holds meanwhile.

* ``range_lease``: the range's slot, a server-side lease of ``fan_out.lease_s`` renewed by the
  holder (``tasks/fanout/range_limit.py``). A second run of the range waits for it; a holder that
  stops renewing (its host died) loses it when it expires and the server's repossessor frees the
  slot; a holder whose renewal fails stops its own execution, so two runs never write one range.
* ``gpu_slots``: this host's share of its GPU limit (a global concurrency limit too) while the
  engine runs.
* ``extract_to_bucket``: under the lease, extract the shards the bucket lacks into this host's
  spool, upload each as soon as it is written (publish path, checksums), remove it from the spool.
* ``write_receipt``: the range's outcome in the bucket, which the parent's ``dispatch_range`` reads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from uuid import UUID

from datagen import settings
from datagen.data.contract import ShardRecord
from datagen.specs.plan import ExtractionPlan
from datagen.errors import StorageError
from datagen.steps.extract import ExtractResult
from datagen.storage import fleet
from tasks.bucket import bucket_of
from tasks.extract import RangeOutcome, extract_range, range_call
from tasks.fanout.range_limit import ensure_limit, range_limit_name
from tasks.pipeline_spec import PipelineSpec, ShardRange
from tasks.retries import retrying

UPLOAD_POLL_S = 1.0  # how often a range looks for newly written shards to upload


@contextmanager
def range_lease(spec: PipelineSpec, shard_range: ShardRange, fingerprint: str, *, log) -> Iterator[None]:
    """Hold the range's slot (a lease of ``fan_out.lease_s`` on Prefect's server) while the block
    runs; wait while another run holds it. A renewal that fails stops this run."""
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.concurrency.sync import concurrency
    from prefect.runtime import flow_run

    name = range_limit_name(fingerprint, shard_range)
    ensure_limit(name)  # the parent made it; a run started by hand makes it too
    run_id = flow_run.get_id()
    holder = ConcurrencyLeaseHolder(type="flow_run", id=UUID(str(run_id))) if run_id else None
    t0 = time.monotonic()
    log.info("range %s: taking its lease (%s, %.0f s)", shard_range, name, spec.fan_out.lease_s)
    with concurrency(name, occupy=1, lease_duration=spec.fan_out.lease_s, strict=True, holder=holder,
                     raise_on_lease_renewal_failure=True):
        log.info("range %s: lease held (waited %.1f s)", shard_range, time.monotonic() - t0)
        yield


# --- per-host GPU limits ------------------------------------------------------------------------

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


# --- the range's work under its lease -------------------------------------------------------------

def spool_dir(spec: PipelineSpec) -> Path:
    """This host's local directory for the range's shards before upload: ``$DATAGEN_SPOOL/<name of
    the output>``, or the spec's output when DATAGEN_SPOOL is not set."""
    root = settings.spool_dir()
    return (root / Path(spec.output).name).absolute() if root is not None else Path(spec.output)


def extract_to_bucket(spec: PipelineSpec, plan: ExtractionPlan, shard_range: ShardRange, *, model: str, spool: Path,
                      cache_key: str, log) -> ExtractResult | None:
    """Extract the plan's shards of the range that the bucket lacks into ``spool`` (the model being
    this host's copy at ``model``), uploading each as soon as it is written. Returns the extract step's
    result for the whole range (its runs, one per run of consecutive missing shards, taken together);
    None when the bucket held every shard and no step ran."""
    client, transfer, dest = bucket_of(spec)
    expected = {k: plan.shard_keys[k] for k in shard_range.shards}
    t0 = time.monotonic()
    held = retrying(lambda: fleet.shards_in_bucket(client, dest, expected), "reading the bucket", log)
    todo = [k for k in shard_range.shards if k not in held]
    log.info("range %s: %d shards in %s already, %d to extract", shard_range, len(held), dest.uri, len(todo))
    extracted: list[ExtractResult] = []
    for run in _runs(todo):
        sub = ShardRange(first=run[0], stop=run[-1] + 1)
        with _Uploader(client, spool, dest, {k: expected[k] for k in sub.shards}, transfer, log):
            extracted.append(extract_range.with_options(refresh_cache=True, **spec.storage_options)(
                range_call(plan, sub, gpus=spec.gpus, model=model, out=str(spool)),
                cache_key=f"{cache_key}-{sub.first}-{sub.stop}",
                runner=spec.runner,
            ))
    final = retrying(lambda: fleet.shards_in_bucket(client, dest, expected), "reading the bucket", log)
    missing = [k for k in shard_range.shards if k not in final]
    if missing:
        raise StorageError(f"range {shard_range}: shards {missing} are not in {dest.uri} after the range ran",
                           hint="retry: the range extracts and uploads what is missing")
    if not extracted:
        return None
    seconds = time.monotonic() - t0
    tokens_extracted = sum(r.tokens_extracted for r in extracted)
    return extracted[0].model_copy(update={  # the runs share the dataset's identity, layers and engine
        "shards_extracted": todo,
        "shards_cached": sorted(held),
        "tokens": sum(final[k].tokens for k in shard_range.shards),
        "tokens_extracted": tokens_extracted,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens_extracted / seconds, 1) if tokens_extracted and seconds > 0 else 0.0,
    })


def write_receipt(spec: PipelineSpec, cache_key: str, outcome: RangeOutcome, *, log) -> None:
    """The range's receipt in the bucket: its outcome (what the parent's ``dispatch_range`` returns)."""
    client, _, dest = bucket_of(spec)
    receipt = outcome.model_dump(mode="json")
    retrying(lambda: fleet.write_receipt(client, dest, cache_key, receipt), "writing the range's receipt", log)


def _runs(indices: list[int]) -> list[list[int]]:
    """Consecutive runs of sorted indices: each is one `datagen extract --shards A:B`."""
    runs: list[list[int]] = []
    for k in indices:
        if runs and runs[-1][-1] == k - 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return runs


class _Uploader:
    """Uploads each shard of ``expected`` as soon as the extraction has written it (its record in
    the spool names the expected key), then removes it from the spool. A background thread while
    the extraction runs; a last pass, whose errors are raised, when the block ends."""

    def __init__(self, client, spool: Path, dest, expected: dict[int, str], transfer, log) -> None:
        self.client, self.spool, self.dest, self.expected, self.transfer, self.log = client, spool, dest, expected, transfer, log
        self.uploaded: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shard-upload", daemon=True)

    def __enter__(self) -> "_Uploader":
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        self._thread.join(timeout=600)
        if exc_type is None:
            retrying(self.sweep, "uploading shards", self.log)

    def _loop(self) -> None:
        while not self._stop.wait(UPLOAD_POLL_S):
            try:
                self.sweep()
            except Exception as e:  # the last pass retries and raises
                self.log.warning("uploading shards failed (retried at the end of the range): %s", e)

    def _ready(self) -> list[ShardRecord]:
        ready = []
        for k, key in self.expected.items():
            if k in self.uploaded:
                continue
            path = self.spool / fleet.record_rel(k)
            try:
                rec = ShardRecord.model_validate_json(path.read_bytes())
            except (OSError, ValueError):
                continue
            f = self.spool / rec.path
            if rec.shard_key == key and rec.index == k and f.is_file() and f.stat().st_size == rec.bytes:
                ready.append(rec)
        return ready

    def sweep(self) -> None:
        with self._lock:
            ready = self._ready()
            if not ready:
                return
            t0 = time.monotonic()
            sent = fleet.upload_shards(self.client, self.spool, ready, self.dest, transfer=self.transfer)
            for rec in ready:
                self.uploaded.add(rec.index)
                (self.spool / rec.path).unlink(missing_ok=True)
            dt = max(time.monotonic() - t0, 1e-6)
            self.log.info("uploaded shards %s to %s: %.1f MB at %.1f MB/s", [r.index for r in ready], self.dest.uri,
                          sent / 1e6, sent / dt / 1e6)
