"""Train an EAGLE-3 draft from a dataset's packed shards with speculators' own trainer.

Everything that makes the draft is speculators' (0.9.x): ``Eagle3DraftModel.from_training_args``
(the draft and its verifier weights: embeddings, final norm, lm_head), the vocabulary mapping
(``build_vocab_mappings_from_distribution``, over the training rows' assistant tokens), the
multipack batch sampler and collate function (``_setup_dataloader`` with ``shift_batch``, as
``speculators train`` sets them up for eagle3), the loss and the ``Trainer``'s epoch loop. What
datagen adds is the data source (``datagen.reader.for_speculators.SpeculatorsDataset``, the shards
read directly, no export), a CPU path, and the lineage written next to the draft.

The draft directory is what ``speculators train`` saves (``save_pretrained`` in bf16,
``config.json`` with ``speculators_config``), the format vLLM loads as an EAGLE-3 speculator
(``speculative_config={"method": "eagle3", "model": <draft>}``), plus ``datagen_draft.json``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import json
import logging
import math
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, Field

from datagen.errors import ModelError, OutputConflictError, SpecError
from datagen.reader import DatasetReader, open_dataset
from datagen.training.settings import Device, DraftSettings

log = logging.getLogger(__name__)

LINEAGE_NAME = "datagen_draft.json"
SPECULATORS = "speculators"
# speculators' ``speculators.metrics`` logger carries each logged step's metrics (a dict) as the message
_METRICS_LOGGER = "speculators.metrics"
# the draft's attention: speculators' own default on the GPU (flex attention, a compiled Triton kernel);
# sdpa on the CPU, where that kernel does not exist
ATTENTION = {Device.CUDA: "simple_flex_attention", Device.CPU: "sdpa"}


class DraftLineage(BaseModel):
    """Where a draft comes from: ``datagen_draft.json`` in the draft directory."""

    dataset: str = Field(description="the dataset it was trained on (directory or s3:// URI)")
    dataset_fingerprint: str = Field(description="the dataset manifest's fingerprint (its identity)")
    verifier: str = Field(description="the target model directory whose embeddings, norm and lm_head it uses")
    layer_ids: list[int] = Field(description="the dataset's layers: aux layers (the draft's input) then the final")
    storage_dtype: str = Field(description="the dataset's hidden-state dtype (bfloat16, fp8_e4m3, ...)")
    settings: DraftSettings = Field(description="what it was trained with")
    steps_done: int = Field(description="optimizer steps run (0: the untrained baseline)")
    train_samples: int = Field(description="samples of the training split")
    held_out_samples: int = Field(description="samples of the held-out split (measured, never trained on)")
    losses: list[float] = Field(description="training loss at each logged step, in step order")
    speculators_version: str = Field(description="the speculators release that trained it")
    created_at: str = Field(description="UTC time the draft was written (ISO 8601)")


@dataclass(frozen=True)
class TrainedDraft:
    """A draft directory and its lineage."""

    path: Path  # the draft directory (speculators' format + LINEAGE_NAME)
    lineage: DraftLineage


def speculators_version() -> str:
    return importlib.metadata.version(SPECULATORS)


def read_lineage(draft: str | Path) -> DraftLineage:
    """The lineage of a draft directory.

    Raises:
        ModelError: the directory holds no datagen draft.
    """
    path = Path(draft) / LINEAGE_NAME
    try:
        return DraftLineage.model_validate_json(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{draft} is not a datagen draft ({LINEAGE_NAME} unreadable: {e})",
                         hint="train one with `datagen train`") from e


def token_frequencies(reader: DatasetReader, samples: range) -> dict[int, int]:
    """{token id: count} over the assistant (loss-masked) tokens of ``samples``, from the shards'
    small tensors (no hidden states read): what speculators builds a draft vocabulary from."""
    counts: Counter[int] = Counter()
    wanted = set(samples)
    for k, numbers in enumerate(reader.positions()):
        s = reader.shards[k]
        off = s.offsets.tolist()
        for p, i in enumerate(numbers):
            if i in wanted:
                ids = s.input_ids[off[p]:off[p + 1]][s.loss_mask[off[p]:off[p + 1]] > 0]
                counts.update(ids.tolist())
    return dict(counts)


def _draft_layer_config(verifier: Path, settings: DraftSettings):
    """The draft's decoder config as `speculators train` makes it by default: a Llama decoder shaped from
    the verifier (attention geometry, hidden size, vocabulary; a dense MLP for MoE targets such as
    DeepSeek-V3 / Kimi), SiLU, speculators' default sliding window of 2048 on every layer."""
    from speculators.train.cli import create_transformer_layer_config

    try:
        return create_transformer_layer_config(str(verifier), settings.num_layers, "llama", "silu", 2048, [])
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot shape a draft from the target model's config.json in {verifier}: {e}",
                         hint="pass --model: the checkpoint directory the dataset was extracted from") from e


