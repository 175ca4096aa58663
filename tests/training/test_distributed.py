"""`torchrun --nproc-per-node 2 -m datagen train ... --device cpu`: ONE draft trained data-parallel by two
gloo processes through speculators' own DDP wrapping and per-rank multipack sampler
(``datagen.training.distributed``), on the tiny model's dataset (tests/support/extracted.py); a bad
launch refused with the project's error."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from datagen import cli
from datagen.errors import CannotRunHereError
from datagen.training.distributed import SPECULATORS_STATE, data_parallel
from datagen.training.draft import read_lineage, train_draft
from datagen.training.settings import Device, DraftSettings
from tests.support.extracted import extracted_dataset

ROOT = Path(__file__).resolve().parents[2]
# one packed batch of 256 tokens per rank and step; a draft vocabulary, so the mapping is built on every rank
SETTINGS = DraftSettings(total_seq_len=256, train_ratio=0.75, ttt_steps=2, draft_vocab_size=64, seed=0)


@pytest.fixture(scope="module")
def dist_dataset(tmp_path_factory):
    return extracted_dataset(tmp_path_factory)


def _train_data(dataset):
    from datagen.reader import open_dataset
    from datagen.reader.for_speculators import SpeculatorsDataset

    return SpeculatorsDataset(open_dataset(dataset), max_len=SETTINGS.total_seq_len,
                              train_ratio=SETTINGS.train_ratio, split="train")


def _rank_batches(data, *, ranks: int, rank: int) -> list[list[int]]:
    """The sample indices of each batch rank ``rank`` of ``ranks`` reads in epoch 0: speculators'
    sampler as its ``_setup_dataloader`` builds it."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=SETTINGS.total_seq_len,
                                                 lengths=data.approx_lengths, num_replicas=ranks, rank=rank,
                                                 seed=SETTINGS.seed)
    return [[int(i) for i in b] for b in sampler]


def test_the_speculators_topology_state_the_cpu_path_sets_is_unchanged():
    """The CPU path fills speculators' topology module as its ``maybe_setup_distributed`` does
    (read from 0.9.0); a release that renames that state fails here."""
    import inspect

    from speculators.train import distributed as spec_dist

    assert all(hasattr(spec_dist, name) for name in SPECULATORS_STATE)
    assert list(inspect.signature(spec_dist._init_sp_process_groups).parameters) == ["rank", "world_size", "sp_size"]
    assert {"maybe_setup_distributed", "maybe_destroy_distributed", "get_dp_rank", "get_dp_size"} <= set(vars(spec_dist))


def test_speculators_sampler_splits_each_packed_batch_between_the_ranks(dist_dataset):
    """What the two-process run relies on: with the same seed every rank shuffles the samples alike, and
    each step's packed samples are split between the ranks (each rank's share fits one batch), so the
    ranks together read every sample once per epoch in about half the steps of one process (only a
    tail of fewer samples than ranks is dropped)."""
    data = _train_data(dist_dataset)
    one = _rank_batches(data, ranks=1, rank=0)
    r0, r1 = _rank_batches(data, ranks=2, rank=0), _rank_batches(data, ranks=2, rank=1)
    seen = [i for b in r0 + r1 for i in b]
    assert len(r0) == len(r1) and len(seen) == len(set(seen))  # each sample at most once
    assert len(data) - len(seen) < 2  # the dropped tail: fewer samples than ranks
    assert sorted(i for b in one for i in b) == list(range(len(data)))
    assert len(r0) <= math.ceil(len(one) / 2) + 1 < len(one)


@pytest.mark.slow
def test_two_cpu_processes_train_one_draft_each_rank_reading_half_the_batches(dist_dataset, tmp_path):
    data = _train_data(dist_dataset)
    one = _rank_batches(data, ranks=1, rank=0)
    two = _rank_batches(data, ranks=2, rank=0)
    model = dist_dataset.parent / "model"
    out = tmp_path / "draft"
    # one epoch of the two-process run: its own steps per epoch
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "datagen",
         "train", str(dist_dataset), "--out", str(out), "--model", str(model), "--steps", str(len(two)),
         "--total-seq-len", str(SETTINGS.total_seq_len), "--train-ratio", str(SETTINGS.train_ratio),
         "--ttt-steps", str(SETTINGS.ttt_steps), "--draft-vocab-size", str(SETTINGS.draft_vocab_size),
         "--seed", str(SETTINGS.seed), "--device", "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    # one draft, written once (rank 0), no temporary sibling left; both ranks report it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]
    results = [json.loads(x[len(cli.RESULT_PREFIX):]) for x in proc.stdout.splitlines()
               if x.startswith(cli.RESULT_PREFIX)]
    assert len(results) == 2 and results[0] == results[1] and results[0]["draft"] == str(out.resolve())
    assert results[0]["world_size"] == 2
    two_proc = read_lineage(out)
    assert two_proc.world_size == 2 and two_proc.steps_done == len(two) == two_proc.steps_per_epoch
    assert len(two_proc.losses) == len(two) and all(math.isfinite(x) for x in two_proc.losses)
    assert two_proc.losses[-1] < two_proc.losses[0]

    # the same global data in one process: one epoch is twice the steps, the same tokens
    one_proc = train_draft(dist_dataset, tmp_path / "one", verifier=model,
                           settings=SETTINGS.model_copy(update={"steps": len(one)})).lineage
    assert one_proc.world_size == 1 and one_proc.steps_per_epoch == len(one)
    assert two_proc.steps_per_epoch < one_proc.steps_per_epoch
    # each training sample once across the two ranks (no tail dropped on this dataset)
    assert len({i for b in two for i in b} | {i for b in _rank_batches(data, ranks=2, rank=1) for i in b}) == len(data)
    assert two_proc.tokens_trained == one_proc.tokens_trained > 0

    # every rank built the same vocabulary mapping (rank 0's is saved; it is the one-process run's)
    from safetensors.torch import load_file

    a, b = load_file(out / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    assert torch.equal(a["d2t"], b["d2t"]) and torch.equal(a["t2d"], b["t2d"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a CUDA device")
def test_cuda_without_a_gpu_is_refused_with_the_projects_error(dist_dataset, tmp_path, capsys):
    code = cli.main(["train", str(dist_dataset), "--out", str(tmp_path / "d"), "--model",
                     str(dist_dataset.parent / "model"), "--steps", "1", "--device", "cuda"])
    err = capsys.readouterr().err
    assert code == CannotRunHereError.exit_code and "sees no CUDA device" in err and "--device cpu" in err
    assert "Traceback" not in err and not (tmp_path / "d").exists()


def test_a_launch_whose_process_group_cannot_form_is_refused_with_the_projects_error(monkeypatch):
    """Started as by torchrun (its run id set) without the rendezvous it sets up: gloo cannot form the group."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "broken")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(CannotRunHereError, match="cannot form the cpu training process group") as e:
        with data_parallel(Device.CPU):
            pass
    assert "--nproc-per-node" in str(e.value) and e.value.__cause__ is not None
    import torch.distributed as dist

    assert not dist.is_initialized()
