"""The validation step: ``datagen validate DATASET``.

The work is ``datagen.validation.dataset.validate`` (the checks, in order, and the report it writes:
its module docstring); this module is its command line and result.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from datagen.data.contract import validation_path
from datagen.data.files import atomic_write_json
from datagen.errors import ValidationFailed
from datagen.steps._args import Arg, StepSpec
from datagen.validation.settings import ValidationSettings

HELP = "Validate a dataset (structure, checksums, tokens, numerics, golden samples); write a JSON report."
log = logging.getLogger(__name__)


# --- command line -----------------------------------------------------------------------------

class Spec(ValidationSettings, StepSpec):
    """``datagen validate``'s input: the dataset, the validation settings (``ValidationSettings``, the
    part a pipeline spec embeds), and where this run reads and writes."""

    SPEC_FILE: ClassVar[bool] = True
    OPTIONS: ClassVar[dict[str, Arg]] = {"golden_samples": Arg(flag="--golden", metavar="N")}

    dataset: Annotated[str, Arg(positional=True)] = Field(description="dataset directory (holds manifest.json)")
    seed: int | None = Field(None, description="seed of the golden rows' draw (default: random, reported)")
    trust_remote_code: bool = Field(
        False, description="allow the model's own code (tokenizer, engine reference), as the extraction spec did")
    report: str | None = Field(None, description="also write the JSON report here (written whether or not it passes)")
    workers: int | None = Field(None, ge=1, description="shards scanned in parallel (default: CPUs, at most 8)")
    model: str | None = Field(None, description="source model directory, if not where the manifest says")
    source: str | None = Field(
        None, description="source dataset (a file or a folder, PATH#options as extracted), if not where the manifest says")
    tokenizer: str | None = Field(
        None, description="tokenizer directory the extraction's spec named instead of the model's (its `tokenizer`)")

    def settings(self) -> ValidationSettings:
        """The validation settings alone."""
        return ValidationSettings.model_validate(self.model_dump(include=set(ValidationSettings.model_fields)))


class ValidateResult(BaseModel):
    """The validation report (also ``<dataset>/.datagen/validation.json`` when it passes): the fields
    below, and what each check adds (shards, golden, drift)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    ok: bool = Field(description="True when no problem was found.")
    dataset: str = Field(description="The dataset directory (absolute).")
    manifest_sha256: str | None = Field(description="sha256 of the manifest validated; None when unreadable.")
    validated_at: str = Field(description="When (UTC, ISO 8601).")
    seconds: float = Field(description="Wall time of the step.")
    checks: dict = Field(description="check name -> its outcome (ok, failed, not run) and problem count.")
    problem_counts: dict[str, int] = Field(description="problem kind -> how many.")
    problems: list[dict] = Field(description="Each problem: kind, message, and shard/row/layer where known.")
    shards: int | None = Field(None, description="Shards the manifest lists (None: no readable manifest).")
    golden: dict | None = Field(
        None, description="The golden check: seed, rows, tolerance, its reference (kind, tokens, seconds, "
                          "start_seconds) and each row's verdict; None when it did not run.")


Result = ValidateResult


def run(args: Spec) -> ValidateResult:
    """``datagen validate DATASET``: the report (``datagen.validation.dataset.validate``); also to ``--report``; an error when
    the dataset fails."""
    from datagen.validation.dataset import validate  # torch: imported where a run validates

    report = validate(args.dataset, args.settings(), seed=args.seed, workers=args.workers, model=args.model,
                      source_rows=args.source, tokenizer=args.tokenizer, trust_remote_code=args.trust_remote_code)
    if args.report:
        atomic_write_json(Path(args.report), report)
    if not report["ok"]:
        problems = report["problems"]
        counts = ", ".join(f"{k} x{v}" for k, v in sorted(report["problem_counts"].items()))
        shown = "\n    ".join(_line(p) for p in problems[:10])
        more = f"\n    ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise ValidationFailed(
            f"dataset {args.dataset} failed validation: {len(problems)} problems ({counts})\n    {shown}{more}",
            problems=problems,
            hint=f"the report{' ' + args.report if args.report else ' (pass --report FILE)'} lists each with its shard "
                 "and row; re-extract the shards named (datagen extract resumes) and validate again",
        )
    log.info("dataset %s passed validation (%s)", args.dataset, validation_path(args.dataset))
    return ValidateResult.model_validate(report)


def _line(p: dict) -> str:
    where = ", ".join(f"{k} {p[k]}" for k in ("shard", "row", "layer_id") if k in p)
    return f"[{p['kind']}] {where + ': ' if where else ''}{p['message']}"