def _check_matches(reader: DatasetReader, verifier: Path) -> None:
    """The dataset was extracted from this model: same hidden size and layer count."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(verifier)
    config = getattr(config, "text_config", config)
    model = reader.manifest.spec.model
    if (config.hidden_size, config.num_hidden_layers) != (model.hidden_size, model.num_hidden_layers):
        raise SpecError(
            f"the model in {verifier} (hidden {config.hidden_size}, {config.num_hidden_layers} layers) is not the "
            f"dataset's (hidden {model.hidden_size}, {model.num_hidden_layers} layers)",
            hint="pass --model: the checkpoint the dataset was extracted from")


def build_draft(reader: DatasetReader, verifier: Path, settings: DraftSettings, *, train: range):
    """A freshly initialised ``Eagle3DraftModel`` for the dataset's layers (seeded by ``settings.seed``)."""
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    _check_matches(reader, verifier)
    config = _draft_layer_config(verifier, settings)
    d2t = t2d = None
    vocab = config.vocab_size
    if settings.draft_vocab_size is not None and settings.draft_vocab_size < config.vocab_size:
        d2t, t2d = build_vocab_mappings_from_distribution(
            token_frequencies(reader, train), draft_vocab_size=settings.draft_vocab_size,
            target_vocab_size=config.vocab_size)
        vocab = settings.draft_vocab_size
    torch.manual_seed(settings.seed)
    return Eagle3DraftModel.from_training_args(
        config, t2d=t2d, d2t=d2t, verifier_name_or_path=str(verifier), draft_vocab_size=vocab,
        norm_before_residual=True, ttt_steps=settings.ttt_steps, target_layer_ids=list(reader.layer_ids[:-1]),
        draft_attn_impl=ATTENTION[settings.device])


def _loader(data, settings: DraftSettings, *, seed: int):
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import _setup_dataloader

    workers = settings.loader_workers
    return _setup_dataloader(data, settings.total_seq_len, data.hidden_size, num_workers=workers,
                             prefetch_factor=4 if workers else None, num_target_layers=data.num_target_layers,
                             preprocess=shift_batch, seed=seed)


class _LossRecorder(logging.Handler):
    """Collects the training loss from speculators' metric log records."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.losses: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if isinstance(msg, dict) and isinstance(msg.get("train"), dict) and "loss" in msg["train"]:
            self.losses.append(float(msg["train"]["loss"]))


@contextlib.contextmanager
def _on_device(device: Device):
    """speculators' Trainer assumes an accelerator: its step timer calls
    ``torch.accelerator.synchronize()``, which raises on a torch without one. On the CPU there is
    nothing to wait for, so it is a no-op for the duration of training."""
    if device is Device.CUDA or torch.accelerator.current_accelerator() is not None:
        yield
        return
    real = torch.accelerator.synchronize
    torch.accelerator.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        torch.accelerator.synchronize = real


def _trainer(model, settings: DraftSettings, loader, save_path: Path):
    from speculators.train.trainer import Trainer, TrainerConfig

    class DeviceTrainer(Trainer):
        """speculators' Trainer on ``settings.device``: it moves the model and each batch to device index
        ``local_rank`` (0: the first GPU), which on the CPU must be "cpu"."""

        def setup_model(self):
            if settings.device is Device.CPU:
                self.local_rank, self.device_type = "cpu", "cpu"
            super().setup_model()

    from speculators.models.eagle3.core import Eagle3DraftModel

    # the fused loss is a Triton kernel (GPU only); the eager one is the same loss
    train_kwargs, val_kwargs = Eagle3DraftModel.get_trainer_kwargs(
        ttt_steps=settings.ttt_steps, ttt_step_loss_decay=1.0, loss_fn="kl_div",
        loss_implementation=settings.loss.value)
    return DeviceTrainer(model, TrainerConfig(
        lr=settings.lr, num_epochs=max(1, math.ceil(settings.steps / max(1, len(loader)))), save_path=str(save_path),
        train_call_kwargs=train_kwargs, val_call_kwargs=val_kwargs, max_steps=settings.steps,
        scheduler_type="linear", scheduler_warmup_ratio=settings.warmup_ratio, hidden_states_dtype=torch.bfloat16, log_freq=1,
        resume_from_checkpoint=False), loader)


def _save(model, out: Path) -> None:
    """speculators' checkpoint format (its checkpointer's model half): bf16 weights, config dtype patched."""
    from speculators.train.checkpointer import convert_float_dtype, patch_config_dtype

    model.save_pretrained(out, state_dict=convert_float_dtype(model.state_dict(), torch.bfloat16))
    patch_config_dtype(out / "config.json", torch.bfloat16)


def model_of(dataset: str | Path) -> str:
    """The model directory a dataset's manifest names (where it was extracted from)."""
    source = open_dataset(dataset).manifest.spec.model.source
    if not source:
        raise SpecError(f"the manifest of {dataset} names no local model directory",
                        hint="pass --model: the checkpoint directory the dataset was extracted from")
    return source


