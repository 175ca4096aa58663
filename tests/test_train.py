"""`datagen train` and `datagen measure-draft` on the tiny model's dataset: speculators' trainer from the
shards, the draft in speculators' (vLLM's EAGLE-3) format with its lineage, bad input refused, the
held-out measurement, the nightly drop check; and the speculators interface this relies on, pinned."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import torch

from datagen import cli
from datagen.errors import OutputConflictError, SpecError
from datagen.training.agreement import measure_agreement
from datagen.training.draft import LINEAGE_NAME, read_lineage, train_draft, untrained_draft
from datagen.training.nightly import NightMeasurement, drop_of, markdown_table, plot
from datagen.training.settings import DraftSettings, trained_with
from tests.support.extracted import copy_dataset, extracted_dataset, fix_checksums, manifest, rewrite_shard
from tests.support.synthetic_shards import make_synthetic_dataset

ROOT = Path(__file__).resolve().parents[1]
TINY = DraftSettings(steps=4, total_seq_len=256, train_ratio=0.75, ttt_steps=2)


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory):
    return extracted_dataset(tmp_path_factory)


@pytest.fixture(scope="module")
def trained(tiny_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafts") / "trained"
    return train_draft(tiny_dataset, out, verifier=tiny_dataset.parent / "model", settings=TINY)


def test_the_speculators_release_is_the_one_the_train_image_pins():
    import importlib.metadata

    pinned = re.search(r"^speculators==(\S+)", (ROOT / "images/train/requirements.in").read_text(), re.M)
    assert pinned, "images/train/requirements.in must pin speculators=="
    lock = re.search(r"^speculators==(\S+)", (ROOT / "requirements/lock.txt").read_text(), re.M)
    assert pinned.group(1) == lock.group(1) == importlib.metadata.version("speculators")


def test_the_speculators_interface_the_trainer_is_fed_through_is_unchanged():
    """What datagen.training and datagen.reader.for_speculators rely on. A new speculators release that
    changes any of it fails here, not in a nightly run."""
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.models.metrics import compute_accepted_length_counts
    from speculators.train.checkpointer import convert_float_dtype, patch_config_dtype  # noqa: F401
    from speculators.train.data import BaseDataset, CollateFn
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.trainer import Trainer, TrainerConfig

    assert {"_compute_approx_lengths", "_get_raw_data"} <= set(vars(BaseDataset))
    assert list(inspect.signature(_setup_dataloader).parameters) == [
        "dataset", "total_seq_len", "hidden_size", "num_workers", "num_target_layers", "prefetch_factor",
        "preprocess", "max_batches", "seed"]
    assert list(inspect.signature(CollateFn).parameters)[:2] == ["max_seq_len", "hidden_size"] or \
        "num_target_layers" in inspect.signature(CollateFn).parameters
    assert {"lr", "num_epochs", "save_path", "train_call_kwargs", "max_steps", "scheduler_type", "log_freq",
            "hidden_states_dtype", "resume_from_checkpoint"} <= set(TrainerConfig._fields)
    assert {"setup_model", "train_epoch"} <= set(vars(Trainer))
    assert {"hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids", "verifier_last_hidden_states",
            "ttt_steps"} <= set(inspect.signature(Eagle3DraftModel.forward).parameters)
    # the sample speculators' collate function packs (what SpeculatorsDataset hands it)
    t, h = 5, 4
    sample = {"input_ids": torch.arange(t), "hidden_states": torch.zeros(t, 3 * h),
              "verifier_last_hidden_states": torch.zeros(t, h), "loss_mask": torch.ones(t, dtype=torch.long),
              "lengths": torch.tensor([t]), "position_ids": torch.arange(t)}
    assert set(shift_batch(sample)) == set(sample)
    total, blocks = compute_accepted_length_counts(torch.tensor([[True, False], [True, True]]),
                                                   torch.ones(2, 2, dtype=torch.bool))
    assert (float(total), float(blocks)) == (2.0 + 3.0, 2.0)


def test_a_draft_is_trained_from_the_shards_and_saved_in_speculators_format_with_its_lineage(trained, tiny_dataset):
    from speculators.models.eagle3.core import Eagle3DraftModel

    manifest = json.loads((tiny_dataset / "manifest.json").read_text())
    lineage = read_lineage(trained.path)
    assert lineage.dataset_fingerprint == manifest["fingerprint"]
    assert lineage.steps_done == TINY.steps and len(lineage.losses) == TINY.steps
    # the settings given, and the rest as speculators resolved them (tests/test_train_recipe.py)
    assert trained_with(lineage.settings, TINY) and not trained_with(lineage.settings, TINY.model_copy(update={"lr": 1}))
    assert set(lineage.given) == {"total_seq_len", "ttt_steps"} and lineage.settings.optimizer is not None
    assert all(x > 0 for x in lineage.losses) and lineage.losses[-1] < lineage.losses[0]
    assert lineage.layer_ids == manifest["spec"]["layer_ids"]
    assert lineage.train_samples + lineage.held_out_samples == manifest["totals"]["samples"]
    config = json.loads((trained.path / "config.json").read_text())
    # what vLLM reads to load it as an EAGLE-3 speculator
    assert config["speculators_config"]["algorithm"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == manifest["spec"]["layer_ids"][:-1]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == TINY.ttt_steps
    model = Eagle3DraftModel.from_pretrained(str(trained.path), verifier=str(tiny_dataset.parent / "model"))
    assert model.fc.weight.dtype == torch.bfloat16


def test_the_untrained_draft_is_the_trained_one_before_its_first_step(trained, tiny_dataset, tmp_path):
    from safetensors.torch import load_file

    base = untrained_draft(tiny_dataset, tmp_path / "untrained", verifier=tiny_dataset.parent / "model", settings=TINY)
    assert base.lineage.steps_done == 0 and base.lineage.losses == []
    a, b = load_file(base.path / "model.safetensors"), load_file(trained.path / "model.safetensors")
    assert a.keys() == b.keys()
    assert not torch.equal(a["fc.weight"], b["fc.weight"])  # trained
    again = untrained_draft(tiny_dataset, tmp_path / "again", verifier=tiny_dataset.parent / "model", settings=TINY)
    assert torch.equal(load_file(again.path / "model.safetensors")["fc.weight"], a["fc.weight"])  # seeded


def test_loader_workers_are_spawn_workers_handed_the_dataset_pickled_with_the_same_batches(tiny_dataset, tmp_path):
    """The GPU pool trains with DataLoader workers (speculators' spawn workers): ``--loader-workers``
    reaches the loader, the dataset travels to them pickled, and a dataset so carried hands the trainer
    the batches the training process would have read itself. (That spawn workers hand over the same
    batches is held by tests/reader/test_for_speculators.py: test_batch_buffers_are_reused_once_freed_
    and_never_while_held streams through two of them; one spawn run of the loader in the suite.)"""
    import pickle

    from datagen.reader import open_dataset
    from datagen.reader.for_speculators import SpeculatorsDataset
    from datagen.training.draft import _loader

    data = SpeculatorsDataset(open_dataset(tiny_dataset), max_len=256, train_ratio=0.75, split="train")
    loader = _loader(data, TINY.model_copy(update={"loader_workers": 2}), seed=0)
    assert loader.num_workers == 2 and loader.prefetch_factor == 4 and loader.persistent_workers
    assert loader.multiprocessing_context.get_start_method() == "spawn"

    inline = list(_loader(data, TINY, seed=0))
    carried = list(_loader(pickle.loads(pickle.dumps(data)), TINY, seed=0))
    assert len(carried) == len(inline) > 0
    for a, b in zip(inline, carried):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_an_existing_draft_directory_is_refused_and_left_as_found(tiny_dataset, tmp_path):
    out = tmp_path / "draft"
    out.mkdir()
    (out / "keep").write_text("mine")
    with pytest.raises(OutputConflictError, match="exists"):
        train_draft(tiny_dataset, out, verifier=tiny_dataset.parent / "model", settings=TINY)
    assert [p.name for p in out.iterdir()] == ["keep"]


def test_a_dataset_of_another_model_is_refused_before_training(tmp_path, tiny_dataset, capsys):
    ds = make_synthetic_dataset(tmp_path / "ds", rows=8, layer_ids=(1, 2, 4), num_hidden_layers=4, hidden=64)
    code = cli.main(["train", str(ds), "--out", str(tmp_path / "draft"), "--model", str(tiny_dataset.parent / "model"),
                     "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "is not the dataset's" in err and "--model" in err
    assert not (tmp_path / "draft").exists() and not list(tmp_path.glob(".draft.*"))


def test_an_empty_training_split_is_refused(tiny_dataset, tmp_path):
    with pytest.raises(SpecError, match="train split .* is empty"):
        train_draft(tiny_dataset, tmp_path / "d", verifier=tiny_dataset.parent / "model",
                    settings=TINY.model_copy(update={"train_ratio": 0.01}))
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_the_draft_is_fed_the_targets_own_states_so_a_mislabelled_dataset_is_caught(trained, tiny_dataset, tmp_path):
    """measure-draft feeds the draft the target's states at the layers its config names (what vLLM
    feeds it), not the dataset's: the stored states of a correct dataset match the target's within
    bf16 rounding, those of a dataset whose layers are mislabelled are far off, and a draft measured
    on target states differs from the same draft fed states of other layers."""
    import shutil

    from datagen.training.agreement import Features, TargetStates, draft_layer_ids

    target = TargetStates(tiny_dataset.parent / "model")
    right = measure_agreement(trained.path, tiny_dataset, target=target)
    layers = draft_layer_ids(trained.path)
    assert right.features is Features.TARGET and [e.layer for e in right.feature_error] == [*layers, 4]
    assert all(e.median < 0.01 for e in right.feature_error), right.feature_error
    stored = measure_agreement(trained.path, tiny_dataset, features=Features.DATASET)
    assert stored.feature_error == [] and stored.held_out_samples == right.held_out_samples

    # a dataset whose states of layers 0 and 2 are stored under each other's ids (a capture that
    # mislabelled them): judged on its own states, a draft cannot tell; the target's states show it
    swapped = copy_dataset(tiny_dataset, tmp_path / "swapped")
    for k in range(len(manifest(swapped)["shards"])):
        rewrite_shard(swapped, k, lambda t: {**t, "hidden_states": t["hidden_states"][:, [1, 0, 2]]})
    fix_checksums(swapped)
    mis = measure_agreement(trained.path, swapped, target=target)
    errors = {e.layer: e.median for e in mis.feature_error}
    assert errors[layers[0]] > 0.3 and errors[layers[1]] > 0.3 and errors[4] < 0.01, errors
    assert mis.positions == right.positions  # the draft is fed the target's states either way


def test_the_held_out_agreement_is_measured_per_position(trained, tiny_dataset, capsys):
    report = measure_agreement(trained.path, tiny_dataset)
    assert report.held_out_samples == trained.lineage.held_out_samples
    assert [p.position for p in report.positions] == [1, 2]
    assert all(0.0 <= p.agreement <= 1.0 and p.slots > 0 for p in report.positions)
    assert report.positions[0].agreement == report.positions[0].conditional
    assert 1.0 <= report.acceptance_length <= 1.0 + TINY.ttt_steps
    # the step prints the same figures as its result
    assert cli.main(["measure-draft", str(trained.path), str(tiny_dataset)]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith(cli.RESULT_PREFIX)][-1]
    result = json.loads(line[len(cli.RESULT_PREFIX):])
    assert result["acceptance_length"] == pytest.approx(report.acceptance_length)
    assert result["trained_on"] == trained.lineage.dataset_fingerprint and result["spec_decode"] is None


def _night(label: str, acceptance: float) -> NightMeasurement:
    return NightMeasurement(label=label, dataset=f"/data/{label}", fingerprint=label * 8,
                            agreement=(0.5, 0.3, 0.2), acceptance_length=acceptance, spec_decode_acceptance=None)


def test_a_night_whose_acceptance_falls_beyond_the_threshold_is_a_drop():
    nights = [_night("a", 2.0), _night("b", 1.95)]
    assert drop_of(nights[:1]) is None
    assert not drop_of(nights, threshold=0.1).failed
    bad = drop_of(nights + [_night("c", 1.7)], threshold=0.1)
    assert bad.failed and bad.fall == pytest.approx(0.25 / 1.95)
    assert "DROP" in markdown_table(nights + [_night("c", 1.7)], bad)
    assert plot(nights, bad).startswith(b"\x89PNG")
    again = NightMeasurement.from_rows(nights[0].to_rows())
    assert again == nights[0]


def test_a_lineage_less_directory_is_not_a_draft(tmp_path):
    from datagen.errors import ModelError

    with pytest.raises(ModelError, match=LINEAGE_NAME):
        read_lineage(tmp_path)
