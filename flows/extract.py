"""The `extract` flow: env check -> download -> plan -> extraction by shard range -> finalize ->
validate -> publish -> announce.

    prefect deployment run extract/tiny      # the embedded default (prefect.yaml)
    prefect deployment run extract/kimi      # Kimi-K2.5, TP 8, GPU pool, nightly

The DAG only: every step is a task of ``tasks/`` that runs its step program through the spec's
runner, streams its output into the run log, retries transient faults and caches what is
expensive. Shard ranges are the unit of caching, retry and fan-out: with ``ranges_in_flight`` 1
they run one after the other in this process; with more, each runs as a flow run of the
``extract-shards`` deployment on a work pool (``flows/extract_shards.py``), so every GPU host's
worker takes the next range.
"""

from __future__ import annotations

from collections.abc import Callable

from prefect import flow, get_run_logger
from prefect.futures import PrefectFuture, as_completed

from datagen.pipeline_spec import PipelineSpec, ShardRange
from datagen.spec import ExtractSpec
from tasks import artifacts
from tasks._common import runner_identity
from tasks.download import download
from tasks.env_check import env_check
from tasks.extract import (
    PlanResult, RangeResult, extract_range, finalize, finalize_cache_key, plan, range_cache_key,
)
from tasks.fanout import dispatch_range
from tasks.handoff import PublishOutcome, announce, publish, publish_cache_key
from tasks.validate import validate, validate_cache_key


@flow(name="extract", description="Extract a model's hidden states for a dataset into a validated dataset.")
def extract(spec: PipelineSpec) -> dict:
    """Run the whole pipeline for ``spec``; returns the run's summary (dataset, fingerprint, totals)."""
    logger = get_run_logger()
    spec = spec.resolved()
    env_check(spec)
    model = download(spec)
    xspec = spec.extract_spec(model_dir=model.model_dir, model_revision=model.resolved_revision)
    planned = plan(xspec, runner=spec.runner)
    identity = runner_identity(spec.runner, gpu=spec.gpus > 0)

    ranges = _extract_ranges(spec, xspec, planned, identity)

    dataset = finalize.with_options(refresh_cache=not planned.dataset_complete)(
        xspec, cache_key=finalize_cache_key(planned, identity=identity, out=xspec.out), runner=spec.runner
    )
    verdict = validate.with_options(refresh_cache=planned.validated_manifest_sha256 != dataset.manifest_sha256)(
        dataset.dataset,
        manifest_sha256=dataset.manifest_sha256,
        cache_key=validate_cache_key(
            fingerprint=dataset.fingerprint, manifest_sha256=dataset.manifest_sha256, identity=identity
        ),
        runner=spec.runner,
        inputs=(xspec.model, xspec.dataset),
    )
    published = PublishOutcome()
    if spec.publish_to:
        published = publish(
            dataset.dataset,
            destination=spec.publish_to,
            cache_key=publish_cache_key(manifest_sha256=dataset.manifest_sha256, destination=spec.publish_to),
            runner=spec.runner,
        )
    changed = any(r.shards_extracted for r, _ in ranges) or not planned.dataset_complete
    uri = published.destination or dataset.dataset
    announce(
        fingerprint=dataset.fingerprint, dataset=dataset.dataset, uri=uri, changed=changed,
        tokens=dataset.totals.get("tokens", 0), shards=dataset.totals.get("shards", 0),
    )
    artifacts.report(
        spec=spec.model_dump(mode="json"),
        dataset=dataset.model_dump(mode="json"),
        ranges=[r.model_dump(mode="json") | {"task_cached": cached} for r, cached in ranges],
        published_to=published.destination,
        validation=verdict.summary,
    )
    logger.info("dataset: %s (fingerprint %s)", uri, dataset.fingerprint)
    return {
        "dataset": dataset.dataset,
        "uri": uri,
        "fingerprint": dataset.fingerprint,
        "totals": dataset.totals,
        "ranges": len(ranges),
        "ranges_cached": sum(cached for _, cached in ranges),
        "shards_extracted": sorted(k for r, _ in ranges for k in r.shards_extracted),
        "changed": changed,
    }


def _extract_ranges(
    spec: PipelineSpec, xspec: ExtractSpec, planned: PlanResult, identity: str
) -> list[tuple[RangeResult, bool]]:
    """Every range, at most ``ranges_in_flight`` at a time. Returns (result, served from cache)."""
    ranges = spec.ranges(planned.num_shards)
    progress = artifacts.start_progress(
        {r.arg: len(r.shards) for r in ranges},
        done={r.arg for r in ranges if planned.range_on_disk(r)},
        description=f"Shards extracted of {planned.num_shards} ({planned.tokens:,} tokens)",
    )

    def submit(r: ShardRange) -> PrefectFuture:
        key = range_cache_key(planned, r, identity=identity, out=xspec.out)
        # A range whose shards are not on disk is never served from the cache (the dataset was
        # deleted or moved since the cache record was written).
        refresh = not planned.range_on_disk(r)
        if spec.fans_out:
            return dispatch_range.with_options(refresh_cache=refresh).submit(
                spec, r, cache_key=key, fingerprint=planned.fingerprint, progress=progress
            )
        return extract_range.with_options(refresh_cache=refresh).submit(
            xspec, r, cache_key=key, runner=spec.runner, gpus=spec.gpus, progress=progress
        )

    return _windowed(ranges, submit, limit=spec.ranges_in_flight)


def _windowed(
    ranges: list[ShardRange], submit: Callable[[ShardRange], PrefectFuture], *, limit: int
) -> list[tuple[RangeResult, bool]]:
    """Keep ``limit`` ranges in flight. After a failure nothing new is submitted, the ranges in
    flight finish (their work is cached for the re-run), then the first failure is raised."""
    pending = list(ranges)
    running: dict[PrefectFuture, ShardRange] = {}
    done: dict[str, tuple[RangeResult, bool]] = {}
    failed: PrefectFuture | None = None
    while pending or running:
        while pending and failed is None and len(running) < limit:
            r = pending.pop(0)
            running[submit(r)] = r
        if not running:
            break
        future = next(as_completed(list(running)))
        r = running.pop(future)
        future.wait()  # the final state, not the last one the API has seen
        state = future.state
        if state.is_completed():
            done[r.arg] = (future.result(), state.name == "Cached")
        elif failed is None:
            failed = future
    if failed is not None:
        failed.result()  # raises the range's error
    return [done[r.arg] for r in ranges]
