"""The `extract` flow: env check -> download -> plan -> extraction by shard range -> finalize ->
validate -> publish -> announce.

    prefect deployment run extract/tiny      # the embedded default (prefect.yaml)
    prefect deployment run extract/kimi      # Kimi-K2.5, TP 8, GPU pool, nightly

The DAG only: every step is a task of ``tasks/`` that runs its step program through the spec's
runner, streams its output into the run log, retries transient faults and caches what is
expensive. Shard ranges are the unit of caching, retry and fan-out: with ``ranges_in_flight`` 1
they run one after the other in this process; with more, each runs as a flow run of the
``extract-shards`` deployment on a work pool (``flows/extract_shards.py``), so every GPU host's
worker takes the next range, and the dataset is written straight to its bucket (``publish_to``):
ranges upload their shards (``tasks/fanout/child.py``); this flow checks every shard object,
copies them into its own output, assembles the manifest there, validates that dataset like any
other and writes the manifest to the bucket last (``tasks/fanout/parent.py``). Nothing is published or
announced before it is validated.
"""

from __future__ import annotations

from collections.abc import Callable

from prefect import flow, get_run_logger
from prefect.futures import PrefectFuture, as_completed

from datagen.specs.source import LocalSource
from tasks import artifacts
from tasks.assemble import assemble, assemble_call
from tasks.cache_keys import runner_identity
from tasks.download import download, model_location
from tasks.env_check import env_checked, start_env_check
from tasks.extract import (
    RangeOutcome, extract_range, finalize, finalize_call, finalize_cache_key, range_cache_key, range_call,
)
from tasks.fanout.parent import bucket_dataset, bucket_state, dispatch_range, fetch_shards, publish_manifest
from tasks.pipeline_spec import PipelineSpec, ShardRange
from tasks.plan import PlanResult, plan, plan_call
from tasks.publish import announce, publish_cache_key, publish_dataset
from tasks.regenerate import RegenerateResult, regenerate_dataset
from tasks.report import layer_report
from tasks.validate import validate_cache_key, validate_dataset, validation_summary


@flow(name="extract", description="Extract a model's hidden states for a dataset into a validated dataset.")
def extract(spec: PipelineSpec) -> dict:
    """Run the whole pipeline for ``spec``; returns the run's summary (dataset, fingerprint, totals)."""
    logger = get_run_logger()
    spec = spec.resolved()
    # The env check gates what costs: a download and any engine start. A local model needs no
    # download, so its (free) download check and the plan run while the env check runs.
    checks = start_env_check(spec)
    local_model = isinstance(spec.source, LocalSource)
    if not local_model:
        env_checked(checks)
    model_dir, model_revision = model_location(spec, download(spec))
    regenerated = None
    if spec.regenerate is not None:
        # Regeneration starts an engine: not before the env check passed.
        if local_model:
            env_checked(checks)
            local_model = False  # checked: not again below
        regenerated = _regenerate(spec, model_dir, model_revision)
        spec = spec.model_copy(update={"dataset": regenerated.dataset, "regenerate": None})
    xspec = spec.extract_spec(model_dir=model_dir, model_revision=model_revision)
    planned = plan(plan_call(xspec, cuda=spec.gpus > 0), runner=spec.runner)
    logger.info(
        "plan: %d rows, %d tokens, %d shards (%d already complete), fingerprint %s",
        planned.rows, planned.tokens, planned.num_shards, len(planned.shards_complete), planned.fingerprint[:12],
    )
    identity = runner_identity(spec.runner, gpu=spec.gpus > 0)
    if local_model:
        env_checked(checks)
    if spec.fans_out:  # the dataset lives in its bucket: what is done is what the bucket holds
        planned = bucket_state(spec, planned)

    ranges = _extract_ranges(spec, planned, identity)

    if spec.fans_out:
        dataset, validation, published_to = _assemble(spec, planned, identity)
    else:
        dataset, validation, published_to = _finalize_validate_publish(spec, planned, identity)
    changed = any(r.shards_extracted for r, _ in ranges) or not planned.dataset_complete
    uri = published_to or dataset.dataset
    announce(
        fingerprint=dataset.fingerprint, dataset=dataset.dataset, uri=uri, changed=changed,
        tokens=dataset.totals.get("tokens", 0), shards=dataset.totals.get("shards", 0),
    )
    artifacts.run_summary(
        spec=spec.model_dump(mode="json"),
        dataset=dataset.model_dump(mode="json"),
        ranges=[r.record() | {"task_cached": cached} for r, cached in ranges],
        published_to=published_to,
        validation=validation,
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
        "validation": validation,
        **({"regenerated": _regenerated_summary(regenerated)} if regenerated is not None else {}),
    }


