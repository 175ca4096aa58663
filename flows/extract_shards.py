"""The `extract-shards` flow: one shard range of a spec, on whichever worker of the pool takes it.

    deployment extract-shards/gpu (prefect.yaml); submitted by the `extract` flow when the spec
    has ranges_in_flight > 1 (tasks/fanout.py)

It writes only the range's shards (never the manifest: the parent writes it once every range is
complete). It holds a lease on the range's shards in the output store from its first step to its
last (tasks/leases.py), so no other run writes them meanwhile and a lost host's range is known to
be free once the lease expires; and it holds its share of this host's GPU limit while the engine
runs. The parent's cache key is used as is: a range that any run already extracted is Cached.
"""

from __future__ import annotations

import uuid

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from datagen.errors import SpecError
from datagen.pipeline_spec import PipelineSpec, ShardRange
from datagen.sources import LocalSource, parse_model_source
from tasks.download import download
from tasks.extract import RangeResult, extract_range
from tasks.fanout import gpu_slots
from tasks.leases import hold_range


@flow(name="extract-shards", description="Extract one shard range of a spec (no manifest).")
def extract_shards(
    spec: PipelineSpec, shard_range: ShardRange, cache_key: str, fingerprint: str, model_revision: str | None = None
) -> RangeResult:
    """Extract shards ``shard_range`` of ``spec``. ``cache_key``, ``fingerprint`` and
    ``model_revision`` come from the parent's plan: the range's key, the dataset's fingerprint and
    the model's resolved revision."""
    logger = get_run_logger()
    spec = spec.resolved()
    holder = str(flow_run.get_id() or uuid.uuid4())
    with hold_range(spec.output, shard_range, holder=holder, ttl_s=spec.fan_out.lease_ttl_s, log=logger) as store:
        if isinstance(parse_model_source(spec.model), LocalSource) and model_revision is not None:
            # A local model is on storage every host mounts at the same path: nothing to fetch.
            model_dir = spec.model
        else:
            model = download(spec)  # this host's model cache
            model_dir, model_revision = model.model_dir, model.resolved_revision
        xspec = spec.extract_spec(model_dir=model_dir, model_revision=model_revision)
        with gpu_slots(spec.gpus, log=logger):
            # The parent asked for this range because it is not complete: run it (complete shards
            # inside it are kept by the step).
            storage = {"result_storage": spec.result_storage} if spec.result_storage else {}
            result = extract_range.with_options(refresh_cache=True, **storage)(
                xspec, shard_range, cache_key=cache_key, runner=spec.runner, gpus=spec.gpus
            )
        if result.fingerprint != fingerprint:
            raise SpecError(
                f"this host extracted range {shard_range} for dataset {result.fingerprint[:12]}, the run "
                f"asked for {fingerprint[:12]}: the model, dataset or engine differ between hosts",
                hint="give every worker host the same image (or environment), model revision and dataset",
            )
        store.write_receipt(cache_key, {**result.model_dump(mode="json"), "worker": holder})
    logger.info("range %s done on this worker: %d shards extracted", shard_range, len(result.shards_extracted))
    return result
