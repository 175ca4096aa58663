"""Train an EAGLE-3 draft from a dataset's packed shards with speculators' own trainer.

Everything that makes the draft is speculators' (0.9.x), for the recipe speculators resolves
(``datagen.training.recipe``: its defaults, or the options given): its script's ``build_draft_model``
(the draft and its verifier weights), the vocabulary mapping (``build_vocab_mappings_from_distribution``
over the training rows' assistant tokens), the multipack batch sampler, the loss, the optimizer and the
``Trainer``.
datagen adds the data source (``datagen.reader.for_speculators``: the shards read directly, no export,
each batch packed where it is read into the same tensors speculators' ``CollateFn`` + ``shift_batch``
make), a CPU path, data-parallel training under ``torchrun`` (``datagen.training.distributed``) and
the lineage written next to the draft.

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
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, Field

from datagen.errors import ModelError, OutputConflictError, SpecError
from datagen.reader import DatasetReader, open_dataset
from datagen.training.distributed import Topology, data_parallel
from datagen.training.recipe import Recipe, default, trainer_config
from datagen.training.settings import Collate, Device, DraftSettings, resolve_settings

log = logging.getLogger(__name__)

LINEAGE_NAME = "datagen_draft.json"
SPECULATORS = "speculators"
# speculators' ``speculators.metrics`` logger carries each logged step's metrics (a dict) as the message
_METRICS_LOGGER = "speculators.metrics"


class DraftLineage(BaseModel):
    """Where a draft comes from: ``datagen_draft.json`` in the draft directory."""

    dataset: str = Field(description="the dataset it was trained on (directory or s3:// URI)")
    dataset_fingerprint: str = Field(description="the dataset manifest's fingerprint (its identity)")
    verifier: str = Field(description="the target model directory whose embeddings, norm and lm_head it uses")
    layer_ids: list[int] = Field(description="the dataset's layers: aux layers (the draft's input) then the final")
    storage_dtype: str = Field(description="the dataset's hidden-state dtype (bfloat16, fp8_e4m3, ...)")
    settings: DraftSettings = Field(
        description="what it was trained with, resolved: every speculators option as speculators resolved it")
    given: list[str] = Field(default_factory=list,
                             description="the speculators options the caller set (the rest: speculators' defaults)")
    device_defaults: list[str] = Field(
        default_factory=list, description="the speculators options set for the CPU, where its default does not run")
    steps_done: int = Field(description="optimizer steps run (0: the untrained baseline)")
    train_samples: int = Field(description="samples of the training split")
    held_out_samples: int = Field(description="samples of the held-out split (measured, never trained on)")
    losses: list[float] = Field(description="training loss at each logged step, in step order")
    speculators_version: str = Field(description="the speculators release that trained it")
    created_at: str = Field(description="UTC time the draft was written (ISO 8601)")
    world_size: int = Field(
        default=1, ge=1,
        description="data-parallel training processes (torchrun ranks, one GPU each on cuda); each read its "
                    "own share of every packed batch, so one optimizer step took world_size batches")
    steps_per_epoch: int | None = Field(default=None, description=(
        "optimizer steps in the first pass over the training split (each rank's batches in epoch 0: about "
        "1/world_size of a one-process run's; later epochs pack their order into about as many); None: "
        "untrained, or an older lineage"))
    tokens_trained: int | None = Field(default=None, description=(
        "tokens the draft was trained on, all steps and ranks (speculators' count: the packed positions that "
        "hold a sample); None: untrained, or an older lineage"))


@dataclass(frozen=True)
class TrainingRun:
    """What a training loop did (the same record on every rank)."""

    losses: list[float]  # speculators' logged loss per step, reduced across ranks
    steps: int  # optimizer steps run
    steps_per_epoch: int | None  # each rank's batches in the first pass over the split (None: untrained)
    tokens: int | None  # tokens trained on, all ranks (None: untrained)
    seconds: float  # wall time of the loop


UNTRAINED = TrainingRun(losses=[], steps=0, steps_per_epoch=None, tokens=None, seconds=0.0)


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


def build_draft(reader: DatasetReader, verifier: Path, recipe: Recipe, *, train: range):
    """speculators' freshly initialised draft for the recipe; with a draft vocabulary, mapped from the
    training rows' assistant tokens (or the recipe's ``token_freq_path``, or its d2t/t2d files)."""
    from speculators.train.cli import parse_vocab_mappings
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution, get_target_vocab_size

    from datagen.training.recipe import build_draft as build

    _check_matches(reader, verifier)
    args = recipe.args()
    d2t = t2d = None
    try:
        vocab = get_target_vocab_size(None, str(verifier), trust_remote_code=args.trust_remote_code)
        if args.d2t_path or args.t2d_path:
            d2t, t2d, vocab = parse_vocab_mappings(args)
        elif args.draft_vocab_size is not None and args.draft_vocab_size < vocab:
            counts = (torch.load(args.token_freq_path, weights_only=True) if args.token_freq_path
                      else token_frequencies(reader, train))
            d2t, t2d = build_vocab_mappings_from_distribution(counts, draft_vocab_size=args.draft_vocab_size,
                                                              target_vocab_size=vocab)
            vocab = args.draft_vocab_size
        return build(recipe, t2d=t2d, d2t=d2t, draft_vocab_size=vocab)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot build the draft from the target model in {verifier}: {e}",
                         hint="pass --model: the checkpoint directory the dataset was extracted from") from e


def _loader(data, settings: DraftSettings, *, seed: int):
    """speculators' sampler and loader settings; batches packed by ``settings.collate`` (same either way)."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import _setup_dataloader

    from datagen.reader.for_speculators import packable, packed_loader
    prefetch = settings.prefetch_factor if settings.prefetch_factor is not None else default("prefetch_factor")
    workers, prefetch = settings.loader_workers, (prefetch if settings.loader_workers else None)
    # measure-draft's target-fed samples are not the shards': speculators' collate. (==: model_copy does not validate)
    if settings.collate == Collate.DIRECT and packable(data):
        return packed_loader(data, settings.total_seq_len, num_workers=workers, prefetch_factor=prefetch, seed=seed)
    return _setup_dataloader(data, settings.total_seq_len, data.hidden_size, num_workers=workers,
                             prefetch_factor=prefetch, num_target_layers=data.num_target_layers,
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
    """For the duration of training. speculators' step timer calls ``torch.accelerator.synchronize()``, which
    raises on a torch without an accelerator: on the CPU it is a no-op. float32 states (a CPU without bf16
    kernels): speculators' autocast to them is a no-op torch warns of at every step."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
        if device is Device.CUDA or torch.accelerator.current_accelerator() is not None:
            yield
            return
        real = torch.accelerator.synchronize
        torch.accelerator.synchronize = lambda *a, **k: None
        try:
            yield
        finally:
            torch.accelerator.synchronize = real


def _trainer(model, recipe: Recipe, device: Device, loader, save_path: Path):
    from speculators.train.trainer import Trainer

    class DeviceTrainer(Trainer):
        """speculators' Trainer on ``device``: it moves the model and each batch to device index
        ``local_rank`` (0: the first GPU), which on the CPU must be "cpu"."""

        def setup_model(self):
            if device is Device.CPU:
                self.local_rank, self.device_type = "cpu", "cpu"
            super().setup_model()

    steps = recipe.config.trainer.max_steps
    epochs = max(1, math.ceil(steps / max(1, len(loader))))
    return DeviceTrainer(model, trainer_config(recipe, num_epochs=epochs, save_path=str(save_path)), loader)


def _save(model, out: Path) -> None:
    """speculators' checkpoint format (its checkpointer's half): bf16 weights cast on the device, config patched."""
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
    # under torchrun every rank builds the same draft (seeded; DDP broadcasts rank 0's weights anyway)
    # and reads its own share of the batches; rank 0 alone writes, the others read its lineage
    with data_parallel(settings.device) as topology:
        reader = as_reader(dataset)
        recipe, settings = resolve_settings(settings, dataset=str(reader.location), verifier=verifier,
                                          layer_ids=reader.layer_ids, save_path=str(out))
        data = SpeculatorsDataset(reader, max_len=settings.total_seq_len, train_ratio=settings.train_ratio,
                                  split="train", hidden_states_dtype=getattr(torch, settings.hidden_states_dtype))
        # the shards' content checked once, here, not again in every loader worker; beside the draft's
        # build (the verifier's weights read), not before it: hashing lets go of the GIL
        with ThreadPoolExecutor(1, thread_name_prefix="train-verify") as pool:
            checked = pool.submit(reader.verify_samples, data.indices) if train else None
            model = build_draft(reader, verifier, recipe, train=data.indices)
            if checked is not None:
                checked.result()
        run = _train(model, data, settings, recipe, topology) if train else UNTRAINED
        if topology.writes:
            lineage = DraftLineage(
                dataset=str(reader.location), dataset_fingerprint=reader.manifest.fingerprint,
                verifier=str(verifier), layer_ids=list(reader.layer_ids),
                storage_dtype=str(reader.manifest.spec.storage_dtype), settings=settings, given=list(recipe.given),
                device_defaults=list(recipe.device_defaults), steps_done=run.steps,
                train_samples=len(data), held_out_samples=len(reader) - len(data),  # at least one: train_ratio < 1
                losses=run.losses, speculators_version=speculators_version(),
                created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                world_size=topology.world_size, steps_per_epoch=run.steps_per_epoch, tokens_trained=run.tokens)
            _write(model, lineage, out)
        topology.barrier()
        if not topology.writes:
            lineage = read_lineage(out)
    losses = run.losses
    log.info("draft %s: %d steps on %d samples of %s (loss %s)", out, run.steps, len(data),
             reader.manifest.fingerprint[:12], f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "untrained")
    return TrainedDraft(path=out, lineage=lineage)


def _write(model, lineage: DraftLineage, out: Path) -> None:
    """The draft and its lineage, written under a temporary sibling of ``out`` and renamed to it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _save(model, tmp)
        (tmp / LINEAGE_NAME).write_text(lineage.model_dump_json(indent=1) + "\n")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class _TokenCounter:
    """Counts the tokens each training forward is fed (speculators' own count for its tokens/s: the
    packed positions whose ``document_ids`` is not -1), from a forward pre-hook on the draft, so what
    this rank actually trained on is counted, whichever process read the batch."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.tokens = 0
        self._handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        ids = kwargs.get("document_ids")
        if module.training and ids is not None:
            self.tokens += int((ids != -1).sum())

    def close(self) -> None:
        self._handle.remove()


def _train(model, data, settings: DraftSettings, recipe: Recipe, topology: Topology) -> TrainingRun:
    """speculators' epoch loop for ``settings.steps`` steps. Every rank runs it (the collectives of DDP
    and of the metrics are in step); the losses are speculators' logged ones, already reduced across ranks."""
    loader = _loader(data, settings, seed=settings.seed)  # the sampler takes this rank's share
    steps_per_epoch = len(loader)  # epoch 0's packing (each epoch's order packs a little differently)
    if not steps_per_epoch:
        raise SpecError(f"the training split's {len(data)} samples make no batch for {topology.world_size} ranks "
                        "(speculators' sampler drops a last group of fewer samples than ranks)",
                        hint="train on fewer processes (torchrun --nproc-per-node) or more samples")
    recorder = _LossRecorder()
    metrics = logging.getLogger(_METRICS_LOGGER)
    metrics.addHandler(recorder)
    old_level = metrics.level
    metrics.setLevel(logging.INFO)
    counter = _TokenCounter(model)
    start = time.perf_counter()
    try:
        # speculators' checkpointer only reads its directory unless asked to save, which datagen never does
        with _on_device(settings.device), tempfile.TemporaryDirectory(prefix="datagen-train-") as scratch:
            trainer = _trainer(model, recipe, settings.device, loader, Path(scratch) / "checkpoints")
            # epochs until the steps are done: a later epoch may pack into fewer batches than the first
            epoch = 0
            while trainer.global_step < settings.steps:
                trainer.train_epoch(epoch)
                epoch += 1
    finally:
        counter.close()
        metrics.removeHandler(recorder)
        metrics.setLevel(old_level)
    seconds = time.perf_counter() - start
    tokens = topology.sum(counter.tokens)
    if topology.writes:
        log.info("trained %d tokens in %.1f s on %d process(es): %.0f tokens/s", tokens, seconds,
                 topology.world_size, tokens / seconds if seconds else 0.0)
    return TrainingRun(losses=recorder.losses, steps=trainer.global_step, steps_per_epoch=steps_per_epoch,
                       tokens=tokens, seconds=seconds)


def lineage_json(draft: TrainedDraft) -> str:
    return json.dumps(draft.lineage.model_dump(mode="json"), indent=1)