def train_draft(dataset: str | Path, out: str | Path, *, verifier: str | Path,
                settings: DraftSettings) -> TrainedDraft:
    """Train a draft on ``dataset``'s training split and write it to ``out`` (which must not exist).

    ``settings.steps`` optimizer steps; 0 steps is not allowed here (``untrained_draft`` writes the
    untrained baseline). ``out`` is written under a temporary sibling and renamed at the end.

    Raises:
        OutputConflictError: ``out`` exists.
        SpecError: the dataset lacks the final layer, its split is empty, or the model is not its model.
        ModelError: the model directory is unreadable.
    """
    return _make(dataset, out, verifier=Path(verifier), settings=settings, train=True)


def untrained_draft(dataset: str | Path, out: str | Path, *, verifier: str | Path,
                    settings: DraftSettings) -> TrainedDraft:
    """The same draft as ``train_draft`` would start from, saved without a training step (the baseline)."""
    return _make(dataset, out, verifier=Path(verifier), settings=settings, train=False)


def _make(dataset, out, *, verifier: Path, settings: DraftSettings, train: bool) -> TrainedDraft:
    from datagen.reader.for_speculators import SpeculatorsDataset
    from datagen.training.layers import as_reader

    out = Path(out)
    if out.exists():
        raise OutputConflictError(f"{out} exists", hint="pass a new --out (a draft is never overwritten)")
    if not (verifier / "config.json").is_file():
        raise ModelError(f"{verifier} has no config.json",
                         hint="pass --model: the checkpoint directory the dataset was extracted from")
    reader = as_reader(dataset)
    data = SpeculatorsDataset(reader, max_len=settings.total_seq_len, train_ratio=settings.train_ratio, split="train")
    held_out = len(reader) - len(data)  # at least one: train_ratio < 1
    model = build_draft(reader, verifier, settings, train=data.indices)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        losses: list[float] = []
        steps = 0
        if train:
            losses, steps = _train(model, data, settings, tmp / "checkpoints")
            shutil.rmtree(tmp / "checkpoints", ignore_errors=True)
        _save(model.to("cpu"), tmp)
        lineage = DraftLineage(
            dataset=str(reader.location), dataset_fingerprint=reader.manifest.fingerprint, verifier=str(verifier),
            layer_ids=list(reader.layer_ids), storage_dtype=str(reader.manifest.spec.storage_dtype),
            settings=settings, steps_done=steps, train_samples=len(data), held_out_samples=held_out, losses=losses,
            speculators_version=speculators_version(),
            created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
        (tmp / LINEAGE_NAME).write_text(lineage.model_dump_json(indent=1) + "\n")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("draft %s: %d steps on %d samples of %s (loss %s)", out, steps, len(data),
             reader.manifest.fingerprint[:12], f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "untrained")
    return TrainedDraft(path=out, lineage=lineage)


def _train(model, data, settings: DraftSettings, save_path: Path) -> tuple[list[float], int]:
    loader = _loader(data, settings, seed=settings.seed)
    recorder = _LossRecorder()
    metrics = logging.getLogger(_METRICS_LOGGER)
    metrics.addHandler(recorder)
    old_level = metrics.level
    metrics.setLevel(logging.INFO)
    try:
        with _on_device(settings.device):
            trainer = _trainer(model, settings, loader, save_path)
            for epoch in range(trainer.config.num_epochs):
                trainer.train_epoch(epoch)
                if trainer.global_step >= settings.steps:
                    break
    finally:
        metrics.removeHandler(recorder)
        metrics.setLevel(old_level)
    return recorder.losses, trainer.global_step


def lineage_json(draft: TrainedDraft) -> str:
    return json.dumps(draft.lineage.model_dump(mode="json"), indent=1)
