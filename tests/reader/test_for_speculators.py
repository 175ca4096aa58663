"""speculators trains from the shards: the adapter hands its collate function what ArrowDataset does, and
speculators' own Trainer runs steps of a tiny EAGLE-3 draft on the tiny model's dataset through the reader.
The loader ``datagen train`` uses packs each batch where it reads it (``PackedBatches``): its batches are
held byte for byte to speculators' own ``_setup_dataloader`` + ``CollateFn`` + ``shift_batch``."""

from __future__ import annotations

import warnings

import pytest
import torch

from datagen import cli
from datagen.errors import DatasetError, SpecError
from datagen.reader import open_dataset
from datagen.reader.for_speculators import PackedBatches, SpeculatorsDataset, pack, packable, packed_loader
from tests.support.extracted import extracted_dataset
from tests.support.synthetic_shards import make_synthetic_dataset

MAX_LEN = 256


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return extracted_dataset(tmp_path_factory)


def test_items_equal_what_arrow_dataset_reads_from_an_export(pristine, tmp_path):
    from speculators.train.data import ArrowDataset, CollateFn

    out = tmp_path / "export"
    assert cli.main(["export", "--format", "speculators", str(pristine), str(out)]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # speculators warns, then skips, on a token mismatch
        arrow = ArrowDataset(max_len=MAX_LEN, datapath=str(out), on_missing="raise", train_ratio=0.75, split="val")
    ours = SpeculatorsDataset(open_dataset(pristine), max_len=MAX_LEN, train_ratio=0.75, split="val")

    assert len(ours) == len(arrow) > 0 and ours.approx_lengths == arrow.approx_lengths
    for i in range(len(ours)):
        a, b = ours[i], arrow[i]
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    collate = CollateFn(MAX_LEN, ours.hidden_size, num_target_layers=ours.num_target_layers)
    x, y = collate([ours[i] for i in range(len(ours))]), collate([arrow[i] for i in range(len(arrow))])
    assert all(torch.equal(x[k], y[k]) for k in x if isinstance(x[k], torch.Tensor))


def test_a_dataset_without_the_final_layer_is_refused(tmp_path):
    ds = make_synthetic_dataset(tmp_path / "ds", rows=4, layer_ids=(1, 2, 3), num_hidden_layers=4)
    with pytest.raises(SpecError, match="final layer 4"):
        SpeculatorsDataset(open_dataset(ds), max_len=MAX_LEN)


def test_speculators_trainer_runs_training_steps_from_the_reader(pristine, tmp_path, monkeypatch):
    """speculators' Trainer assumes an accelerator twice: it moves the model and each batch to device
    index ``local_rank`` (on a CPU-only torch that raises), and its step timer calls
    ``torch.accelerator.synchronize()``. The test points the device at the CPU (a two-line subclass)
    and makes the synchronize a no-op (nothing to wait for on the CPU); the fused loss is a Triton
    kernel, so the eager loss is chosen. Sampler, collate function, model, loss, backward and
    optimizer steps are speculators' own."""
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.trainer import Trainer, TrainerConfig
    from transformers import AutoConfig

    class CPUTrainer(Trainer):
        def setup_model(self):
            self.local_rank, self.device_type = "cpu", "cpu"
            super().setup_model()

    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
    torch.manual_seed(0)
    verifier = pristine.parent / "model"
    reader = open_dataset(pristine)
    data = SpeculatorsDataset(reader, max_len=MAX_LEN, train_ratio=0.75, split="train")
    loader = _setup_dataloader(data, MAX_LEN, data.hidden_size, num_workers=0, prefetch_factor=None,
                               num_target_layers=data.num_target_layers)
    config = AutoConfig.from_pretrained(verifier)
    config.num_hidden_layers = 1  # the draft: one decoder layer
    model = Eagle3DraftModel.from_training_args(
        config, verifier_name_or_path=str(verifier), draft_vocab_size=config.vocab_size, norm_before_residual=True,
        ttt_steps=2, target_layer_ids=list(reader.layer_ids[:-1]), draft_attn_impl="sdpa")
    train_kwargs, val_kwargs = Eagle3DraftModel.get_trainer_kwargs(
        ttt_steps=2, ttt_step_loss_decay=1.0, loss_fn="kl_div", loss_implementation="eager")
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    losses: list[float] = []
    trainer = CPUTrainer(model, TrainerConfig(
        lr=1e-3, num_epochs=1, save_path=str(tmp_path / "ckpt"), train_call_kwargs=train_kwargs,
        val_call_kwargs=val_kwargs, max_steps=3, scheduler_type="none", hidden_states_dtype=torch.bfloat16,
    ), loader)
    forward = model.forward

    def recording_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        losses.append(float(out[1].detach()))
        return out

    monkeypatch.setattr(model, "forward", recording_forward)
    trainer.train_epoch(0)

    assert trainer.global_step == 3 and len(losses) == 3
    assert all(torch.isfinite(torch.tensor(losses))) and min(losses) > 0
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert sorted(changed) == sorted(before)  # every trainable parameter was updated


# --- the packed loader against speculators' own -------------------------------------------------------

def _reference(data, max_len: int, *, seed: int):
    """speculators' own loader of ``data`` as ``speculators train`` sets it up for eagle3."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import _setup_dataloader

    return _setup_dataloader(data, max_len, data.hidden_size, num_workers=0, prefetch_factor=None,
                             num_target_layers=data.num_target_layers, preprocess=shift_batch, seed=seed)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype.is_floating_point else t


def _assert_same_batches(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs):
        assert list(a) == list(b)  # the same keys in the same order
        for k in a:
            x, y = a[k], b[k]
            if isinstance(y, torch.Tensor):
                assert isinstance(x, torch.Tensor) and x.is_contiguous(), k
                assert (x.dtype, x.shape) == (y.dtype, y.shape), k
                assert torch.equal(_bytes_of(x), _bytes_of(y)), k  # byte for byte (-0.0 and NaNs too)
            else:
                assert type(x) is type(y) and x == y, k


def _epochs(loader, epochs: int) -> list[dict]:
    out = []
    for e in range(epochs):
        loader.batch_sampler.set_epoch(e)  # as speculators' Trainer does before each epoch
        out += list(loader)
    return out


@pytest.mark.parametrize("seed", [0, 7])
def test_packed_batches_are_speculators_collate_and_shift_batch_byte_for_byte(pristine, seed):
    """The tiny model's extracted dataset (written by the shard writer), two epochs in the seed's order."""
    data = SpeculatorsDataset(open_dataset(pristine), max_len=MAX_LEN, train_ratio=0.75, split="train")
    assert packable(data)
    ours = _epochs(packed_loader(data, MAX_LEN, num_workers=0, prefetch_factor=None, seed=seed), 2)
    _assert_same_batches(ours, _epochs(_reference(data, MAX_LEN, seed=seed), 2))


@pytest.mark.parametrize("take", [(3, 1, 4), (2, 3, 4)], ids=["reordered", "subset"])
def test_a_view_of_some_layers_is_packed_from_the_layers_it_takes(tmp_path, take):
    """A view of some of a dataset's layers (the training proof's, ``datagen.training.layers.LayerView``)
    hands out only those: its batches are speculators' collate of the view's samples, never the stored
    bytes of every layer read into rows sized for fewer (which trained every view of the same width on
    the same misplaced bytes)."""
    from datagen.training.layers import LayerView

    ds = make_synthetic_dataset(tmp_path / "ds", rows=24, tokens=(2, 60), hidden=32, layer_ids=(1, 2, 3, 4, 5),
                                num_hidden_layers=4 + 1)
    reader = open_dataset(ds)
    view = LayerView(reader, (*take[:-1], 5))
    data = SpeculatorsDataset(view, max_len=96, train_ratio=0.75, split="train")
    assert data.num_target_layers == 2
    ours = _epochs(packed_loader(data, 96, num_workers=0, prefetch_factor=None, seed=3), 2)
    _assert_same_batches(ours, _epochs(_reference(data, 96, seed=3), 2))


def test_packed_batches_cut_and_pad_as_speculators_does(tmp_path):
    """Samples longer than a batch (speculators' sampler lets them in, its collate cuts them), one-token
    samples (no row after the shift), batches filled exactly and padded."""
    ds = make_synthetic_dataset(tmp_path / "ds", rows=48, tokens=(1, 90), hidden=48, samples_per_shard=5)
    data = SpeculatorsDataset(open_dataset(ds), max_len=64, train_ratio=0.9, split="train")
    assert max(data.approx_lengths) > 64 and min(data.approx_lengths) == 1
    for seed in range(3):
        ours = _epochs(packed_loader(data, 64, num_workers=0, prefetch_factor=None, seed=seed), 2)
        _assert_same_batches(ours, _epochs(_reference(data, 64, seed=seed), 2))


def test_a_worker_builds_its_batches_in_shared_memory_the_training_process_in_its_own(pristine, monkeypatch):
    """Inside a DataLoader worker the states are built in shared memory (sending them then copies
    nothing), in the training process in its own memory. That spawn workers (as ``datagen train
    --loader-workers`` starts them) hand over the same batches: the spawn run of the next test."""
    import datagen.reader.packed as packed

    data = SpeculatorsDataset(open_dataset(pristine), max_len=MAX_LEN, train_ratio=0.75, split="train")
    own = pack(data, [0, 1], MAX_LEN)
    assert not own["hidden_states"].is_shared()
    monkeypatch.setattr(packed, "get_worker_info", lambda: object())  # as inside a DataLoader worker
    batch = pack(data, [0, 1], MAX_LEN)
    assert batch["hidden_states"].is_shared() and batch["verifier_last_hidden_states"].is_shared()
    _assert_same_batches([batch], [own])


def test_a_spawned_worker_packs_its_batches_without_importing_speculators(pristine, tmp_path):
    """A spawn worker is a fresh interpreter that unpickles what the DataLoader hands it (the dataset, the
    worker_init_fn, the collate_fn) before its first batch. speculators' package costs 8-10 s to import,
    on the way to the first training step, so the worker must not import it: it gets the samples, not
    the speculators dataset, and packs the same batch."""
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    data = SpeculatorsDataset(open_dataset(pristine), max_len=MAX_LEN, train_ratio=0.75, split="train")
    loader = packed_loader(data, MAX_LEN, num_workers=1, prefetch_factor=2, seed=0)
    sent = tmp_path / "worker.pkl"
    sent.write_bytes(pickle.dumps((loader.dataset, loader.worker_init_fn, loader.collate_fn)))
    code = ("import pickle, sys, torch\n"
            "ds, init, collate = pickle.loads(open(sys.argv[1], 'rb').read())\n"
            "init(0)\n"
            "b = collate(ds.__getitems__([0, 1]))\n"
            "torch.save({k: v.clone() for k, v in b.items() if isinstance(v, torch.Tensor)}, sys.argv[2])\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'speculators'))\n")
    run = subprocess.run([sys.executable, "-c", code, str(sent), str(tmp_path / "batch.pt")], capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"
    theirs, ours = torch.load(tmp_path / "batch.pt"), pack(data, [0, 1], MAX_LEN)
    assert theirs.keys() == {k for k, v in ours.items() if isinstance(v, torch.Tensor)}
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)


def test_batch_buffers_are_reused_once_freed_and_never_while_held(tmp_path):
    """The states' buffers are reused (no fresh pages a batch) only after every tensor over the last batch
    made in them is freed: batches dropped as they come share a few buffers, batches kept are never
    written over, in the training process and through spawn workers alike."""
    ds = make_synthetic_dataset(tmp_path / "ds", rows=60, tokens=(2, 40), hidden=32, samples_per_shard=7)
    data = SpeculatorsDataset(open_dataset(ds), max_len=48, train_ratio=0.9, split="train")
    reference = _epochs(_reference(data, 48, seed=5), 2)

    def streamed(loader) -> set[int]:
        pointers, k = set(), 0
        for e in range(2):
            loader.batch_sampler.set_epoch(e)
            for batch in loader:
                _assert_same_batches([batch], [reference[k]])
                pointers.add(batch["hidden_states"].data_ptr())
                k += 1
                del batch
        assert k == len(reference)
        return pointers

    assert len(streamed(packed_loader(data, 48, num_workers=0, prefetch_factor=None, seed=5))) <= 3
    streamed(packed_loader(data, 48, num_workers=2, prefetch_factor=2, seed=5))
    held = packed_loader(data, 48, num_workers=0, prefetch_factor=None, seed=5)
    kept = _epochs(held, 2)
    _assert_same_batches(kept, reference)
    assert len({b["hidden_states"].data_ptr() for b in kept}) == len(kept)


@pytest.mark.parametrize(("storage", "dtype"), [("fp8", torch.bfloat16), ("bf16", torch.float32)])
def test_states_that_need_converting_are_converted_as_the_dataset_converts_them(tmp_path, storage, dtype):
    """fp8 shards (dequantized) and another training dtype than the stored one are not read straight into
    the batch; each sample is converted as ``SpeculatorsDataset`` converts it."""
    ds = make_synthetic_dataset(tmp_path / "ds", rows=20, tokens=(2, 60), hidden=32, storage=storage)
    data = SpeculatorsDataset(open_dataset(ds), max_len=96, train_ratio=0.8, split="train", hidden_states_dtype=dtype)
    ours = list(packed_loader(data, 96, num_workers=0, prefetch_factor=None, seed=1))
    _assert_same_batches(ours, list(_reference(data, 96, seed=1)))


def test_a_store_without_file_descriptors_reads_the_same_batches(tmp_path):
    """An S3 dataset has no descriptor to preadv from: one ranged read a sample, then copied into the batch."""
    ds = make_synthetic_dataset(tmp_path / "ds", rows=16, tokens=(2, 50), hidden=32)
    reader = open_dataset(ds)
    reader.verify_samples()
    local = reader.store

    class Ranged:  # the store interface, as S3Store offers it (no LocalStore, so no descriptor)
        uri = local.uri

        def read(self, rel, start, end, *, etag=None):
            return bytes(local.read(rel, start, end))

    reader.store = Ranged()
    data = SpeculatorsDataset(reader, max_len=80, train_ratio=0.75, split="train")
    ours = list(packed_loader(data, 80, num_workers=0, prefetch_factor=None, seed=2))
    reader.store = local
    _assert_same_batches(ours, list(_reference(data, 80, seed=2)))


def test_an_empty_share_is_speculators_placeholder_batch(tmp_path):
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    ds = make_synthetic_dataset(tmp_path / "ds", rows=4, tokens=8, hidden=32)
    data = SpeculatorsDataset(open_dataset(ds), max_len=32)
    theirs = CollateFn(32, data.hidden_size, num_target_layers=data.num_target_layers, preprocess=shift_batch)([])
    ours = pack(data, [], 32)
    metadata = "recovery_metadata"
    assert ours.pop(metadata, None) == theirs.pop(metadata, None)
    _assert_same_batches([ours], [theirs])


def test_a_shard_cut_short_after_it_was_opened_is_an_error_not_a_short_batch(tmp_path):
    ds = make_synthetic_dataset(tmp_path / "ds", rows=8, tokens=30, hidden=32, samples_per_shard=8)
    reader = open_dataset(ds)
    reader.verify_samples()
    shard = ds / reader.shards[0].record.path
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size - 40 * 32 * 2 * 4)  # the last sample's states, and more
    data = SpeculatorsDataset(reader, max_len=256)
    with pytest.raises(DatasetError, match="ended at byte"):
        pack(data, list(range(len(data))), 256)


def test_a_dataset_that_hands_out_other_states_goes_through_speculators_collate(pristine):
    """``measure-draft`` replaces the samples' states with the target's (``_get_raw_data``): a batch
    packed from the shards would not hold them, so ``datagen train``'s loader falls back to speculators'."""
    from speculators.train.data import CollateFn

    from datagen.training.draft import _loader
    from datagen.training.settings import DraftSettings

    data = SpeculatorsDataset(open_dataset(pristine), max_len=MAX_LEN, train_ratio=0.75, split="train")
    settings = DraftSettings(total_seq_len=MAX_LEN)
    assert isinstance(_loader(data, settings, seed=0).dataset, PackedBatches)
    assert isinstance(_loader(data, settings.model_copy(update={"collate": "speculators"}), seed=0).collate_fn,
                      CollateFn)
    get = data._get_raw_data

    def doubled(index):
        raw = get(index)
        return {**raw, "hidden_states": raw["hidden_states"] * 2}

    data._get_raw_data = doubled
    assert not packable(data)
    loader = _loader(data, settings, seed=0)
    assert isinstance(loader.collate_fn, CollateFn)
    batch = next(iter(loader))
    assert batch["hidden_states"].abs().sum() > 0
