"""The validate task: `datagen validate DATASET` -- the dataset against the data contract.

Cached on the manifest's bytes (they name every shard's sha256), the dataset's fingerprint and the
step's code, so a nightly run with nothing changed does not re-read terabytes; the flow refreshes
the cache when the dataset's `.datagen/validation.json` no longer approves this manifest. Problems
are permanent (exit 4): the task fails at once with the step's list of problems. When this
version has no validate step, the task logs that and passes.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, ConfigDict, Field

from tasks.pipeline_spec import ValidationSettings
from tasks.pipeline_spec import Runner
from tasks._common import (
    STEP_RETRY_POLICY,
    StepFailed, cache_key, make_runner, mounts_for,
    run_step, scratch_dir, step_available,
)
from tasks.runners import StepInvocation

STEP = "validate"
REPORT_NAME = "validation-report.json"


class ValidationOutcome(BaseModel):
    """The verdict on one dataset."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    ran: bool = Field(description="False when this version has no validate step.")
    ok: bool = Field(True, description="No problems.")
    manifest_sha256: str | None = Field(None, description="The manifest that was validated.")
    summary: str = Field("", description="One line for the run summary.")
    golden_reference: str | None = Field(
        None, description="The engine that re-extracted golden rows (transformers, engine), None when none ran."
    )


def validate_cache_key(
    *, fingerprint: str, manifest_sha256: str, identity: str, settings: ValidationSettings
) -> str:
    return cache_key("validate", fingerprint, manifest_sha256, identity, settings.model_dump(mode="json"))


def _key_from_parameter(context, parameters) -> str:
    return parameters["cache_key"]


@task(
    name=STEP,
    cache_key_fn=_key_from_parameter,
    persist_result=True,
    result_serializer="json",
    **STEP_RETRY_POLICY,
)
def validate(
    dataset: str,
    *,
    manifest_sha256: str,
    cache_key: str,
    runner: Runner,
    settings: ValidationSettings,
    model: str,
    source: str,
    trust_remote_code: bool = False,
    gpus: int = 0,
) -> ValidationOutcome:
    """`datagen validate DATASET --report FILE`: every shard, every row, against the manifest.

    ``model`` (directory) and ``source`` (the dataset's JSONL) are read by the step: it
    re-tokenizes rows and re-extracts golden samples from them, with the model's own code only
    when the pipeline spec allows it (``trust_remote_code``; Kimi's tokenizer is code). The step
    runs in the extract image with the spec's GPUs: where transformers cannot load the model, the
    golden reference is the engine itself (vLLM eager with layer hooks), on the host that holds it.
    """
    logger = get_run_logger()
    if not step_available(STEP):
        logger.info("validate: this version has no `datagen validate` step; skipped")
        return ValidationOutcome(ran=False, summary="not run (no validate step in this version)")
    with scratch_dir() as scratch:
        report = scratch / REPORT_NAME
        invocation = StepInvocation(
            step=STEP,
            args=(dataset, "--report", str(report), "--model", model, "--source", source, *settings.args(),
                  *(["--trust-remote-code"] if trust_remote_code else [])),
            mounts=mounts_for(dataset, scratch, read_only=(model, source, *filter(None, [settings.previous]))),
            gpus=gpus,
            labels={"task": STEP},
        )
        try:
            result = run_step(invocation, make_runner(runner, gpu=gpus > 0), log=logger.info)
        except StepFailed as e:
            _problems_artifact(report, e)
            raise
    problems = result.get("problems") or []
    reference = (result.get("golden") or {}).get("reference") or {}
    golden = (f"; golden: {reference['kind']} reference, {reference.get('tokens', 0)} tokens in "
              f"{reference.get('seconds', 0):.1f} s + {reference.get('start_seconds', 0):.1f} s start") if reference else ""
    return ValidationOutcome(
        ran=True,
        ok=not problems,
        manifest_sha256=result.get("manifest_sha256", manifest_sha256),
        golden_reference=reference.get("kind"),
        summary=(f"passed ({result.get('shards', '?')} shards checked{golden})" if not problems
                 else f"{len(problems)} problems"),
    )


def _problems_artifact(report: Path, error: StepFailed) -> None:
    try:
        problems = json.loads(report.read_text()).get("problems", [])
    except (OSError, ValueError):
        problems = []
    lines = ["# Validation failed", "", "```", str(error), "```", ""]
    lines += [f"- **{p.get('kind')}** {p.get('message')}" for p in problems[:200]]
    create_markdown_artifact("\n".join(lines), key="validation-problems", description="Why validation failed.")
