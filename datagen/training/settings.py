"""What an EAGLE-3 draft is trained and measured with: one record, stored in the draft's lineage.

``DraftSettings`` is speculators' training recipe (every option of its training script that applies,
``datagen.training.recipe.SpeculatorsOptions``: unset, speculators' default for the installed release)
plus datagen's own: the steps, the held-out split, the device and how the shards are read. A draft's
lineage holds them resolved: every option as speculators resolved it for that run.
"""

from __future__ import annotations

import enum
from pathlib import Path

from pydantic import ConfigDict, Field

from datagen.errors import SpecError
from datagen.training.recipe import Recipe, SpeculatorsOptions, cpu_defaults, resolve


class Device(str, enum.Enum):
    """Where the draft trains: the pool's accelerator."""

    CPU = "cpu"  # the miniature (tests, CI)
    CUDA = "cuda"  # production GPUs


class Collate(str, enum.Enum):
    """How the loader packs each batch of the multipack sampler (the batches are the same, byte for byte)."""

    DIRECT = "direct"  # datagen's: the shards read straight into the packed batch (datagen.reader.packed.PackedBatches)
    SPECULATORS = "speculators"  # speculators' CollateFn over per-sample dicts (the reference)


class DraftSettings(SpeculatorsOptions):
    """How a draft is trained: speculators' options (unset: its defaults) and datagen's own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(default=60, ge=1, description="optimizer steps (one packed batch each; speculators' max_steps)")
    train_ratio: float = Field(
        default=0.75, gt=0, lt=1,
        description="the first train_ratio of the dataset's samples (dataset-row order) train; the rest are the "
                    "held-out rows the draft is measured on (speculators' train_data_ratio, its own split; "
                    "datagen holds out more rows than speculators' 0.9 leaves, to measure the draft on)")
    device: Device = Field(default=Device.CPU, description=(
        "cpu (miniature) or cuda; on the CPU, unless given: sdpa attention and the eager loss, and on a CPU "
        "without bf16 kernels float32 states and AdamW (docs/training.md)"))
    loader_workers: int = Field(
        default=0, ge=0,
        description="DataLoader worker processes reading the shards (speculators' num_workers: spawn workers, "
                    "prefetch_factor batches each); 0: the training process reads them itself (the CPU miniature)")
    collate: Collate = Field(
        default=Collate.DIRECT,
        description="how each packed batch is made: direct (the shards read straight into the batch, in shared "
                    "memory in a worker) or speculators (its CollateFn over per-sample tensors); the same batches")


def resolve_settings(settings: DraftSettings, *, dataset: str, verifier: Path, layer_ids,
                     save_path: str) -> tuple[Recipe, DraftSettings]:
    """speculators' recipe for a draft's settings (``resolve``) and the settings resolved: datagen's own
    values given under speculators' names, ``cpu_defaults()`` on the CPU.

    Raises:
        SpecError: speculators refuses the options.
    """
    own = {"verifier_name_or_path": str(verifier), "data_path": dataset, "save_path": save_path,
           "max_steps": settings.steps, "train_data_ratio": settings.train_ratio,
           "num_workers": settings.loader_workers, "target_layer_ids": list(layer_ids[:-1])}
    try:
        recipe = resolve(settings, own=own, device_defaults=cpu_defaults() if settings.device is Device.CPU else {})
    except ValueError as e:
        raise SpecError(f"speculators refuses the training options: {e}",
                        hint="fix the options named (`datagen train --help` lists them)") from e
    return recipe, settings.model_copy(update=recipe.offered())


def trained_with(resolved: DraftSettings, settings: DraftSettings) -> bool:
    """Whether a draft whose lineage holds ``resolved`` was trained with ``settings``: every field they set
    has its value there (the unset ones were speculators' defaults of that run's release)."""
    return resolved.model_copy(update=settings.model_dump(exclude_unset=True)) == resolved
