"""The capture path's choice and the public path's pieces without an engine: the path and runner a
run takes, a request's states read back out of the hidden-states cache layout vLLM's cache-only
layer writes, and whole requests giving the same shard files as chunked steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from datagen.data.contract import ShardFormat
from datagen.specs.extraction import EngineName
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


# release, TP, architecture, DATAGEN_CAPTURE_RUNNER_V2 -> runner, V1 pinned, what the why names
RUNNER_TABLE = [
    (CUDA_VLLM_RELEASE, 1, "LlamaForCausalLM", None, "auto", False, "the V2 capture is verified for vLLM 0.24.0, TP1"),
    (CUDA_VLLM_RELEASE, 2, "LlamaForCausalLM", None, "v1", True, "not verified for vLLM 0.24.0, TP2, LlamaForCausalLM"),
    (CUDA_VLLM_RELEASE, 1, "DeepseekV3ForCausalLM", None, "v1", True, "not verified for vLLM 0.24.0, TP1, Deepseek"),
    (CUDA_VLLM_RELEASE, 1, "KimiK25ForConditionalGeneration", None, "v1", True, "not verified"),
    ("0.99.0", 1, "LlamaForCausalLM", None, "v1", True, "not verified for vLLM 0.99.0"),
    (CPU_VLLM_RELEASE, 1, "LlamaForCausalLM", None, "v1", True, "not verified for vLLM 0.32.0"),  # a CUDA 0.32
    (CUDA_VLLM_RELEASE, 1, None, None, "v1", True, "architecture not given"),
    (CUDA_VLLM_RELEASE, 1, "LlamaForCausalLM", "0", "v1", True, "DATAGEN_CAPTURE_RUNNER_V2=0 pins V1"),
    (CUDA_VLLM_RELEASE, 2, "DeepseekV3ForCausalLM", "1", "auto", False, "NOT verified"),
    ("0.99.0", 1, "LlamaForCausalLM", "1", "auto", False, "DATAGEN_CAPTURE_RUNNER_V2=1 allows the V2 capture"),
    (CUDA_VLLM_RELEASE, 1, "LlamaForCausalLM", "1", "auto", False, "verified for vLLM 0.24.0, TP1, LlamaForCausalLM"),
]


@pytest.mark.parametrize("version,tp,arch,asked,runner,pinned,why", RUNNER_TABLE)
def test_the_internal_capture_takes_vllms_runner_only_where_the_v2_capture_is_verified(version, tp, arch, asked,
                                                                                       runner, pinned, why):
    env = {} if asked is None else {"DATAGEN_CAPTURE_RUNNER_V2": asked}
    choice = capture_paths.runner_choice(version, "internal", cpu_build=False, tensor_parallel_size=tp,
                                         architecture=arch, environ=env)
    assert (choice.runner, choice.pin_v1, choice.v2_capture) == (runner, pinned, not pinned)
    assert why in choice.why and ("patch pin-v1-model-runner" in choice.why) == pinned
    assert choice.unverified_v2 == (asked == "1" and "NOT verified" in choice.why)
    assert capture_paths.model_runner(version, "internal", cpu_build=False, tensor_parallel_size=tp,
                                      architecture=arch, environ=env) == runner
    # VLLM_USE_V2_MODEL_RUNNER=1 runs V2 where V1 is not pinned, and is refused where it is
    forced = capture_paths.runner_choice(version, "internal", cpu_build=False, tensor_parallel_size=tp,
                                         architecture=arch, environ={**env, "VLLM_USE_V2_MODEL_RUNNER": "1"})
    assert (forced.runner, bool(forced.refused)) == (("v1", True) if pinned else ("v2", False))
    # the CPU build runs V1 whatever the table says (its V2 runner needs Triton)
    cpu = capture_paths.runner_choice(version, "internal", cpu_build=True, tensor_parallel_size=tp,
                                      architecture=arch, environ=env)
    assert (cpu.runner, cpu.pin_v1, cpu.refused) == ("v1", False, None) and "Triton" in cpu.why


def test_the_verified_table_names_what_was_run_and_where():
    from datagen.engines.releases import V2_CAPTURE_VERIFIED

    assert list(V2_CAPTURE_VERIFIED) == [(CUDA_VLLM_RELEASE, 1, "LlamaForCausalLM")]
    assert V2_CAPTURE_VERIFIED[(CUDA_VLLM_RELEASE, 1, "LlamaForCausalLM")].startswith(
        "H200, bench/gpu/v2.py, 2026-12-03")
    d = capture_paths.describe(CUDA_VLLM_RELEASE, cpu_build=False, tensor_parallel_size=1,
                               architecture="LlamaForCausalLM", environ={})
    assert d["model_runner"] == "auto" and "H200, bench/gpu/v2.py, 2026-12-03" in d["why"] and "refused" not in d


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
        cfg = CaptureConfig(shard=ShardFormat(LAYERS, storage, H), dtype="bfloat16", max_tokens=BUDGET, writers=2,
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
    cap = Capture(runner, CaptureConfig(shard=ShardFormat(LAYERS, "bfloat16", H), dtype="bfloat16",
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


def test_env_check_fails_the_v1_pin_where_the_runs_own_runner_choice_refuses_v2():
    """VLLM_USE_V2_MODEL_RUNNER=1 on 0.24.0 passes the model-blind self-test (V2 is verified for some
    runs of it), but the run's TP and architecture pin V1: env-check fails the pin, with the reason."""
    from datagen.envcheck.engine import check_engine_patches
    from datagen.envcheck.report import Status
    from tests.test_env_check import spec_for

    forced = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    engine = capture_paths.describe(CUDA_VLLM_RELEASE, cpu_build=False, tensor_parallel_size=2,
                                    architecture="LlamaForCausalLM", environ=forced)
    result = check_engine_patches(spec_for("/m", "/o"), True, engine)
    assert result.status is Status.FAILED
    assert "pin-v1-model-runner: failed: VLLM_USE_V2_MODEL_RUNNER=1, but the V2 capture is not verified for " \
           "vLLM 0.24.0, TP2, LlamaForCausalLM" in result.detail
    engine = capture_paths.describe(CUDA_VLLM_RELEASE, cpu_build=False, tensor_parallel_size=1,
                                    architecture="LlamaForCausalLM", environ=forced)
    assert "refused" not in engine and engine["model_runner"] == "v2"
    assert check_engine_patches(spec_for("/m", "/o"), True, engine).status is Status.OK


@pytest.mark.parametrize("tp, arch, runner", [(1, "LlamaForCausalLM", "auto"), (2, "LlamaForCausalLM", "v1"),
                                              (1, "DeepseekV3ForCausalLM", "v1")])
def test_the_plans_engine_record_names_the_runner_the_engine_will_take(monkeypatch, tp, arch, runner):
    from datagen.engines import patches, vllm_attention
    from datagen.extraction.plan import describe_engine

    monkeypatch.delenv("DATAGEN_CAPTURE_RUNNER_V2", raising=False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.delenv("DATAGEN_CAPTURE_PATH", raising=False)
    monkeypatch.setattr(patches, "check_vllm_version", lambda: CUDA_VLLM_RELEASE)
    monkeypatch.setattr(vllm_attention, "is_cpu_build", lambda: False)
    monkeypatch.setattr(vllm_attention, "choose_attention_backend", lambda info, mla: None)
    spec = SimpleNamespace(engine=SimpleNamespace(name=EngineName.VLLM, tensor_parallel_size=tp, mla_backend=None))
    rec = describe_engine(spec, SimpleNamespace(architecture=arch))
    assert (rec["capture_path"], rec["model_runner"]) == ("internal", runner)
