"""The extraction tasks: plan, extract one shard range, finalize (write the manifest). Each is the
step task (``tasks/step.py``) under its name; this module says what each call of it runs.

Caching. A range's cache key is built from the cache keys of its shards (each: the extraction
fingerprint -- model + resolved revision + layer ids + preprocessing + engine and its version --
plus the hash of that shard's input rows, from `datagen plan`), the code that runs the step (the
image tag, or a hash of the datagen package) and the output directory. Never the run id: a second
run of the same spec finds every range in the cache and starts no engine; appending rows changes
only the keys of the shards whose rows changed. The flow passes the key it computed
(``range_cache_key``) as the task's ``cache_key`` parameter, and asks for a refresh when `datagen
plan` reports a range's shards missing from disk, so a deleted dataset is never "cached".
"""

from __future__ import annotations

from pathlib import Path
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

from datagen.data.spec import ExtractSpec
from datagen.steps.plan import PlanResult
from tasks._common import cache_key, mounts_for
from tasks.pipeline_spec import ShardRange
from tasks.runners import Mount
from tasks.step import STEP_CACHE, StepCall, step_task


class RangeResult(BaseModel):
    """What one shard range's extraction did."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    range: str = Field(description="Shards A:B.")
    fingerprint: str = Field("", description="Fingerprint of the dataset the shards belong to.")
    shards_extracted: list[int] = Field(description="Shards the engine computed in this task run.")
    shards_cached: list[int] = Field(description="Shards of the range that were already complete.")
    tokens: int = Field(description="Tokens in the range's shards.")
    tokens_extracted: int = Field(0, description="Tokens computed in this task run.")
    seconds: float = Field(description="Wall time of the step.")
    tokens_per_s: float = Field(0.0, description="Extraction throughput of the step.")
    engine: dict = Field(default_factory=dict, description="Engine name, version and patches.")
    worker: str | None = Field(None, description="Flow run that extracted it (fan-out), if any.")

    def served_from_cache(self) -> "RangeResult":
        """The same range as a run that found it in the cache sees it: nothing extracted now."""
        every = sorted({*self.shards_extracted, *self.shards_cached})
        return self.model_copy(
            update={"shards_extracted": [], "shards_cached": every, "tokens_extracted": 0, "tokens_per_s": 0.0}
        )


class ShardRow(BaseModel):
    """One shard as the manifest lists it (without its statistics)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    index: int
    path: str
    first_sample: int
    rows: int
    samples: int
    tokens: int
    bytes: int
    sha256: str


class DatasetResult(BaseModel):
    """A complete dataset: its manifest's identity, totals and shards."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    dataset: str = Field(description="Dataset directory (absolute).")
    fingerprint: str = Field(description="The manifest's fingerprint.")
    manifest_sha256: str = Field(description="sha256 of manifest.json: the cache key of validation.")
    layer_ids: list[int]
    engine: dict = Field(default_factory=dict)
    totals: dict = Field(description="rows, samples, tokens, bytes, shards, skipped, truncated.")
    shards: list[ShardRow]
    shards_extracted: list[int] = Field(
        default_factory=list, description="Shards the finalize step had to extract (normally none)."
    )


plan = step_task("plan")  # not cached: it is what notices that the dataset or the model changed
extract_range = step_task("extract-range", cache_policy=STEP_CACHE, task_run_name="extract-range-{call.label}")
finalize = step_task("finalize", cache_policy=STEP_CACHE)


def _mounts(spec: ExtractSpec) -> tuple[Mount, ...]:
    out = Path(spec.out).absolute()
    # extract's lock file lives next to the output directory, so the parent is mounted; on a first
    # run it may not exist yet (a bind mount needs its source): its nearest existing ancestor then.
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return mounts_for(parent, read_only=(spec.model, spec.dataset))


def plan_call(spec: ExtractSpec) -> StepCall:
    """`datagen plan`: fingerprints, shard keys, and what is on disk (the manifest, its validation).
    Loads no weights."""
    return StepCall(step="plan", result=PlanResult, spec=spec.model_dump(mode="json"), mounts=_mounts(spec))


def range_call(spec: ExtractSpec, shard_range: ShardRange, *, gpus: int = 0, progress: UUID | None = None) -> StepCall:
    """`datagen extract --shards A:B`: extract the range's missing shards (no manifest), advancing the
    range's item of the progress bar ``progress``."""
    return StepCall(
        step="extract",
        result=RangeResult,
        spec=spec.model_dump(mode="json"),
        args=("--shards", shard_range.arg),
        mounts=_mounts(spec),
        env={"DATAGEN_PROGRESS_INTERVAL": "2"},
        gpus=gpus,
        known={"range": shard_range.arg},
        label=shard_range.arg,
        progress=progress,
    )


def finalize_call(spec: ExtractSpec) -> StepCall:
    """`datagen extract` without --shards after every range: checks every shard, writes the manifest
    last. Every shard is complete by now, so no engine starts."""
    return StepCall(
        step="extract",
        result=DatasetResult,
        spec=spec.model_dump(mode="json"),
        mounts=_mounts(spec),
        known={"dataset": str(Path(spec.out).absolute())},
    )


def range_cache_key(planned: PlanResult, shard_range: ShardRange, *, identity: str, out: str) -> str:
    """The cache key of one range (see the module docstring)."""
    return cache_key("extract-range", planned.shard_keys[shard_range.first : shard_range.stop], identity, out)


def finalize_cache_key(planned: PlanResult, *, identity: str, out: str) -> str:
    """The cache key of the manifest: the dataset's fingerprint, the code, the output directory."""
    return cache_key("finalize", planned.fingerprint, identity, out)
