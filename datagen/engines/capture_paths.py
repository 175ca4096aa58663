"""Which way the states leave vLLM, and on which model runner (no torch, no vLLM import at module level).

Two capture paths (docs/vllm-versions.md, "Runner matrix"):

- ``internal``: the worker extension reads the V1 model runner's ``execute_model_state`` after each
  ``execute_model`` (datagen.engines.vllm_worker). Verified on the releases of
  ``TESTED_VLLM_VERSIONS``; it needs the V1 runner (patch pin-v1-model-runner on CUDA), unless
  ``DATAGEN_CAPTURE_RUNNER_V2=1`` lets it read Model Runner V2's (datagen.engines.capture_v2: tested
  on V2's data structures on the CPU, never run on a GPU).
- ``public``: vLLM's ``extract_hidden_states`` speculative method with the project's KV connector
  (datagen.engines.public_capture): the interface vLLM maintains for the job.

``DATAGEN_CAPTURE_PATH`` (``internal`` or ``public``) chooses; unset, a verified release takes
``internal``. The path and the runner it runs on are part of the engine record (the manifest and the
fingerprint: the two paths' kernels may round differently under compilation).
"""

from __future__ import annotations

import os

from datagen import settings
from datagen.engines.releases import CUDA_VLLM_RELEASE, TESTED_VLLM_VERSIONS
from datagen.engines.vllm_settings import CAPTURE_PATHS, INTERNAL, PUBLIC
from datagen.errors import EngineSettingError

ENV = "DATAGEN_CAPTURE_PATH"

# Releases whose Model Runner V2 refuses the extract_hidden_states method (it falls back to V1):
# 0.24.0 config/vllm.py:1994-2080 (docs/vllm-versions.md f).
V2_WITHOUT_EXTRACT_HIDDEN_STATES = frozenset({CUDA_VLLM_RELEASE})


def runner_version(runner_class: str) -> str:
    """"v2" for a class of Model Runner V2 (vllm.v1.worker.gpu.*, and the CPU build's
    vllm.v1.worker.cpu.*), else "v1" (GPUModelRunner, CPUModelRunner). ``runner_class``: module and
    name, as the worker extension's ``datagen_model_runner`` reports it."""
    module = runner_class.rsplit(".", 1)[0]
    return "v2" if module.startswith(("vllm.v1.worker.gpu.", "vllm.v1.worker.cpu.")) else "v1"


def requested_path(environ=None) -> str | None:
    """The path DATAGEN_CAPTURE_PATH asks for; None when unset.

    Raises:
        EngineSettingError: a value that names no path.
    """
    env = os.environ if environ is None else environ
    raw = (env.get(ENV) or "").strip().lower()
    if not raw:
        return None
    if raw not in CAPTURE_PATHS:
        raise EngineSettingError(f"{ENV}={raw}: not a capture path ({', '.join(CAPTURE_PATHS)})",
                                 settings=[f"{ENV}={raw}"], hint=f"set {ENV} to internal or public, or unset it")
    return raw


def choose_path(version: str | None, environ=None) -> str:
    """The capture path a run takes on vLLM ``version``: the one asked for, else internal on a
    verified release and public on any other."""
    asked = requested_path(environ)
    if asked is not None:
        return asked
    return INTERNAL if version in TESTED_VLLM_VERSIONS else PUBLIC


def model_runner(version: str | None, path: str, *, cpu_build: bool, environ=None) -> str:
    """The model runner a run will take: "v1", "v2", or "auto" (vLLM picks by model and GPU).

    The CPU build runs V1 (its V2 runner needs Triton: "Model Runner V2 requires Triton"); the
    internal capture pins V1 on CUDA unless DATAGEN_CAPTURE_RUNNER_V2=1 leaves vLLM its choice; the
    public path leaves vLLM its choice, which is V1 where V2 refuses extract_hidden_states (0.24.0)
    or VLLM_USE_V2_MODEL_RUNNER says so."""
    env = os.environ if environ is None else environ
    if cpu_build:
        return "v1"
    if path == INTERNAL:
        if not settings.capture_runner_v2(env):
            return "v1"
    elif version in V2_WITHOUT_EXTRACT_HIDDEN_STATES:
        return "v1"
    forced = env.get("VLLM_USE_V2_MODEL_RUNNER")
    if forced in ("0", "1"):
        return "v2" if forced == "1" else "v1"
    return "auto"


def public_path_self_test() -> None:
    """What the public path needs of the installed vLLM, without starting it (AssertionError with
    the reason): the extract_hidden_states method, its drafter model and cache-only layer, the
    hidden-states cache spec, and the KV connector interface the project's connector implements."""
    import inspect

    from vllm.config.speculative import SpeculativeConfig

    assert hasattr(SpeculativeConfig, "uses_extract_hidden_states"), "SpeculativeConfig has no extract_hidden_states"
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer  # noqa: F401
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec  # noqa: F401
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    for name in ("register_kv_caches", "get_finished", "request_finished", "build_connector_meta",
                 "get_num_new_matched_tokens", "update_state_after_alloc"):
        assert hasattr(KVConnectorBase_V1, name), f"KVConnectorBase_V1 has no {name}"
    params = list(inspect.signature(KVConnectorBase_V1.request_finished).parameters)
    assert params[:3] == ["self", "request", "block_ids"], f"request_finished takes {params}"
    from vllm.engine.arg_utils import EngineArgs
    import dataclasses

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for name in ("speculative_config", "kv_transfer_config"):
        assert name in fields, f"EngineArgs has no {name}"


def describe(version: str | None, *, cpu_build: bool, environ=None) -> dict:
    """The path and runner a run takes on this vLLM, and why (env-check's report)."""
    env = os.environ if environ is None else environ
    asked = requested_path(env)
    path = choose_path(version, env)
    runner = model_runner(version, path, cpu_build=cpu_build, environ=env)
    if asked is not None:
        why = f"{ENV}={asked}"
    elif path == INTERNAL:
        why = f"vLLM {version} is a verified release (internal capture verified on {', '.join(TESTED_VLLM_VERSIONS)})"
    else:
        why = (f"vLLM {version} is not a verified release: it would take vLLM's public extract_hidden_states API, "
               "but datagen extract refuses an unverified release (no start-up self-test yet)")
    if cpu_build:
        runner_why = "the CPU build runs V1 (its V2 runner needs Triton)"
    elif path == INTERNAL and not settings.capture_runner_v2(env):
        runner_why = "the internal capture pins V1 (patch pin-v1-model-runner)"
    elif runner == "v1":
        runner_why = "V2 of this release refuses extract_hidden_states" \
            if path == PUBLIC and version in V2_WITHOUT_EXTRACT_HIDDEN_STATES else "VLLM_USE_V2_MODEL_RUNNER=0"
    else:
        runner_why = "vLLM picks (V2 where it supports the model)" if runner == "auto" else "VLLM_USE_V2_MODEL_RUNNER=1"
    if path == INTERNAL and runner != "v1":
        runner_why += "; DATAGEN_CAPTURE_RUNNER_V2=1: on V2 the internal capture reads V2's state (never run on a GPU)"
    return {"capture_path": path, "model_runner": runner, "why": f"{why}; runner: {runner_why}"}
