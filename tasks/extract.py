"""The extraction tasks: extract one shard range, finalize (write the manifest). Each is the step
task (``tasks/step.py``) under its name; this module says what each call of it runs, and each
returns the extract step's own result (``ExtractResult``); the plan before them is ``tasks/plan.py``. ``RangeOutcome`` is a range's
result with what the orchestration adds: which range, and which worker's flow run did it.

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

from datagen.specs.plan import ExtractionPlan
from datagen.steps.extract import ExtractResult
from datagen.steps.extract import Spec as ExtractStepSpec
from datagen.steps.plan import PlanResult
from tasks.cache_keys import cache_key
from tasks.media import media_step_env
from tasks.mounts import extract_mounts, mounts_for
from tasks.runners import Mount
from tasks.pipeline_spec import ShardRange
from tasks.step import STEP_CACHE, StepCall, step_task


class RangeOutcome(BaseModel):
    """One shard range of a run: the range, the worker's flow run that did it (fan-out; None when
    this process did), and the extract step's result for it."""

    model_config = ConfigDict(frozen=True)

    range: ShardRange
    worker: str | None = Field(None, description="Flow run that extracted it (fan-out), if any.")
    result: ExtractResult | None = Field(
        description="`datagen extract --shards A:B` of the range; None when no step had to run (a fanned-out "
                    "range whose every shard was in the bucket already).")

    @property
    def shards_extracted(self) -> list[int]:
        return list(self.result.shards_extracted) if self.result is not None else []

    @property
    def shards_cached(self) -> list[int]:
        return list(self.result.shards_cached) if self.result is not None else list(self.range.shards)

    def served_from_cache(self) -> RangeOutcome:
        """The same range as a run that found it in the cache sees it: nothing extracted now."""
        if self.result is None:
            return self
        every = sorted({*self.result.shards_extracted, *self.result.shards_cached})
        return self.model_copy(update={"result": self.result.model_copy(
            update={"shards_extracted": [], "shards_cached": every, "tokens_extracted": 0, "tokens_per_s": 0.0})})

    def record(self) -> dict:
        """The range as the run's report lists it: the step's result with the range and its worker."""
        result = self.result.model_dump(mode="json") if self.result is not None else {}
        return {**result, "range": self.range.arg, "worker": self.worker,
                "shards_extracted": self.shards_extracted, "shards_cached": self.shards_cached}


extract_range = step_task("extract-range", cache_policy=STEP_CACHE, task_run_name="extract-range-{call.label}")
finalize = step_task("finalize", cache_policy=STEP_CACHE)


def range_call(plan: ExtractionPlan, shard_range: ShardRange, *, gpus: int = 0, progress: UUID | None = None,
               model: str | None = None, out: str | None = None) -> StepCall:
    """`datagen extract --plan --shards A:B` of the range: extract the range's missing shards (no manifest),
    advancing the range's item of the progress bar ``progress``. ``model`` and ``out``: this host's copy of
    the plan's model and where it writes (a fan-out child's; default the plan's). Its result: the step's
    ``ExtractResult``."""
    paths = {k: v for k, v in (("model", model), ("out", out)) if v is not None}
    call_spec = ExtractStepSpec(plan=plan, shards=(shard_range.first, shard_range.stop), **paths)
    here = plan.on_host(model=model, out=out)
    media = media_step_env(here.spec.dataset)
    return StepCall(
        step="extract",
        spec=_given(call_spec),
        mounts=_plan_mounts(here),
        env=range_env(media),
        secret_env_names=media.get("secret_env_names", ()),
        gpus=gpus,
        label=shard_range.arg,
        progress=progress,
    )


def range_env(media: dict) -> dict[str, str]:
    """The environment of a range's call: the dataset's media settings (``media_step_env``'s fields),
    and a progress line every 2 s (the range's item of the progress bar follows them)."""
    return {**media.get("env", {}), "DATAGEN_PROGRESS_INTERVAL": "2"}


def finalize_call(plan: ExtractionPlan, *, cuda: bool = False) -> StepCall:
    """`datagen extract --plan` without --shards after every range: checks every shard, writes the manifest
    last. Every shard is complete by now, so no engine starts. Its result: the step's
    ``ExtractResult``, with the manifest's sha256, totals and shards. ``cuda``: in the ranges' CUDA image
    (its host check compares that engine with the plan's), with no GPU reserved."""
    return StepCall(
        step="extract",
        spec=_given(ExtractStepSpec(plan=plan)),
        cuda_image=cuda,
        mounts=_plan_mounts(plan),
        known={"dataset": str(Path(plan.spec.out).absolute())},
        **media_step_env(plan.spec.dataset),
    )


def _given(spec: ExtractStepSpec) -> dict:
    """The step's spec file: the fields given (the plan's spec fields left out, as the step requires)."""
    return spec.model_dump(mode="json", include=spec.model_fields_set)


def _plan_mounts(plan: ExtractionPlan) -> tuple[Mount, ...]:
    """What a step of the plan reads and writes (``extract_mounts``), and the plan's stored rows where they
    are on this host outside its output (a fan-out range writing to its spool)."""
    kept = plan.stored_plan
    extra = mounts_for(read_only=(kept,)) if kept is not None and Path(kept).is_dir() else ()
    return (*extract_mounts(plan.spec), *extra)


def range_cache_key(planned: PlanResult, shard_range: ShardRange, *, identity: str, out: str) -> str:
    """The cache key of one range (see the module docstring)."""
    return cache_key("extract-range", planned.shard_keys[shard_range.first : shard_range.stop], identity, out)


def finalize_cache_key(planned: PlanResult, *, identity: str, out: str) -> str:
    """The cache key of the manifest: the dataset's fingerprint, the code, the output directory."""
    return cache_key("finalize", planned.fingerprint, identity, out)
