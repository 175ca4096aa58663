"""The export step: ``datagen export --format speculators DATASET OUT``.

The work is ``datagen.export.speculators.export`` (the layout written, the checks, atomic output: its
module docstring); this module is its command line and result.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from datagen.export.speculators import ExportFormat, export
from datagen.steps._args import Arg, StepSpec

HELP = "Export a validated dataset for training (--format speculators: HF datasets Arrow + per-sample safetensors)."


class Spec(StepSpec):
    """``datagen export``'s input: the layout, the dataset and where to."""

    SPEC_FILE: ClassVar[bool] = True

    fmt: Annotated[ExportFormat, Arg(flag="--format")] = Field(description="training-side layout to write")
    dataset: Annotated[str, Arg(positional=True)] = Field(description="dataset directory (holds manifest.json)")
    out: Annotated[str, Arg(positional=True)] = Field(
        description="output directory (must not exist; written atomically)")
    workers: int | None = Field(None, description="shards exported in parallel (default: CPUs, at most 8)")


class ExportResult(BaseModel):
    """What `datagen export` wrote: the export's record (``datagen_export.json``, less its rows),
    where it is, and whether it was there already."""

    model_config = ConfigDict(extra="allow", frozen=True)

    out: str = Field(description="The export directory (absolute).")
    cached: bool = Field(description="True when an export of this dataset was already there.")
    format: str = Field(description="The layout written.")
    fingerprint: str = Field(description="The dataset's fingerprint.")
    manifest_sha256: str = Field(description="sha256 of the exported dataset's manifest.json.")
    validated: bool = Field(description="Whether a passing validation approved that manifest.")


Result = ExportResult


def run(spec: Spec) -> ExportResult:
    """``datagen export --format F DATASET OUT`` (``datagen.export.speculators.export``)."""
    return ExportResult.model_validate(export(spec.dataset, spec.out, fmt=spec.fmt, workers=spec.workers))