def _regenerate(spec: PipelineSpec, model_dir: str, model_revision: str | None) -> RegenerateResult:
    """The target model writes the dataset's assistant turns again (`datagen regenerate`); the
    result names the chats the rest of the run extracts."""
    result = regenerate_dataset(spec, model_dir=model_dir, model_revision=model_revision,
                                identity=runner_identity(spec.runner, gpu=spec.regenerate_gpus > 0),
                                task_options=spec.storage_options)
    get_run_logger().info(
        "regenerate: %d chats (%d skipped), %d turns, %d tokens generated%s -> %s", result.rows, result.skipped,
        result.generated_turns, result.generated_tokens, " (cached)" if result.cached else "", result.dataset)
    return result


def _regenerated_summary(r: RegenerateResult) -> dict:
    return {"dataset": r.dataset, "fingerprint": r.fingerprint, "rows": r.rows, "skipped": r.skipped,
            "generated_tokens": r.generated_tokens}


def _assemble(spec: PipelineSpec, planned: PlanResult, identity: str):
    """A fanned-out dataset: every shard object in the bucket checked and copied into the local
    output, the manifest assembled there, the dataset validated (the bucket's bytes), and only then
    the manifest written to the bucket, last. A bucket that holds this dataset's manifest already
    was validated before it was written. Returns the assemble step's result (its ``dataset`` the
    bucket), the validation line of the summary, and where the dataset is."""
    dest = spec.publish_to
    if planned.dataset_complete:
        return bucket_dataset(spec), "passed (before its manifest was written to the bucket)", dest
    records = fetch_shards(spec, planned)
    assembled = assemble(assemble_call(planned.plan, records, cuda=spec.gpus > 0), runner=spec.runner)
    layer_report(assembled.dataset, previous=spec.validation.previous, runner=spec.runner)
    validated = _validate(spec, planned, assembled, identity)
    return publish_manifest(spec, assembled), validation_summary(validated), dest


def _finalize_validate_publish(spec: PipelineSpec, planned: PlanResult, identity: str):
    """A dataset written on this host: the manifest, validation, then the publish to S3. Returns the
    extract step's result (with the manifest), the validation line of the summary, and where the
    dataset was published (None: not)."""
    dataset = finalize.with_options(refresh_cache=not planned.dataset_complete, **spec.storage_options)(
        finalize_call(planned.plan, cuda=spec.gpus > 0),
        cache_key=finalize_cache_key(planned, identity=identity, out=planned.plan.spec.out),
        runner=spec.runner,
    )
    if dataset.shards_extracted:
        get_run_logger().warning("finalize had to extract shards %s: a range did not complete them",
                                 dataset.shards_extracted)
    # before validation: a drift that fails the run is on the plot of that run
    layer_report(dataset.dataset, previous=spec.validation.previous, runner=spec.runner)
    validated = _validate(spec, planned, dataset, identity)
    published = None  # PublishResult, when published
    if spec.publish_to:
        published = publish_dataset(
            dataset.dataset,
            destination=spec.publish_to,
            cache_key=publish_cache_key(manifest_sha256=dataset.manifest_sha256, destination=spec.publish_to),
            runner=spec.runner,
            task_options=spec.storage_options,
        )
    return dataset, validation_summary(validated), published.destination if published is not None else None


