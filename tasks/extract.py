"""The extraction tasks: plan, extract one shard range, finalize (write the manifest).

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

import hashlib
import json
from pathlib import Path
from uuid import UUID

from prefect import get_run_logger, task
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict, Field

from datagen.data.contract import MANIFEST_NAME
from datagen.data.spec import ExtractSpec
from datagen.steps.plan import PlanResult
from tasks import artifacts
from tasks.pipeline_spec import Runner, ShardRange
from tasks._common import (
    STEP_RETRY_POLICY,
    cache_key, make_runner, mounts_for,
    parse_result, run_step, spec_file,
)
from tasks.runners import StepInvocation

RESULT_SERIALIZER = "json"
# Written by `datagen validate` into the dataset: {"ok": bool, "manifest_sha256": ...}.
VALIDATION_REPORT = ".datagen/validation.json"  # cache records stay readable and survive code moves


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


def _labels(task_name: str) -> dict[str, str]:
    run_id = flow_run.get_id()
    return {"task": task_name, **({"flow-run-id": str(run_id)} if run_id else {})}


def _extract_mounts(spec: ExtractSpec, spec_path: Path):
    out = Path(spec.out).absolute()
    # extract's lock file lives next to the output directory, so the parent is mounted; on a first
    # run it may not exist yet (a bind mount needs its source): its nearest existing ancestor then.
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return mounts_for(parent, read_only=(spec.model, spec.dataset, spec_path.parent))


def _key_from_parameter(context, parameters) -> str:
    return parameters["cache_key"]


# --- plan -------------------------------------------------------------------------------------

@task(
    name="plan",
    **STEP_RETRY_POLICY,
)
def plan(spec: ExtractSpec, *, runner: Runner) -> PlanResult:
    """`datagen plan`: fingerprints, shard keys, and what is on disk. Loads no weights; not cached
    (it is what notices that the dataset or the model changed)."""
    logger = get_run_logger()
    with spec_file(spec) as path:
        invocation = StepInvocation(
            step="plan", args=("--spec", str(path)), mounts=_extract_mounts(spec, path), labels=_labels("plan")
        )
        result = run_step(invocation, make_runner(runner), log=logger.info)
    planned = parse_result(result, PlanResult)
    out = Path(spec.out)
    planned = planned.model_copy(
        update={"manifest_fingerprint": _manifest_fingerprint(out), "validated_manifest_sha256": _validated(out)}
    )
    logger.info(
        "plan: %d rows, %d tokens, %d shards (%d already complete), fingerprint %s",
        planned.rows, planned.tokens, planned.num_shards, len(planned.shards_complete), planned.fingerprint[:12],
    )
    return planned


def _manifest_fingerprint(out: Path) -> str | None:
    try:
        return json.loads((out / MANIFEST_NAME).read_text()).get("fingerprint")
    except (OSError, ValueError):
        return None


def _validated(out: Path) -> str | None:
    try:
        report = json.loads((out / VALIDATION_REPORT).read_text())
    except (OSError, ValueError):
        return None
    return report.get("manifest_sha256") if isinstance(report, dict) and report.get("ok") is True else None


def range_cache_key(planned: PlanResult, shard_range: ShardRange, *, identity: str, out: str) -> str:
    """The cache key of one range (see the module docstring)."""
    return cache_key("extract-range", planned.shard_keys[shard_range.first : shard_range.stop], identity, out)


def finalize_cache_key(planned: PlanResult, *, identity: str, out: str) -> str:
    return cache_key("finalize", planned.fingerprint, identity, out)


# --- one shard range --------------------------------------------------------------------------

@task(
    name="extract-range",
    task_run_name="extract-range-{shard_range}",
    cache_key_fn=_key_from_parameter,
    persist_result=True,
    result_serializer=RESULT_SERIALIZER,
    **STEP_RETRY_POLICY,
)
def extract_range(
    spec: ExtractSpec,
    shard_range: ShardRange,
    *,
    cache_key: str,
    runner: Runner,
    gpus: int = 0,
    progress: UUID | None = None,
) -> RangeResult:
    """`datagen extract --shards A:B`: extract the range's missing shards (no manifest)."""
    logger = get_run_logger()
    board = artifacts.board(progress)
    watch = board.line_watcher(shard_range.arg) if board else None

    def log(line: str) -> None:
        logger.info("%s", line)
        if watch is not None:
            watch(line)

    with spec_file(spec) as path:
        invocation = StepInvocation(
            step="extract",
            args=("--spec", str(path), "--shards", shard_range.arg),
            mounts=_extract_mounts(spec, path),
            env={"DATAGEN_PROGRESS_INTERVAL": "2"},
            gpus=gpus,
            labels=_labels("extract-range"),
        )
        result = run_step(invocation, make_runner(runner, gpu=gpus > 0), log=log)
    done = parse_result({**result, "range": shard_range.arg}, RangeResult)
    if board is not None:
        board.set(shard_range.arg, 1.0, force=True)
    logger.info(
        "range %s: %d shards extracted, %d already complete, %d tokens in %.1f s",
        shard_range, len(done.shards_extracted), len(done.shards_cached), done.tokens, done.seconds,
    )
    return done


# --- finalize ---------------------------------------------------------------------------------

@task(
    name="finalize",
    cache_key_fn=_key_from_parameter,
    persist_result=True,
    result_serializer=RESULT_SERIALIZER,
    **STEP_RETRY_POLICY,
)
def finalize(spec: ExtractSpec, *, cache_key: str, runner: Runner) -> DatasetResult:
    """`datagen extract` without --shards after every range: checks every shard, writes the
    manifest last. Every shard is complete by now, so no engine starts."""
    logger = get_run_logger()
    with spec_file(spec) as path:
        invocation = StepInvocation(
            step="extract", args=("--spec", str(path)), mounts=_extract_mounts(spec, path),
            labels=_labels("finalize"),
        )
        result = run_step(invocation, make_runner(runner), log=logger.info)
    if result.get("shards_extracted"):
        logger.warning("finalize had to extract shards %s: a range did not complete them", result["shards_extracted"])
    out = Path(spec.out)
    raw = (out / MANIFEST_NAME).read_bytes()
    manifest = json.loads(raw)
    return DatasetResult(
        dataset=str(out.absolute()),
        fingerprint=manifest["fingerprint"],
        manifest_sha256=hashlib.sha256(raw).hexdigest(),
        layer_ids=result.get("layer_ids") or manifest["spec"].get("layer_ids", []),
        engine=result.get("engine") or {},
        totals=manifest["totals"],
        shards=[ShardRow.model_validate(s) for s in manifest["shards"]],
        shards_extracted=result.get("shards_extracted") or [],
    )
