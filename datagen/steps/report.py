"""The report step: ``datagen report DATASET [--previous P ...] [--out FILE.png]``.

One picture of a night's data next to the nights before it: per captured layer, the mean, the
standard deviation and the largest absolute value of the hidden states, and the tokens of each
run, a layer that drifted marked in red. The work is ``datagen.validation.layer_report``
(``make_report``); this module wires the command line to it. The Prefect flow attaches the same
plot to each run (``tasks/report.py``).

Datasets are directories or ``s3://`` prefixes; only their ``manifest.json`` is read.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from datagen.steps._args import Arg, StepSpec
from datagen.validation.drift import DEFAULT_THRESHOLD
from datagen.validation.layer_report import make_report, read_history

HELP = "Plot per-layer statistics and tokens of a dataset next to previous runs, drift marked."


class Spec(StepSpec):
    """``datagen report``'s input."""

    SPEC_FILE: ClassVar[bool] = True

    dataset: Annotated[str, Arg(positional=True)] = Field(
        description="the dataset to report on (a directory or s3://bucket/prefix)")
    previous: Annotated[list[str], Arg(metavar="DATASET")] = Field(
        default_factory=list,
        description="earlier runs' datasets, oldest first; drift is measured against the last one")
    out: str = Field("report.png", description="where the plot goes (PNG; default report.png)")
    threshold: float = Field(DEFAULT_THRESHOLD, description=f"drift threshold (default {DEFAULT_THRESHOLD}, as validation)")
    history: str | None = Field(
        None, description="JSON file of earlier runs' per-layer rows, oldest first (the flow's record of its "
                          "deployment's runs), drawn before --previous")
    title: str = Field("", description="title of the plot")


class ReportResult(BaseModel):
    """What `datagen report` drew."""

    model_config = ConfigDict(frozen=True)

    plot: str = Field(description="The plot (PNG, absolute path).")
    runs: int = Field(description="Runs drawn: the dataset and the previous ones.")
    threshold: float = Field(description="The drift threshold used.")
    drifted_layers: list[int] = Field(description="Layers whose statistics moved beyond the threshold.")
    layers: dict[str, dict[str, float]] = Field(
        description="layer id -> mean_shift_in_std and std_ratio against the last previous run.")
    table: str = Field(description="The markdown table of this run's layers, drift marked.")
    rows: list[dict] = Field(description="This run's per-layer rows (what a later run's --history holds).")


Result = ReportResult


def run(spec: Spec) -> ReportResult:
    """``datagen report DATASET [--previous ...]`` (``datagen.validation.layer_report.make_report``)."""
    history = read_history(spec.history) if spec.history else None
    return ReportResult.model_validate(make_report(spec.dataset, previous=spec.previous, out=spec.out,
                                                   threshold=spec.threshold, history=history, title=spec.title))
