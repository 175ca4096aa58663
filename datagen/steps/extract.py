"""The extraction step: ``datagen extract``.

Its input is the plan `datagen plan` made (``--plan FILE``: the orchestration's ranges, finalize and
a fan-out child give it, and the step checks only that this host matches it) or the extraction spec
(``datagen.specs.extraction.ExtractSpec``, planned here), read whole from ``--spec`` or given as options,
and a shard range; the work is ``datagen.extraction.run`` (the output's claim and resume, the run
loop, the manifest). ``--shards A:B`` extracts only shards [A, B) and writes no manifest (the fan-out
unit); a run without it finishes every shard and writes the manifest last.
"""

from __future__ import annotations

import logging
from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from datagen.specs.extraction import ExtractSpec
from datagen.errors import SpecError
from datagen.extraction.manifest import RESULT_SHARD_FIELDS
from datagen.specs.plan import ExtractionPlan, read_plan_file
from datagen.steps._args import Arg, StepSpec

HELP = "Extract hidden states of a model for a JSONL dataset into packed safetensors shards."
log = logging.getLogger(__name__)


def parse_layers(text: str) -> tuple[int, ...]:
    """``--layers 2,30,58,61``."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip() != "")
    except ValueError:
        raise SpecError(f"--layers {text!r} is not a comma-separated list of integers",
                        hint="e.g. --layers 2,30,58,61") from None


def parse_range(text: str) -> tuple[int, int]:
    """``--shards A:B``."""
    try:
        a, b = text.split(":")
        return int(a), int(b)
    except ValueError:
        raise SpecError(f"--shards {text!r} is not A:B", hint="e.g. --shards 0:4") from None


class ExtractionSpec(ExtractSpec, StepSpec):
    """The extraction spec as a step's input: the options of plan, extract and assemble."""

    SPEC_FILE: ClassVar[bool] = True
    OPTIONS: ClassVar[dict[str, Arg]] = {
        "layer_ids": Arg(flag="--layers", metavar="IDS", parse=parse_layers,
                         help="comma-separated layer ids in vLLM numbering (default: the EAGLE-3 set "
                              "[2, N//2, N-3, N])"),
        "engine.name": Arg(flag="--engine", help="engine that computes the states: vllm, or hf (the reference)"),
        "engine.tensor_parallel_size": Arg(),
        "engine.dtype": Arg(),
        "engine.storage_dtype": Arg(),
        "engine.shard_group": Arg(),
        "engine.max_num_batched_tokens": Arg(),
    }



class Spec(ExtractionSpec):
    """``datagen extract``'s input: the plan `datagen plan` made (``--plan FILE``), or the extraction
    spec to plan here; and the shards to extract."""

    model: str | None = Field(None, description="Local Hugging Face model directory (config + safetensors). With "
                              "--plan: this host's copy of the plan's model (default: the plan's path).")
    dataset: str | None = Field(None, description="JSONL dataset file: chat rows or pre-tokenized rows. Not with "
                                "--plan (the plan's).")
    out: str | None = Field(None, description="Output dataset directory. With --plan: where this host writes the "
                            "plan's shards (default: the plan's output).")
    plan: Annotated[ExtractionPlan | None, Arg(metavar="FILE", parse=read_plan_file)] = Field(
        None, description="the plan `datagen plan --plan-file FILE` wrote: its shards are extracted, on a host "
                          "checked to match it (model, engine), instead of a spec planned here")
    shards: Annotated[tuple[int, int] | None, Arg(metavar="A:B", parse=parse_range)] = Field(
        None, description="extract only shards [A, B) and write no manifest (default: every shard, then "
                          "the manifest)")

    @field_validator("shards")
    @classmethod
    def _range(cls, v: tuple[int, int] | None) -> tuple[int, int] | None:
        if v is not None and not 0 <= v[0] <= v[1]:
            raise ValueError(f"shards {v[0]}:{v[1]} is not a range A:B with 0 <= A <= B")
        return v

    @model_validator(mode="after")
    def _plan_or_spec(self) -> "Spec":
        if self.plan is None:
            missing = [f"--{name}" for name in ("model", "dataset", "out") if getattr(self, name) is None]
            if missing:
                raise ValueError(f"missing {', '.join(missing)}: give the spec to extract, or --plan FILE")
        elif given := sorted(self.model_fields_set - {"plan", "shards", "model", "out"}):
            raise ValueError(f"{', '.join(given)} given with --plan: the plan fixes them (with --plan only --shards, "
                             "--model, this host's copy of its model, and --out, where this host writes, are given)")
        return self


class ExtractResult(BaseModel):
    """What `datagen extract` did: the whole dataset, or the shards of ``--shards A:B``."""

    model_config = ConfigDict(frozen=True)

    dataset: str = Field(description="Dataset directory (absolute).")
    fingerprint: str = Field(description="sha256 of the full spec: the dataset's identity.")
    extraction_fingerprint: str = Field(description="The spec without the dataset.")
    layer_ids: list[int] = Field(description="Captured layers (vLLM numbering).")
    shards_total: int = Field(description="Shards of the dataset.")
    shards_extracted: list[int] = Field(description="Shards the engine computed in this run.")
    shards_cached: list[int] = Field(description="Shards of the range that were already complete.")
    tokens: int = Field(description="Tokens in the range's shards.")
    tokens_extracted: int = Field(description="Tokens computed in this run.")
    seconds: float = Field(description="Wall time of the step.")
    tokens_per_s: float = Field(description="Extraction throughput (tokens computed / seconds).")
    engine: dict = Field(description="Engine name, version, patches and attention backend.")
    bytes: Annotated[int | None, Field(exclude_if=lambda v: v is None)] = Field(
        None, description="Bytes of the dataset, when this run wrote its manifest (no --shards).")
    # The manifest, when this run wrote (or found) it: the orchestration reads it from here.
    manifest_sha256: Annotated[str | None, Field(exclude_if=lambda v: v is None)] = Field(
        None, description="sha256 of manifest.json (the key of validation and publishing).")
    totals: Annotated[dict | None, Field(exclude_if=lambda v: v is None)] = Field(
        None, description="The manifest's totals: rows, samples, tokens, bytes, shards, skipped, truncated.")
    shards: Annotated[list[dict] | None, Field(exclude_if=lambda v: v is None)] = Field(
        None, description="The manifest's shards: " + ", ".join(RESULT_SHARD_FIELDS) + " of each.")


Result = ExtractResult


def run(spec: Spec) -> ExtractResult:
    """``datagen extract``: the plan extracted on this host (``datagen.extraction.run.extract_planned``),
    or the spec planned here and extracted (``extract``)."""
    from datagen.extraction.run import extract, extract_planned

    if spec.plan is not None:
        record = spec.plan.on_host(model=spec.model, out=spec.out)
        result = ExtractResult.model_validate(extract_planned(record, shards=spec.shards))
    else:
        result = ExtractResult.model_validate(extract(spec, shards=spec.shards))
    log.info("dataset: %s", result.dataset)
    return result
