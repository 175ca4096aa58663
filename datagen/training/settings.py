"""What an EAGLE-3 draft is trained and measured with: one record, stored in the draft's lineage."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field


class Device(str, enum.Enum):
    """Where the draft trains: the pool's accelerator."""

    CPU = "cpu"  # the miniature (tests, CI)
    CUDA = "cuda"  # production GPUs


class LossImplementation(str, enum.Enum):
    """speculators' implementation of the KL loss over the vocabulary."""

    EAGER = "eager"  # torch operations (every device)
    FUSED = "fused"  # speculators' Triton kernels (GPU only; failed to run on the H200 image, docs/gpu.md)


class Collate(str, enum.Enum):
    """How the loader packs each batch of the multipack sampler (the batches are the same, byte for byte)."""

    DIRECT = "direct"  # datagen's: the shards read straight into the packed batch (for_speculators.PackedBatches)
    SPECULATORS = "speculators"  # speculators' CollateFn over per-sample dicts (the reference)


class DraftSettings(BaseModel):
    """How a draft is trained. Defaults are the CPU miniature's; production raises ``steps``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(default=60, ge=1, description="optimizer steps (one packed batch each)")
    lr: float = Field(default=3e-3, gt=0, description="AdamW learning rate (linear schedule after the warm-up)")
    warmup_ratio: float | None = Field(
        default=None, ge=0, le=1,
        description="share of the steps the learning rate warms up over (speculators' scheduler_warmup_ratio); "
                    "None: speculators' default, the first hundredth")
    ttt_steps: int = Field(default=3, ge=1, le=8,
                           description="speculation depth k: TTT steps in training, positions 1..k measured")
    num_layers: int = Field(default=1, ge=1, description="decoder layers of the draft")
    draft_vocab_size: int | None = Field(
        default=None, ge=2,
        description="draft vocabulary (the most frequent assistant tokens of the training rows); None: the target's")
    total_seq_len: int = Field(default=1024, ge=16, description="tokens per packed batch")
    seed: int = Field(default=0, description="seed of the draft's initialisation and the batch order")
    train_ratio: float = Field(
        default=0.75, gt=0, lt=1,
        description="the first train_ratio of the dataset's samples (dataset-row order) train; "
                    "the rest are the held-out rows the draft is measured on (speculators' own split)")
    device: Device = Field(default=Device.CPU, description="cpu (miniature) or cuda")
    loss: LossImplementation = Field(default=LossImplementation.EAGER,
                                     description="speculators' KL loss: eager (torch) or fused (Triton, GPU only)")
    loader_workers: int = Field(
        default=0, ge=0,
        description="DataLoader worker processes reading the shards (speculators' spawn workers, prefetch 4 "
                    "batches each); 0: the training process reads them itself (the CPU miniature)")
    collate: Collate = Field(
        default=Collate.DIRECT,
        description="how each packed batch is made: direct (the shards read straight into the batch, in shared "
                    "memory in a worker) or speculators (its CollateFn over per-sample tensors); the same batches")
