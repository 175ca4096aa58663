"""The plan step: ``datagen plan``. Checks a spec and makes the plan every later step is given.

Everything ``datagen extract`` checks before loading a weight is checked here
(spec, model config, every dataset row), once: the result holds the plan
(``datagen.specs.plan.ExtractionPlan``: the resolved spec, its fingerprints, every
shard's boundaries and cache key), which ``--plan-file FILE`` also writes; the orchestrator keys
its cache on it and passes it whole to the ranges, finalize and assemble, without importing the engine. In an output where a run stored this spec's plan
(``datagen.extraction.stored``) the rows are not read again: they were checked
when it was stored; in an output this extraction has claimed, a plan computed
here is stored for the ranges that follow. It also says what the output already holds: the
manifest's fingerprint and the manifest a passing validation approved, so the
orchestrator never reads the step's files itself.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel, ConfigDict, Field, computed_field

from datagen.data.contract import ResolvedSpec, ShardRecord, manifest_fingerprint, validated_manifest_sha256
from datagen.extraction import stored
from datagen.extraction.output import claimed_by, completed_shards
from datagen.extraction.plan import Plan, describe_shards
from datagen.specs.plan import ExtractionPlan, write_plan_file
from datagen.steps.extract import ExtractionSpec

HELP = "Check a spec and print its fingerprints and each shard's cache key (loads no weights)."
log = logging.getLogger(__name__)


class Spec(ExtractionSpec):
    """``datagen plan``'s input: the extraction spec, and where to write the plan file."""

    plan_file: str | None = Field(
        None, description="write the plan (datagen.specs.plan.ExtractionPlan, JSON) to this file: what "
        "`datagen extract --plan FILE` and `datagen assemble --plan FILE` read (the result line holds it too)")


class PlanResult(BaseModel):
    """What `datagen plan` made of a spec (the plan, whole), and what is already in its output."""

    model_config = ConfigDict(frozen=True)

    plan: ExtractionPlan = Field(description="The plan: the spec resolved, its fingerprints, shard cut and keys; "
                                 "what every later step of the extraction is given.")
    rows: int = Field(description="Dataset rows.")
    tokens: int = Field(description="Tokens the dataset will hold.")
    shards_complete: list[int] = Field(description="Shards already written for this spec.")
    manifest_fingerprint: str | None = Field(None, description="Fingerprint in the output's manifest.json, if any.")
    validated_manifest_sha256: str | None = Field(
        None, description="sha256 of the manifest that the output's validation report approves.")

    # What the plan says, on the result line too (a reader of the line finds it as before).
    @computed_field(description="sha256 of the full spec: the dataset's identity.")
    @property
    def fingerprint(self) -> str:
        return self.plan.fingerprint

    @computed_field(description="The spec without the dataset.")
    @property
    def extraction_fingerprint(self) -> str:
        return self.plan.extraction_fingerprint

    @computed_field(description="Shards of the dataset.")
    @property
    def num_shards(self) -> int:
        return self.plan.num_shards

    @computed_field(description="Captured layers (vLLM numbering).")
    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.plan.layer_ids

    @computed_field(description="Cache key of each shard, by index.")
    @property
    def shard_keys(self) -> tuple[str, ...]:
        return self.plan.shard_keys

    @computed_field(description="Bytes of stored states per shard: min, median and max over the plan's shards.")
    @property
    def shard_state_bytes(self) -> dict[str, int]:
        return self.plan.shard_weights

    @computed_field(description="Shards the engine streams without a drain between them.")
    @property
    def shard_group(self) -> int:
        return self.plan.shard_group

    @computed_field(description="The resolved spec, as the manifest will record it.")
    @property
    def spec(self) -> ResolvedSpec:
        return self.plan.resolved

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
    p, from_store = stored.plan_shards(spec, (0, 0))
    claimed = claimed_by(p)
    if claimed and not from_store:  # an output of ours: keep the plan for the ranges that follow
        stored.store_plan(p)
    done = completed_shards(p) if claimed else {}
    _check_output_space(p, done)
    log.info("plan: %s", describe_shards(p))
    if spec.plan_file is not None:
        write_plan_file(p.record, spec.plan_file)
        log.info("plan: written to %s", spec.plan_file)
    return PlanResult(
        plan=p.record,
        rows=p.data.rows,
        tokens=p.data.tokens,
        shards_complete=sorted(done),
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
