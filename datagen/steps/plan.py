"""The plan step: ``datagen plan``. Checks a spec and prints what extraction would do.

Everything ``datagen extract`` checks before loading a weight is checked here
(spec, model config, every dataset row), and the result names the fingerprints
and every shard's cache key, so the orchestrator can key its cache on them
without importing the engine. In an output where a run stored this spec's plan
(``datagen.extraction.stored``) the rows are not read again: they were checked
when it was stored; in an output this extraction has claimed, a plan computed
here is stored for the ranges that follow. It also says what the output already holds: the
manifest's fingerprint and the manifest a passing validation approved, so the
orchestrator never reads the step's files itself.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel, ConfigDict, Field

from datagen.data.contract import ResolvedSpec, ShardRecord, manifest_fingerprint, validated_manifest_sha256
from datagen.extraction import stored
from datagen.extraction.output import claimed_by, completed_shards
from datagen.extraction.plan import Plan, describe_shards, shard_weights
from datagen.steps.extract import ExtractionSpec

HELP = "Check a spec and print its fingerprints and each shard's cache key (loads no weights)."
log = logging.getLogger(__name__)


class Spec(ExtractionSpec):
    """``datagen plan``'s input: the extraction spec."""


class PlanResult(BaseModel):
    """What `datagen plan` says about a spec, and what is already in its output."""

    model_config = ConfigDict(frozen=True)

    fingerprint: str = Field(description="sha256 of the full spec: the dataset's identity.")
    extraction_fingerprint: str = Field(description="The spec without the dataset.")
    num_shards: int = Field(description="Shards of the dataset.")
    rows: int = Field(description="Dataset rows.")
    tokens: int = Field(description="Tokens the dataset will hold.")
    layer_ids: list[int] = Field(description="Captured layers (vLLM numbering).")
    hidden_size: int = Field(description="The model's hidden size (H of a stored state).")
    num_hidden_layers: int = Field(description="The model's decoder layers.")
    shard_keys: list[str] = Field(description="Cache key of each shard, by index.")
    shard_state_bytes: dict[str, int] = Field(
        description="Bytes of stored states per shard (tokens x layers x hidden x the storage dtype's bytes, "
                    "fp8's scales included): min, median and max over the plan's shards.")
    shard_group: int = Field(description="Shards the engine streams without a drain between them (the spec's, "
                                         "else resolved from the shard size and the step's token budget).")
    shards_complete: list[int] = Field(description="Shards already written for this spec.")
    spec: ResolvedSpec = Field(description="The resolved spec, as the manifest will record it.")
    manifest_fingerprint: str | None = Field(
        None, description="Fingerprint in the output's manifest.json, None when there is none."
    )
    validated_manifest_sha256: str | None = Field(
        None, description="sha256 of the manifest that the output's validation report approves."
    )

    @property
    def dataset_complete(self) -> bool:
        return self.manifest_fingerprint == self.fingerprint

    def range_on_disk(self, shard_range) -> bool:
        """Whether every shard of ``shard_range`` (anything with ``.shards``) is complete."""
        done = set(self.shards_complete)
        return all(k in done for k in shard_range.shards)


Result = PlanResult


def run(spec: Spec) -> PlanResult:
    # The plan a run stored in its output, when it is this spec's: every row was checked then.
    p, from_store = stored.plan_shards(spec.extraction(), (0, 0))
    claimed = claimed_by(p)
    if claimed and not from_store:  # an output of ours: keep the plan for the ranges that follow
        stored.store_plan(p)
    done = completed_shards(p) if claimed else {}
    _check_output_space(p, done)
    log.info("plan: %s", describe_shards(p))
    return PlanResult(
        fingerprint=p.fingerprint,
        extraction_fingerprint=p.extraction_fingerprint,
        num_shards=p.num_shards,
        rows=p.data.rows,
        tokens=p.data.tokens,
        layer_ids=list(p.layer_ids),
        hidden_size=p.info.hidden_size,
        num_hidden_layers=p.info.num_hidden_layers,
        shard_keys=[p.shard_key(k) for k in range(p.num_shards)],
        shard_state_bytes=shard_weights(p),
        shard_group=p.shard_group,
        shards_complete=sorted(done),
        spec=p.resolved_spec,
        manifest_fingerprint=manifest_fingerprint(p.spec.out),
        validated_manifest_sha256=validated_manifest_sha256(p.spec.out),
    )


def _check_output_space(p: Plan, done: dict[int, ShardRecord]) -> None:
    """Refuse before any engine starts when the output cannot hold what is left to extract.

    The env check can only estimate the output from a spec's ``expected_tokens`` (it runs before
    the model and its tokenizer are here); the plan has the exact count, in the dtype stored.
    """
    from datagen.errors import CannotRunHereError
    from datagen.envcheck.report import Status
    from datagen.envcheck.space import check_output_space

    left = p.data.tokens - sum(rec.tokens for rec in done.values())
    check = check_output_space(p.spec.out, tokens=max(left, 0), n_layers=len(p.layer_ids),
                               hidden_size=p.info.hidden_size, dtype=p.resolved_spec.storage_dtype)
    if check.status is Status.FAILED:
        raise CannotRunHereError(f"the output location cannot hold this dataset: {check.detail}", hint=check.fix)