def _validate(spec: PipelineSpec, planned: PlanResult, dataset, identity: str):
    """`datagen validate` of the local dataset (``dataset``: the step's result that wrote its
    manifest), golden rows included; a problem fails the run before anything is published."""
    return validate_dataset(
        dataset.dataset,
        cache_key=validate_cache_key(
            fingerprint=dataset.fingerprint, manifest_sha256=dataset.manifest_sha256, identity=identity,
            settings=spec.validation,
        ),
        runner=spec.runner,
        settings=spec.validation,
        model=planned.plan.spec.model,
        source=planned.plan.spec.dataset,
        tokenizer=planned.plan.spec.tokenizer,
        trust_remote_code=planned.plan.spec.engine.trust_remote_code,
        gpus=spec.gpus,
        task_options=dict(refresh_cache=planned.validated_manifest_sha256 != dataset.manifest_sha256,
                          **spec.storage_options),
    )


def _extract_ranges(spec: PipelineSpec, planned: PlanResult, identity: str) -> list[tuple[RangeOutcome, bool]]:
    """Every range, at most ``ranges_in_flight`` at a time. Returns (result, served from cache)."""
    ranges = spec.ranges(planned.num_shards)
    progress = artifacts.start_progress(
        {r.arg: len(r.shards) for r in ranges},
        done={r.arg for r in ranges if planned.range_on_disk(r)},
        description=f"Shards extracted of {planned.num_shards} ({planned.tokens:,} tokens)",
    )

    def submit(r: ShardRange) -> PrefectFuture:
        # A fanned-out dataset lives in its bucket (``planned`` says what the bucket holds).
        key = range_cache_key(planned, r, identity=identity, out=spec.publish_to if spec.fans_out else planned.plan.spec.out)
        # A range whose shards are not on disk is never served from the cache (the dataset was
        # deleted or moved since the cache record was written).
        refresh = not planned.range_on_disk(r)
        if spec.fans_out:
            return dispatch_range.with_options(refresh_cache=refresh, **spec.storage_options).submit(
                spec, planned.plan, r, cache_key=key, in_bucket=not refresh, progress=progress,
            )
        return extract_range.with_options(refresh_cache=refresh, **spec.storage_options).submit(
            range_call(planned.plan, r, gpus=spec.gpus, progress=progress), cache_key=key, runner=spec.runner
        )

    return _windowed(ranges, submit, limit=spec.ranges_in_flight)


def _windowed(
    ranges: list[ShardRange], submit: Callable[[ShardRange], PrefectFuture], *, limit: int
) -> list[tuple[RangeOutcome, bool]]:
    """Keep ``limit`` ranges in flight. After a failure nothing new is submitted, the ranges in
    flight finish (their work is cached for the re-run), then the first failure is raised."""
    pending = list(ranges)
    running: dict[PrefectFuture, ShardRange] = {}
    done: dict[str, tuple[RangeOutcome, bool]] = {}
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
            cached = state.name == "Cached"
            result = future.result()  # a fanned-out range's outcome, or the extract step's result
            outcome = result if isinstance(result, RangeOutcome) else RangeOutcome(range=r, result=result)
            done[r.arg] = (outcome.served_from_cache() if cached else outcome, cached)
        elif failed is None:
            failed = future
    if failed is not None:
        failed.result()  # raises the range's error
    return [done[r.arg] for r in ranges]


RESULT_LINE_PREFIX = "extract-result: "


def main(argv: list[str] | None = None) -> int:
    """Run a deployment's flow in this process, without a server (Prefect's ephemeral mode when
    no PREFECT_API_URL is set). Prints the run's summary as the last line, prefixed."""
    import argparse
    import json

    from flows._deployments import deployment_parameters

    parser = argparse.ArgumentParser(prog="python -m flows.extract", description=main.__doc__)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--deployment", default="tiny", help="deployment of prefect.yaml whose parameters to use")
    source.add_argument("--spec", help="a pipeline spec JSON file (tasks.pipeline_spec.PipelineSpec) instead")
    args = parser.parse_args(argv)
    if args.spec:
        from pathlib import Path

        parameters = {"spec": json.loads(Path(args.spec).read_text())}
    else:
        parameters = deployment_parameters(args.deployment)
    state = extract(**parameters, return_state=True)
    if not state.is_completed():
        print(f"error: the run ended {state.name}: {state.message}")
        return 1
    print(RESULT_LINE_PREFIX + json.dumps(state.result(), sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
