"""The `extract-shards` flow: one shard range of a spec, on whichever worker of the pool takes it.

    deployment extract-shards/gpu (prefect.yaml); submitted by the `extract` flow when the spec
    has ranges_in_flight > 1 (tasks/fanout/parent.py; what it runs: tasks/fanout/child.py)

It holds the range's lease on Prefect's server (a global concurrency slot, renewed while it runs)
from its first step to its last, so no other run writes the range meanwhile and a lost host's
range is free once its lease expires. It extracts the shards the dataset's bucket does not hold
yet into this host's spool (``$DATAGEN_SPOOL``), uploads each as soon as it is written and removes
it locally, and holds its share of this host's GPU limit while the engine runs. It never writes
the manifest (the parent does, once every range is complete) and reads no other host's files.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from datagen.errors import SpecError
from datagen.storage.sources import LocalSource
from tasks.download import download, model_location
from tasks.extract import RangeOutcome
from tasks.fanout.child import extract_to_bucket, gpu_slots, range_lease, spool_dir, write_receipt
from tasks.pipeline_spec import PipelineSpec, ShardRange


@flow(name="extract-shards", description="Extract one shard range of a spec into its bucket (no manifest).")
def extract_shards(
    spec: PipelineSpec, shard_range: ShardRange, cache_key: str, fingerprint: str, shard_keys: list[str],
    model_revision: str | None = None,
) -> RangeOutcome:
    """Extract shards ``shard_range`` of ``spec`` into the bucket at ``spec.publish_to``.
    ``cache_key``, ``fingerprint``, ``shard_keys`` (the range's, in order) and ``model_revision``
    come from the parent's plan."""
    logger = get_run_logger()
    spec = spec.resolved()
    if len(shard_keys) != len(shard_range.shards):
        raise SpecError(f"range {shard_range} has {len(shard_range.shards)} shards but {len(shard_keys)} keys were given",
                        hint="submit ranges from the extract flow")
    with range_lease(spec, shard_range, fingerprint, log=logger):
        if isinstance(spec.source, LocalSource) and model_revision is not None:
            model_dir = spec.model  # a local model: at the same path on every host
        else:
            model_dir, model_revision = model_location(spec, download(spec))  # this host's model cache
        spool = spool_dir(spec)
        xspec = spec.model_copy(update={"output": str(spool)}).extract_spec(model_dir=model_dir,
                                                                            model_revision=model_revision)
        with gpu_slots(spec.gpus, log=logger):
            result = extract_to_bucket(spec, xspec, shard_range, shard_keys=shard_keys, cache_key=cache_key, log=logger)
        if result is not None and result.fingerprint != fingerprint:
            raise SpecError(
                f"this host extracted range {shard_range} for dataset {result.fingerprint[:12]}, the run "
                f"asked for {fingerprint[:12]}: the model, dataset or engine differ between hosts",
                hint="give every worker host the same image (or environment), model revision and dataset",
            )
        outcome = RangeOutcome(range=shard_range, worker=str(flow_run.get_id() or ""), result=result)
        write_receipt(spec, cache_key, outcome, log=logger)
    logger.info("range %s done on this worker: %d shards extracted, %d were in the bucket", shard_range,
                len(outcome.shards_extracted), len(outcome.shards_cached))
    return outcome
