"""The measure-draft step: ``datagen measure-draft DRAFT DATASET``.

Measures a draft on the dataset's held-out rows (the split of the draft's lineage, fixed by its
``train_ratio``): per-position top-1 agreement with the target's greedy next tokens, positions
1..k, and the acceptance length it implies (``datagen.training.agreement``). The draft is fed the
target's own states of those rows at the layers its config names (``--features target``, the
default: what vLLM feeds it in production), so a dataset of mislabelled layers shows up as a bad
draft, and the dataset's stored states are compared with the target's layer by layer
(``feature_error``); ``--features dataset`` feeds the stored states instead. With
``--acceptance vllm`` also the acceptance length of real speculative decoding, vLLM generating
from the held-out prompts with the draft as its EAGLE-3 speculator (``datagen.training.spec_decode``).
The report is the result and, with ``--out``, a JSON file.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from datagen.data.files import atomic_write_json
from datagen.steps._args import Arg, StepSpec
from datagen.training.agreement import AgreementReport, FeatureError, Features, PositionAgreement
from datagen.training.settings import Device
from datagen.training.spec_decode import SpecDecodeResult

HELP = "Measure a draft on a dataset's held-out rows: per-position agreement, acceptance length (vLLM EAGLE-3)."


class Acceptance(str, enum.Enum):
    """Where the acceptance length comes from."""

    AGREEMENT = "agreement"  # implied by the per-position agreement only (no engine started)
    VLLM = "vllm"  # also vLLM's speculative decoding with the draft as EAGLE-3 speculator


class Spec(StepSpec):
    """``datagen measure-draft``'s command line."""

    SPEC_FILE: ClassVar[bool] = True

    draft: Annotated[str, Arg(positional=True)] = Field(description="the draft directory (`datagen train`)")
    dataset: Annotated[str, Arg(positional=True)] = Field(
        description="the dataset whose held-out rows it is measured on (the one it was trained on, or another "
                    "extraction of the same rows)")
    model: str | None = Field(None, description="the target model directory (default: the draft's lineage)")
    features: Features = Field(
        Features.TARGET, description="target (the target's own states at the draft's layers) or dataset (the stored ones)")
    acceptance: Acceptance = Field(Acceptance.AGREEMENT, description="agreement, or vllm (also real speculative decoding)")
    prompts: int = Field(16, ge=1, description="held-out prompts vLLM generates from (--acceptance vllm)")
    max_tokens: int = Field(48, ge=1, description="tokens vLLM generates per prompt (--acceptance vllm)")
    device: Device | None = Field(
        None, description="where the draft and the target's states are computed (default: where the draft trained, "
                          "its lineage's device)")
    out: str | None = Field(None, description="also write the result here (JSON)")


class MeasureResult(BaseModel):
    """What `datagen measure-draft` measured."""

    model_config = ConfigDict(frozen=True)

    draft: str = Field(description="the draft directory")
    dataset: str = Field(description="the dataset measured on")
    dataset_fingerprint: str = Field(description="its manifest fingerprint")
    trained_on: str = Field(description="fingerprint of the dataset the draft was trained on")
    steps_done: int = Field(description="the draft's training steps")
    held_out_samples: int = Field(description="samples measured")
    positions: list[PositionAgreement] = Field(description="agreement at positions 1..k")
    acceptance_length: float = Field(description="acceptance length implied by the agreement (tokens per step)")
    features: Features = Field(Features.TARGET, description="whose states the draft was fed")
    feature_error: list[FeatureError] = Field(
        default_factory=list, description="per layer: the dataset's stored states against the target's own")
    spec_decode: SpecDecodeResult | None = Field(description="vLLM's EAGLE-3 counters (None: --acceptance agreement)")


Result = MeasureResult


def measure(spec: Spec) -> MeasureResult:
    from datagen.training.agreement import measure_agreement
    from datagen.training.draft import read_lineage

    lineage = read_lineage(spec.draft)
    device = (spec.device or lineage.settings.device).value
    report: AgreementReport = measure_agreement(spec.draft, spec.dataset, verifier=spec.model,
                                                features=spec.features, device=device)
    decoded = None
    if spec.acceptance is Acceptance.VLLM:
        from datagen.training.spec_decode import held_out_prompts, measure_spec_decode

        prompts = held_out_prompts(spec.dataset, train_ratio=lineage.settings.train_ratio, limit=spec.prompts)
        decoded = measure_spec_decode(spec.model or lineage.verifier, spec.draft, prompts,
                                      k=lineage.settings.ttt_steps, max_tokens=spec.max_tokens)
    result = MeasureResult(
        draft=spec.draft, dataset=spec.dataset, dataset_fingerprint=report.dataset_fingerprint,
        trained_on=lineage.dataset_fingerprint, steps_done=lineage.steps_done,
        held_out_samples=report.held_out_samples, positions=report.positions,
        acceptance_length=report.acceptance_length, features=report.features,
        feature_error=report.feature_error, spec_decode=decoded)
    if spec.out:
        atomic_write_json(Path(spec.out), result.model_dump(mode="json"))
    return result


def run(spec: Spec) -> MeasureResult:
    """``datagen measure-draft DRAFT DATASET`` (``measure``)."""
    return measure(spec)
