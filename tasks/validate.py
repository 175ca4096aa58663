"""The validate task: `datagen validate DATASET` -- the dataset against the data contract. The step
task (``tasks/step.py``) under the name ``validate``.

Cached on the manifest's bytes (they name every shard's sha256), the dataset's fingerprint and the
step's code, so a nightly run with nothing changed does not re-read terabytes; the flow refreshes
the cache when `datagen plan` reports that the dataset's validation no longer approves this
manifest. Problems are permanent (exit 4): the task fails at once with the step's list of
problems, which also becomes the run's `validation-problems` artifact. The task passes the step its
spec whole (``datagen.steps.validate.Spec``: the pipeline's ``ValidationSettings`` and where to
read and write); its result is the step's own, ``ValidateResult``. ``validation_summary`` is its
line in the run summary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect.artifacts import create_markdown_artifact

from datagen.steps.validate import Spec as ValidateSpec
from datagen.steps.validate import ValidateResult
from datagen.validation.settings import ValidationSettings
from tasks.cache_keys import cache_key
from tasks.errors import StepFailed
from tasks.media import media_sources, media_step_env
from tasks.mounts import dataset_path, mounts_for
from tasks.pipeline_spec import Runner
from tasks.step import STEP_CACHE, StepCall, step_task
from tasks.step_files import scratch_dir

STEP = "validate"
REPORT_NAME = "validation-report.json"


def validation_summary(result: ValidateResult) -> str:
    """One line for the run summary: what the validate step found."""
    if result.problems:
        return f"{len(result.problems)} problems"
    reference = (result.golden or {}).get("reference") or {}
    golden = (f"; golden: {reference['kind']} reference, {reference.get('tokens', 0)} tokens in "
              f"{reference.get('seconds', 0):.1f} s + {reference.get('start_seconds', 0):.1f} s start"
              ) if reference else ""
    return f"passed ({result.shards if result.shards is not None else '?'} shards checked{golden})"


def validate_cache_key(
    *, fingerprint: str, manifest_sha256: str, identity: str, settings: ValidationSettings
) -> str:
    return cache_key("validate", fingerprint, manifest_sha256, identity, settings.model_dump(mode="json"))


validate = step_task(STEP, cache_policy=STEP_CACHE)


def validate_call(dataset: str, *, settings: ValidationSettings, report: Path, model: str, source: str,
                  tokenizer: str | None = None, trust_remote_code: bool = False, gpus: int = 0) -> StepCall:
    """`datagen validate DATASET` writing its report to ``report`` (in a folder of its own, mounted
    read-write). ``source`` is passed whole (``#options`` and all); its path is mounted."""
    step_spec = ValidateSpec(**settings.model_dump(mode="json"), dataset=dataset, report=str(report), model=model,
                             source=source, tokenizer=tokenizer, trust_remote_code=trust_remote_code)
    return StepCall(
        step=STEP,
        spec=step_spec.model_dump(mode="json"),
        mounts=mounts_for(dataset, report.parent,
                          read_only=(model, dataset_path(source), *filter(None, [tokenizer, settings.previous]),
                                     *media_sources(source).dirs)),
        gpus=gpus,
        **media_step_env(source),  # golden image rows are re-extracted with their images
    )


def validate_dataset(
    dataset: str,
    *,
    cache_key: str,
    runner: Runner,
    settings: ValidationSettings,
    model: str,
    source: str,
    tokenizer: str | None = None,
    trust_remote_code: bool = False,
    gpus: int = 0,
    task_options: dict[str, Any] | None = None,
) -> ValidateResult:
    """`datagen validate DATASET --report FILE`: every shard, every row, against the manifest.

    ``model`` (directory), ``source`` (the dataset the extraction read, as its spec names it) and
    ``tokenizer`` (the directory the extraction spec named instead of the model's, if any) are read
    by the step: it re-tokenizes rows and re-extracts golden samples from them, with the model's own code only
    when the pipeline spec allows it (``trust_remote_code``; Kimi's tokenizer is code). The step
    runs in the extract image with the spec's GPUs: where transformers cannot load the model, the
    golden reference is the engine itself (vLLM eager with layer hooks), on the host that holds it.
    ``task_options``: options of this run of the task (``refresh_cache``, ``result_storage``).
    Returns the step's report.
    """
    with scratch_dir() as scratch:
        report = scratch / REPORT_NAME
        call = validate_call(dataset, settings=settings, report=report, model=model, source=source,
                             tokenizer=tokenizer, trust_remote_code=trust_remote_code, gpus=gpus)
        try:
            result = validate.with_options(**(task_options or {}))(call, cache_key=cache_key, runner=runner)
        except StepFailed as e:
            _problems_artifact(report, e)
            raise
    return result


def _problems_artifact(report: Path, error: StepFailed) -> None:
    try:
        problems = json.loads(report.read_text()).get("problems", [])
    except (OSError, ValueError):
        problems = []
    lines = ["# Validation failed", "", "```", str(error), "```", ""]
    lines += [f"- **{p.get('kind')}** {p.get('message')}" for p in problems[:200]]
    create_markdown_artifact("\n".join(lines), key="validation-problems", description="Why validation failed.")
