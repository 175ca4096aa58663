"""The capture path's choice and the public path's pieces without an engine: the path and runner a
run takes, a request's states read back out of the hidden-states cache layout vLLM's cache-only
layer writes, and whole requests giving the same shard files as chunked steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from datagen.engines import capture_paths
from datagen.engines.capture import Capture
from datagen.engines.capture_paths import runner_version
from datagen.engines.releases import CPU_VLLM_RELEASE, CUDA_VLLM_RELEASE
from datagen.engines.vllm_settings import CaptureConfig
from datagen.errors import EngineSettingError
from tests.test_capture import BUDGET, H, LAYERS, _group, _steps


def test_a_verified_release_takes_the_internal_path_unless_the_setting_says_public():
    assert capture_paths.choose_path(CPU_VLLM_RELEASE, {}) == "internal"
    assert capture_paths.choose_path(CUDA_VLLM_RELEASE, {}) == "internal"
    assert capture_paths.choose_path(CPU_VLLM_RELEASE, {"DATAGEN_CAPTURE_PATH": "public"}) == "public"
    assert capture_paths.choose_path("0.99.0", {}) == "public"
    with pytest.raises(EngineSettingError, match="not a capture path"):
        capture_paths.choose_path(CPU_VLLM_RELEASE, {"DATAGEN_CAPTURE_PATH": "v2"})


def test_the_model_runner_a_run_takes():
    assert capture_paths.model_runner(CPU_VLLM_RELEASE, "public", cpu_build=True, environ={}) == "v1"
    assert capture_paths.model_runner("0.99.0", "internal", cpu_build=False, environ={}) == "v1"
    # 0.24.0's V2 refuses extract_hidden_states: vLLM falls back to V1
    assert capture_paths.model_runner(CUDA_VLLM_RELEASE, "public", cpu_build=False, environ={}) == "v1"
    assert capture_paths.model_runner("0.99.0", "public", cpu_build=False, environ={}) == "auto"
    assert capture_paths.model_runner("0.99.0", "public", cpu_build=False,
                                      environ={"VLLM_USE_V2_MODEL_RUNNER": "1"}) == "v2"
    d = capture_paths.describe(CPU_VLLM_RELEASE, cpu_build=True, environ={})
    assert d["capture_path"] == "internal" and d["model_runner"] == "v1" and "Triton" in d["why"]
    assert "refuses" in capture_paths.describe("0.99.0", cpu_build=False, environ={})["why"]


def test_runner_classes_are_named_by_their_runner():
    assert runner_version("vllm.v1.worker.cpu_model_runner.CPUModelRunner") == "v1"
    assert runner_version("vllm.v1.worker.gpu_model_runner.GPUModelRunner") == "v1"
    assert runner_version("vllm.v1.worker.gpu.model_runner.GPUModelRunner") == "v2"
    assert runner_version("vllm.v1.worker.cpu.model_runner.CPUModelRunner") == "v2"


def test_a_requests_states_come_back_out_of_its_blocks():
    from vllm.model_executor.models.extract_hidden_states import basic_cache

    from datagen.engines.public_capture import read_states

    L, bs, blocks = 3, 4, 8
    kv = torch.zeros(blocks, L, bs, H, dtype=torch.bfloat16)
    x = torch.randn(10, L, H).to(torch.bfloat16)
    block_ids = [5, 2, 7]  # 10 tokens: blocks 5 and 2 full, 2 tokens in block 7
    slots = torch.tensor([block_ids[t // bs] * bs + t % bs for t in range(10)])
    basic_cache(x[:6], kv, slots[:6])  # two steps (chunked prefill), as the drafter writes them
    basic_cache(x[6:], kv, slots[6:])
    assert torch.equal(read_states(kv, block_ids, bs, 10), x)
    assert not torch.equal(read_states(kv, [5, 7, 2], bs, 10), x)


@pytest.mark.parametrize("storage", ["bfloat16", "fp8_e4m3"])
def test_whole_requests_write_the_same_shard_files_as_chunked_steps(tmp_path, storage):
    files = {}
    for how in ("steps", "requests"):
        out = tmp_path / how
        out.mkdir()
        torch.manual_seed(0)  # the same states for both
        ids, states, rids, wires = _group(out, storage)
        runner = SimpleNamespace(device=torch.device("cpu"), input_batch=SimpleNamespace(req_ids=[]),
                                 requests={f"{r}-abcd1234": SimpleNamespace(prompt_token_ids=x.tolist())
                                           for r, x in zip(rids, ids)})
        cfg = CaptureConfig(layer_ids=LAYERS, dtype="bfloat16", storage_dtype=storage, max_tokens=BUDGET, writers=2,
                            path="internal" if how == "steps" else "public")
        cap = Capture(runner, cfg, H)
        cap.announce([dict(w) for w in wires])
        if how == "steps":
            for req, so, aux in _steps(rids, states):
                runner.input_batch.req_ids = req
                cap.on_step(so, aux)
        else:
            for r, s in reversed(list(zip(rids, states))):  # finished in any order
                cap.on_request(f"{r}-abcd1234", s)
        reply = cap.collect(True)
        assert not reply.errors and reply.pending_shards == ()
        files[how] = {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.safetensors"))}
    assert len(files["steps"]) == 4 and files["steps"] == files["requests"]


def test_a_request_whose_prompt_differs_from_its_row_is_refused(tmp_path):
    ids, states, rids, wires = _group(tmp_path, "bfloat16")
    runner = SimpleNamespace(device=torch.device("cpu"), input_batch=None,
                             requests={f"{rids[0]}-abcd1234": SimpleNamespace(prompt_token_ids=[1, 2])})
    cap = Capture(runner, CaptureConfig(layer_ids=LAYERS, dtype="bfloat16", storage_dtype="bfloat16",
                                        max_tokens=BUDGET, writers=1), H)
    cap.announce([dict(w) for w in wires])
    with pytest.raises(RuntimeError, match="prompt tokens differ"):
        cap.on_request(f"{rids[0]}-abcd1234", states[0])
    with pytest.raises(RuntimeError, match="aux states for layers"):
        cap.on_request(f"{rids[1]}-abcd1234", states[1][:, :2])


@pytest.mark.slow
def test_env_check_names_the_path_and_runner_on_this_vllm(monkeypatch):
    from datagen.envcheck import engine as envcheck_engine

    monkeypatch.delenv("DATAGEN_CAPTURE_PATH", raising=False)
    engine = envcheck_engine._engine_path()
    assert engine["vllm"] == CPU_VLLM_RELEASE
    assert engine["capture_path"] == "internal" and engine["model_runner"] == "v1"
    monkeypatch.setenv("DATAGEN_CAPTURE_PATH", "public")
    assert envcheck_engine._engine_path()["capture_path"] == "public"
    assert envcheck_engine._public_self_test() == "ok"
