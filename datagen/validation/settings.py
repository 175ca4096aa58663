"""How a dataset is validated: ``ValidationSettings``, the part of `datagen validate`'s spec that a
pipeline spec embeds as its ``validation`` (one declaration, read by the step, the pipeline and the
validation's cache key alike).
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_GOLDEN = 4  # golden rows of a validation
DEFAULT_TOLERANCE = 0.05  # the max-token criterion's per-token bound
DEFAULT_DRIFT_THRESHOLD = 0.25  # largest mean shift (in previous std) and relative std change


class GoldenReference(str, enum.Enum):
    """Which engine re-extracts golden samples."""

    AUTO = "auto"
    TRANSFORMERS = "transformers"
    ENGINE = "engine"


class GoldenCriterionName(str, enum.Enum):
    """How a golden sample is judged."""

    ROBUST = "robust"  # per-layer median and p90, right layer against its neighbours
    MAX_TOKEN = "max-token"  # every token within the tolerance (false alarms on bf16 MoE models)


class ValidationSettings(BaseModel):
    """How `datagen validate` checks a finished dataset. Part of the validation's cache key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    golden_samples: int = Field(
        DEFAULT_GOLDEN, ge=0,
        description=f"rows re-extracted with a reference engine and compared layer by layer (default "
                    f"{DEFAULT_GOLDEN}; 0: none)")
    golden_tolerance: float = Field(
        DEFAULT_TOLERANCE, gt=0,
        description=f"max-token criterion: largest per-token relative L2 error (default {DEFAULT_TOLERANCE}; "
                    "reported beside the robust one)")
    golden_reference: GoldenReference = Field(
        GoldenReference.AUTO,
        description="engine of the golden re-extraction: transformers, or the engine itself in eager mode with "
                    "layer hooks (models transformers cannot load, such as Kimi-K2.5); default auto: transformers "
                    "where it has the model's class, else the engine")
    golden_criterion: GoldenCriterionName = Field(
        GoldenCriterionName.ROBUST,
        description="robust (default): per-layer median, p90 and right layer against neighbours; "
                    "max-token: every token within golden_tolerance")
    drift_threshold: float = Field(
        DEFAULT_DRIFT_THRESHOLD, gt=0,
        description=f"largest mean shift (in previous std) and relative std change (default {DEFAULT_DRIFT_THRESHOLD})")
    previous: str | None = Field(
        None, description="the last good dataset of the same model and layers, for the drift check")
