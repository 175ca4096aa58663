"""speculators trains from the shards: the adapter hands its collate function what ArrowDataset does, and
speculators' own Trainer runs steps of a tiny EAGLE-3 draft on the tiny model's dataset through the reader."""

from __future__ import annotations

import warnings

import pytest
import torch

from datagen import cli
from datagen.errors import SpecError
from datagen.reader import open_dataset
from datagen.reader.for_speculators import SpeculatorsDataset
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
