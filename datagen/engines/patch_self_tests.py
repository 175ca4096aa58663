"""The self-tests of the patches that reach vLLM's interfaces (engine arguments, the model runner's
load and execute_model_state, engine-core request ids, the V1 runner pin): each inspects the
installed vLLM without starting an engine, raises AssertionError with the reason when the patch no
longer holds, and returns why the patch is deliberately not applied here (else None).

The table that names each patch with its versions and self-test is ``datagen.engines.patches``;
the code patch deepseek-final-layer-aux keeps its self-test beside its code there.
"""

from __future__ import annotations

import dataclasses
import inspect
import os

from datagen import settings


def engine_args_self_test() -> None:
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for name in ("async_scheduling", "enable_prefix_caching", "worker_extension_cls", "additional_config",
                 "enable_chunked_prefill", "max_num_batched_tokens", "scheduler_cls"):
        assert name in fields, f"EngineArgs has no {name}"


def window_scheduler_self_test() -> None:
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.core.sched.scheduler import Scheduler

    for name in ("add_request", "schedule", "finish_requests", "get_num_unfinished_requests"):
        assert hasattr(Scheduler, name), f"Scheduler has no {name}"
    assert "PAUSED_ALL" in inspect.getsource(Scheduler.schedule), "Scheduler.schedule no longer honours PAUSED_ALL"
    assert PauseState.PAUSED_ALL.name in inspect.getsource(Scheduler.get_num_unfinished_requests), \
        "Scheduler.get_num_unfinished_requests no longer counts nothing while PAUSED_ALL"
    init = inspect.getsource(Scheduler.__init__)
    for name in ("self.max_num_scheduled_tokens", "self.waiting", "self._pause_state"):
        assert name in init, f"Scheduler has no {name}"


def capture_on_load_self_test() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert hasattr(GPUModelRunner, "load_model"), "GPUModelRunner.load_model is gone"
    src = inspect.getsource(GPUModelRunner)
    assert "use_aux_hidden_state_outputs" in src, "the runner no longer has use_aux_hidden_state_outputs"
    from vllm.model_executor.models.interfaces import supports_eagle3  # noqa: F401


def execute_model_state_self_test() -> None:
    from vllm.v1.worker import gpu_model_runner as m

    state_cls = getattr(m, "ExecuteModelState", None)
    assert state_cls is not None, "ExecuteModelState is gone"
    names = getattr(state_cls, "_fields", None) or [f.name for f in dataclasses.fields(state_cls)]
    for f in ("scheduler_output", "aux_hidden_states"):
        assert f in names, f"ExecuteModelState has no {f}"
    src = inspect.getsource(m.GPUModelRunner.sample_tokens)
    assert "execute_model_state" in src, "sample_tokens no longer reads execute_model_state"


def request_ids_self_test() -> None:
    # 0.32 makes the engine-core id "<external id>-<8 random chars>"; older releases keep the
    # external id. The worker accepts both: an exact match or the external id plus one suffix.
    from vllm.v1.engine import EngineCoreRequest

    assert "request_id" in EngineCoreRequest.__struct_fields__, "EngineCoreRequest has no request_id"


def v1_runner_pin_self_test() -> str | None:
    """The pin's mechanism, and VLLM_USE_V2_MODEL_RUNNER=1 refused where this release pins V1 for every
    run. Where the V2 capture is verified for some runs of this release (releases.V2_CAPTURE_VERIFIED),
    whether V1 is pinned depends on the run's TP and architecture: env-check's engine record says
    (capture_paths.runner_choice), and fails the pin there."""
    import vllm
    from vllm import envs

    from datagen.engines.releases import V2_CAPTURE_VERIFIED

    if not hasattr(envs, "VLLM_USE_V2_MODEL_RUNNER") or not on_cuda():
        return None
    forced = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0")
    asked = settings.capture_runner_v2()
    verified = [f"TP{tp} {arch}" for v, tp, arch in V2_CAPTURE_VERIFIED if v == vllm.__version__.split("+")[0]]
    if asked:
        # the engine leaves the runner to vLLM (VllmEngine.start): the capture reads V2's state too
        runner = "VLLM_USE_V2_MODEL_RUNNER=1 runs V2" if forced == "1" else "vLLM picks the runner"
        return (f"DATAGEN_CAPTURE_RUNNER_V2=1 chose the V2 capture (datagen.engines.capture_v2; verified on this "
                f"release for {', '.join(verified) or 'no run'}, a warning elsewhere), so V1 is not pinned; {runner}")
    if asked is None and verified and forced == "1":
        return None
    assert forced == "0", (
        "VLLM_USE_V2_MODEL_RUNNER=1 is set: the capture reads the V1 runner's execute_model_state here; unset it or "
        "set VLLM_USE_V2_MODEL_RUNNER=0 (DATAGEN_CAPTURE_RUNNER_V2=1 forces the V2 capture, verified only on an H200 "
        "with vLLM 0.24.0, TP1, LlamaForCausalLM, compiled)"
    )
    return None


def on_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
