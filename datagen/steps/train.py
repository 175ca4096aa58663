"""The train step: ``datagen train DATASET --out DRAFT --model MODEL``.

Trains an EAGLE-3 draft on the dataset's training split with speculators' own recipe and trainer,
straight from the packed shards (``datagen.training.draft``): every option of speculators' training
script that applies is an option here, named as speculators names it (``--optimizer adamw
--no-norm-before-fc``), and what is not given is speculators' default (``datagen.training.recipe``), and writes it in speculators' format, which
vLLM loads as an EAGLE-3 speculator, with ``datagen_draft.json`` (the lineage: dataset fingerprint,
steps, settings, losses). ``--steps 0`` writes the untrained draft (the baseline a trained one must
beat). The draft directory must not exist; it is written under a temporary name and renamed.

Launched by ``torchrun --nproc-per-node N -m datagen train ...`` it trains the one draft on N
data-parallel processes (one GPU each with ``--device cuda``; gloo processes with ``--device cpu``):
rank 0 writes it, every rank prints the same result (``datagen.training.distributed``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from datagen.data.contract import MANIFEST_NAME, Approval, approval_of
from datagen.errors import ValidationFailed
from datagen.steps._args import Arg, StepSpec
from datagen.training.settings import DraftSettings

log = logging.getLogger(__name__)
HELP = "Train an EAGLE-3 draft on a dataset with speculators' trainer (the packed shards, no export)."


class Spec(StepSpec, DraftSettings):
    """``datagen train``'s command line: where, from what, and the draft's settings (``DraftSettings``)."""

    SPEC_FILE: ClassVar[bool] = True

    dataset: Annotated[str, Arg(positional=True)] = Field(description="the dataset (a directory or s3://bucket/prefix)")
    out: str = Field(description="the draft directory to write (must not exist)")
    model: str | None = Field(None, description="the target model directory the dataset was extracted from "
                                                "(default: the one its manifest names)")
    steps: int = Field(default=60, ge=0, description="optimizer steps; 0 writes the untrained draft (the baseline)")

    def settings(self) -> DraftSettings:
        return DraftSettings(**self.model_dump(include=set(DraftSettings.model_fields)) | {"steps": max(1, self.steps)})


class TrainResult(BaseModel):
    """What `datagen train` wrote."""

    model_config = ConfigDict(frozen=True)

    draft: str = Field(description="the draft directory (speculators' format, vLLM's EAGLE-3 speculator)")
    dataset_fingerprint: str = Field(description="the dataset it was trained on")
    steps_done: int = Field(description="optimizer steps run (0: untrained)")
    train_samples: int = Field(description="samples trained on")
    held_out_samples: int = Field(description="samples held out for measuring")
    first_loss: float | None = Field(description="training loss at the first step (None: untrained)")
    last_loss: float | None = Field(description="training loss at the last step (None: untrained)")
    speculators_version: str = Field(description="the speculators release that trained it")
    settings: DraftSettings = Field(
        description="the recipe, resolved: every speculators option as that release resolved it for this run, "
                    "and datagen's own settings")
    given: list[str] = Field(description="the speculators options set by the caller (the rest: its defaults)")
    world_size: int = Field(default=1, description="data-parallel processes that trained it (torchrun ranks)")


Result = TrainResult


def check_approval(dataset: str) -> None:
    """A local dataset whose validation approved another manifest is refused before training:
    the manifest changed since, and must be validated again. (A dataset on S3 was published, and
    publish uploads only the manifest validation approved; one never validated trains with a
    warning, as export exports it.)

    Raises:
        ValidationFailed: a passing validation approved other manifest bytes.
    """
    if dataset.startswith("s3://"):
        return
    try:
        raw = (Path(dataset) / MANIFEST_NAME).read_bytes()
    except OSError:
        return  # the reader says what is missing, with its own hint
    approval = approval_of(dataset, raw)
    if approval is Approval.STALE:
        raise ValidationFailed(f"{dataset}/{MANIFEST_NAME} changed after it was validated",
                               hint=f"run `datagen validate {dataset}` again; only the manifest it approves is trained on")
    if approval is Approval.NONE:
        log.warning("dataset %s has no passing validation for this manifest: run `datagen validate` first", dataset)


def run(spec: Spec) -> TrainResult:
    """``datagen train`` (``train_draft``, or ``untrained_draft`` for ``--steps 0``)."""
    from datagen.training.draft import model_of, train_draft, untrained_draft

    check_approval(spec.dataset)
    make = train_draft if spec.steps > 0 else untrained_draft
    d = make(spec.dataset, spec.out, verifier=spec.model or model_of(spec.dataset), settings=spec.settings())
    lin = d.lineage
    return TrainResult(draft=str(d.path.resolve()), dataset_fingerprint=lin.dataset_fingerprint,
                       steps_done=lin.steps_done, train_samples=lin.train_samples,
                       held_out_samples=lin.held_out_samples, first_loss=lin.losses[0] if lin.losses else None,
                       last_loss=lin.losses[-1] if lin.losses else None, speculators_version=lin.speculators_version,
                       settings=lin.settings, given=lin.given, world_size=lin.world_size)
