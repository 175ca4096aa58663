"""The handoff proves the data on a real trained target, in miniature: SmolLM2-135M-Instruct answers
prompts itself (`datagen regenerate`), its states are extracted at the EAGLE-3 layers and at wrong ones
(the low layers 1-3), and a draft trained with speculators' trainer on the right states agrees with the
target's greedy tokens on held-out rows more often than the untrained draft, while a draft trained on
the wrong states labelled with the right layers (what a mislabelled capture hands training) is told
apart: every draft is fed the target's own states of the layers its config names, as vLLM feeds it
(judged on its own dataset's states instead, the wrong draft looks better still), and the wrong
dataset's stored states are far from the target's at those layers. At this size agreement alone does
not rank the wrong draft below the right one (see the test). The full comparison, with the off-by-one
layers, fp8 storage and several seeds, is `make bench` (bench/train_proof.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from filelock import FileLock

from datagen.training.agreement import Features, TargetStates, measure_agreement
from datagen.training.draft import train_draft, untrained_draft
from datagen.training.settings import DraftSettings

ROOT = Path(__file__).resolve().parents[1]
ROWS, NEW_TOKENS = 16, 24
# the wrong layers: the low layers' states under the EAGLE-3 ids (bench/train_proof.py measures the
# subtler off-by-one at a training budget this test cannot afford)
RIGHT, WRONG = (2, 15, 27, 30), (1, 2, 3, 30)
SETTINGS = DraftSettings(steps=16, total_seq_len=256, draft_vocab_size=1024, ttt_steps=2, train_ratio=0.75, lr=3e-3)
# the chats are SmolLM2's own replies (`datagen regenerate`: a vLLM engine, where .cache lacks them), and
# one test captures with vLLM
pytestmark = pytest.mark.engine


def self_generated_chats(model: Path) -> Path:
    """The model's own greedy replies to ROWS prompts (`datagen regenerate`), generated once per machine
    (like the checkpoint)."""
    from datagen.testmodels import smollm2
    from datagen.training.selfchat import write_self_generated_chats

    out = ROOT / ".cache" / f"smollm2-{smollm2.version()}-regenerated-{ROWS}x{NEW_TOKENS}"
    with FileLock(str(out) + ".lock"):
        return write_self_generated_chats(model, out, rows=ROWS, max_new_tokens=NEW_TOKENS)


def _extract(model: Path, chats: Path, out: Path, layer_ids) -> Path:
    from datagen.specs.extraction import parse_spec
    from datagen.extraction.run import extract

    # float32 compute (the reference engine in bf16 was five times slower here), bf16 storage
    extract(parse_spec({"model": str(model), "dataset": str(chats), "out": str(out), "samples_per_shard": 8,
                                "layer_ids": list(layer_ids),
                                "engine": {"name": "hf", "dtype": "float32", "storage_dtype": "bfloat16"}}))
    return out


@pytest.fixture(scope="module")
def datasets(smollm2, tmp_path_factory):
    base = tmp_path_factory.mktemp("smollm2-train")
    chats = self_generated_chats(smollm2)
    return {"right": _extract(smollm2, chats, base / "right", RIGHT), "wrong": _extract(smollm2, chats, base / "wrong", WRONG),
            "base": base}


def test_chats_are_the_targets_own_greedy_replies(smollm2, datasets):
    rows = [json.loads(x) for x in self_generated_chats(smollm2).read_text().splitlines()]
    assert len(rows) == ROWS and len({r["messages"][0]["content"] for r in rows}) == ROWS
    assert all(r["messages"][1]["role"] == "assistant" and r["messages"][1]["content"] for r in rows)


# On a CPU without bf16 kernels (an AMD EPYC without AVX-512) the drafts train in float32 with AdamW
# (recipe.cpu_defaults). With speculators' bf16 and Muon there this test took 955.7 s alone, past the 900 s
# default timeout (Muon's bf16 step was 24 s of each 24.3 s step); now 40.1 s alone, 15.4 s of it the test's
# own call (docs/performance.md 10i).
def test_a_trained_draft_beats_the_untrained_one_and_a_mislabelled_dataset_is_told_apart(smollm2, datasets):
    base = datasets["base"]
    trained = train_draft(datasets["right"], base / "trained", verifier=smollm2, settings=SETTINGS)
    untrained = untrained_draft(datasets["right"], base / "untrained", verifier=smollm2, settings=SETTINGS)
    wrong = train_draft(datasets["wrong"], base / "wrong-draft", verifier=smollm2, settings=SETTINGS)
    config = wrong.path / "config.json"
    raw = json.loads(config.read_text())
    assert raw["eagle_aux_hidden_state_layer_ids"] == list(WRONG[:-1])
    raw["eagle_aux_hidden_state_layer_ids"] = list(RIGHT[:-1])  # the mislabelled capture's draft
    config.write_text(json.dumps(raw))

    target = TargetStates(smollm2)  # the target's own states of the held-out rows (what vLLM feeds a draft)
    got = {name: measure_agreement(d.path, datasets["right"], target=target)
           for name, d in {"trained": trained, "untrained": untrained, "wrong": wrong}.items()}
    first = {name: r.positions[0].agreement for name, r in got.items()}
    assert got["trained"].held_out_samples == ROWS - int(ROWS * SETTINGS.train_ratio)
    assert first["trained"] > first["untrained"] + 0.02, first
    # At this size (4 held-out rows, about 100 slots, 16 steps) agreement does not rank the wrong draft
    # below the right one (measured: 0.135 against 0.067 at position 1, docs/performance.md): a 16-step
    # draft has mostly learnt which token follows which. What tells its dataset apart is below.
    assert got["trained"].acceptance_length > got["untrained"].acceptance_length
    assert trained.lineage.losses[-1] < trained.lineage.losses[0]
    # Agreement does not tell the mislabelled dataset apart at this size, on the target's states nor on
    # its own: the numbers are a few slots of about 100 apart and their order depends on the chats this
    # CPU's vLLM wrote (the wrong draft on its own states: 0.137 against the right draft's 0.126 on an
    # Intel CPU with AMX, 0.049 against 0.078 on an AMD EPYC), so no order of them is asserted. What
    # tells its dataset apart is below: its stored states against the target's, at the layers its
    # config names.
    own = measure_agreement(wrong.path, datasets["wrong"], features=Features.DATASET)
    print(f"agreement@1: trained {first['trained']:.3f}, untrained {first['untrained']:.3f}, wrong on the "
          f"target's states {first['wrong']:.3f}, wrong on its own {own.positions[0].agreement:.3f}")
    errors = {e.layer: e.median for e in measure_agreement(wrong.path, datasets["wrong"], target=target).feature_error}
    assert min(errors[k] for k in RIGHT[:-1]) > 0.2 and errors[RIGHT[-1]] < 0.03, errors
    shutil.rmtree(base / "untrained")


def test_the_vllm_capture_of_the_real_model_matches_its_float32_reference_layer_by_layer(smollm2, datasets, tmp_path):
    """The data the drafts train on, from the production engine: vLLM (bf16, CPU) captures SmolLM2's
    states of the same chats within bf16 rounding of transformers in float32 (the `right` dataset),
    per layer by the median and the 99th percentile of the token errors, while the neighbouring layers
    (the `wrong` dataset's 1 and 3 around 2) are far away: an off-by-one capture fails here."""
    import torch

    from datagen.specs.extraction import parse_spec
    from datagen.extraction.run import extract
    from datagen.reader import open_dataset

    out = tmp_path / "vllm"
    extract(parse_spec({"model": str(smollm2), "dataset": str(self_generated_chats(smollm2)), "out": str(out),
                        "samples_per_shard": 8, "layer_ids": list(RIGHT), "engine": {"name": "vllm"}}))
    got, ref, wrong = (open_dataset(str(d), dtype=torch.float32) for d in (out, datasets["right"], datasets["wrong"]))
    errors: dict[str, list[torch.Tensor]] = {}
    for i in range(len(ref)):
        g, r, w = got[i], ref[i], wrong[i]
        assert torch.equal(g.input_ids, r.input_ids) and torch.equal(g.loss_mask, r.loss_mask)
        norm = r.hidden_states.norm(dim=-1)  # [T, L]
        err = (g.hidden_states - r.hidden_states).norm(dim=-1) / norm
        for j, layer in enumerate(RIGHT):
            errors.setdefault(f"layer {layer}", []).append(err[:, j])
        for j, neighbour in ((0, 1), (2, 3)):  # the wrong dataset's layers 1 and 3, beside layer 2
            errors.setdefault(f"2 vs {neighbour}", []).append(
                (g.hidden_states[:, 0] - w.hidden_states[:, j]).norm(dim=-1) / w.hidden_states[:, j].norm(dim=-1))
    stats = {k: (torch.cat(v).median().item(), torch.cat(v).quantile(0.99).item()) for k, v in errors.items()}
    for layer in RIGHT:
        median, p99 = stats[f"layer {layer}"]
        assert median < 0.03 and p99 < 0.15, stats
    for neighbour in (1, 3):
        assert stats[f"2 vs {neighbour}"][0] > 10 * stats["layer 2"][0], stats
