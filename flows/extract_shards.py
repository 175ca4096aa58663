"""The `extract-shards` flow: one shard range of a plan, on whichever worker of the pool takes it.

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

from datagen.errors import CannotRunHereError, SpecError
from datagen.specs.plan import ExtractionPlan
from datagen.specs.source import LocalSource
from tasks.download import download, model_location
from tasks.extract import RangeOutcome
from tasks.fanout.child import extract_to_bucket, gpu_slots, range_lease, spool_dir, write_receipt
from tasks.pipeline_spec import PipelineSpec, ShardRange


@flow(name="extract-shards", description="Extract one shard range of a plan into its bucket (no manifest).")
def extract_shards(spec: PipelineSpec, plan: ExtractionPlan, shard_range: ShardRange, cache_key: str) -> RangeOutcome:
    """Extract shards ``shard_range`` of ``plan`` (the parent's, whole) into the bucket at ``spec.publish_to``.
    This host is checked to match the plan before anything is extracted: the range is the plan's, the
    model's revision is the plan's (here, after the download), its engine and model files are (the step,
    before any weight loads)."""
    logger = get_run_logger()
    spec = spec.resolved()
    if shard_range.stop > plan.num_shards:
        raise SpecError(f"range {shard_range} is outside the plan's {plan.num_shards} shards",
                        hint="submit ranges from the extract flow, which cuts them from the plan")
    with range_lease(spec, shard_range, plan.fingerprint, log=logger):
        if isinstance(spec.source, LocalSource):
            model_dir = plan.spec.model  # a local model: at the same path on every host
        else:
            model_dir, model_revision = model_location(spec, download(spec))  # this host's model cache
            if model_revision != plan.spec.model_revision:
                raise CannotRunHereError(
                    f"this host's model {spec.model} is at revision {model_revision}, the plan's is "
                    f"{plan.spec.model_revision}: range {shard_range} would be extracted from another model",
                    hint="give every worker host the same model revision (pin it: hf://org/name@<commit sha>), "
                         "or run the extract flow again: it plans with the revision the hosts download")
        with gpu_slots(spec.gpus, log=logger):
            result = extract_to_bucket(spec, plan, shard_range, model=model_dir, spool=spool_dir(spec),
                                       cache_key=cache_key, log=logger)
        outcome = RangeOutcome(range=shard_range, worker=str(flow_run.get_id() or ""), result=result)
        write_receipt(spec, cache_key, outcome, log=logger)
    logger.info("range %s done on this worker: %d shards extracted, %d were in the bucket", shard_range,
                len(outcome.shards_extracted), len(outcome.shards_cached))
    return outcome
