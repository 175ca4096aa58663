"""Which way the states leave vLLM, and on which model runner (no torch, no vLLM import at module level).

Two capture paths (docs/vllm-versions.md, "Runner matrix"):

- ``internal``: the worker extension reads the model runner's ``execute_model_state`` after each
  ``execute_model`` (datagen.engines.vllm_worker). Verified on V1 on the releases of
  ``TESTED_VLLM_VERSIONS``; on Model Runner V2 (datagen.engines.capture_v2) verified on an H200 with
  vLLM 0.24.0, tensor_parallel_size 1, an 8B Llama, compiled: shards bitwise equal to the V1
  capture's at every layer (``releases.V2_CAPTURE_VERIFIED``). Not verified on V2: TP > 1, eager,
  other architectures, other releases. ``runner_choice`` decides which runner a run takes.
- ``public``: vLLM's ``extract_hidden_states`` speculative method with the project's KV connector
  (datagen.engines.public_capture): the interface vLLM maintains for the job.

``DATAGEN_CAPTURE_PATH`` (``internal`` or ``public``) chooses; unset, a verified release takes
``internal``. The path and the runner it runs on are part of the engine record (the manifest and the
fingerprint: the two paths' kernels may round differently under compilation).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from datagen import settings
from datagen.engines.releases import CUDA_VLLM_RELEASE, TESTED_VLLM_VERSIONS, V2_CAPTURE_VERIFIED
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


@dataclass(frozen=True)
class RunnerChoice:
    """The model runner a run takes on CUDA or the CPU build, and why (``runner_choice``)."""

    runner: str  # "v1", "v2", or "auto" (vLLM picks by model and GPU)
    pin_v1: bool  # the engine sets VLLM_USE_V2_MODEL_RUNNER=0 (patch pin-v1-model-runner)
    v2_capture: bool  # the internal capture may read Model Runner V2 where vLLM runs it
    why: str
    unverified_v2: bool = False  # DATAGEN_CAPTURE_RUNNER_V2=1 where the V2 capture is not verified: a warning
    refused: str | None = None  # VLLM_USE_V2_MODEL_RUNNER=1 where this run cannot take V2: the engine refuses to start
    refused_hint: str | None = None  # what to do instead, where it differs from unsetting the variable


def verified_v2_runs() -> str:
    """Where the V2 capture was verified, in words (the table's keys)."""
    return "; ".join(f"vLLM {v}, TP{tp}, {arch}" for v, tp, arch in V2_CAPTURE_VERIFIED)


def runner_choice(version: str | None, path: str, *, cpu_build: bool, tensor_parallel_size: int | None = None,
                  architecture: str | None = None, environ=None) -> RunnerChoice:
    """The one place the model runner of a run is decided.

    The CPU build runs V1 (its V2 runner needs Triton: "Model Runner V2 requires Triton"). The public
    path leaves vLLM its choice, which is V1 where V2 refuses extract_hidden_states (0.24.0) or
    VLLM_USE_V2_MODEL_RUNNER says so. The internal capture on CUDA: DATAGEN_CAPTURE_RUNNER_V2=1 leaves
    vLLM its choice anywhere (a warning where unverified), =0 pins V1 everywhere; unset, vLLM keeps
    its choice where the V2 capture was verified (``releases.V2_CAPTURE_VERIFIED``: release,
    ``tensor_parallel_size``, ``architecture``, the model's top-level one) and V1 is pinned elsewhere.
    ``tensor_parallel_size`` or ``architecture`` not given: not verified, V1 pinned."""
    env = os.environ if environ is None else environ
    forced = env.get("VLLM_USE_V2_MODEL_RUNNER")
    picked = {"1": "v2", "0": "v1"}.get(forced, "auto")
    picked_why = f"VLLM_USE_V2_MODEL_RUNNER={forced}" if forced in ("0", "1") else \
        "vLLM picks (V2 where it supports the model; 0.24.0: Llama, Mistral, Qwen3, Qwen2-MoE, GraniteMoE, DeepseekV2)"
    asked = settings.capture_runner_v2(env)
    if cpu_build:
        return RunnerChoice("v1", False, asked is True, "the CPU build runs V1 (its V2 runner needs Triton)")
    if path != INTERNAL:
        if version in V2_WITHOUT_EXTRACT_HIDDEN_STATES:
            why = f"vLLM {version}'s V2 refuses extract_hidden_states: vLLM runs V1"
            if forced != "1":
                return RunnerChoice("v1", False, False, why)
            # vLLM would refuse it in LLM(...) (0.24.0 config/vllm.py:2031-2032, 2092-2100)
            return RunnerChoice("v1", False, False, why, refused=(
                f"VLLM_USE_V2_MODEL_RUNNER=1: vLLM {version}'s Model Runner V2 does not run the "
                "extract_hidden_states method the public capture path is built on"), refused_hint=(
                "unset VLLM_USE_V2_MODEL_RUNNER (vLLM then runs V1 for it), or take the internal capture "
                "(DATAGEN_CAPTURE_PATH=internal: on V2 where its capture is verified, or with DATAGEN_CAPTURE_RUNNER_V2=1)"))
        return RunnerChoice(picked, False, False, picked_why)
    run = f"vLLM {version}, TP{tensor_parallel_size or '?'}, {architecture or '(architecture not given)'}"
    where = V2_CAPTURE_VERIFIED.get((version, tensor_parallel_size, architecture))
    if asked is True:
        verified = f"verified for {run} ({where})" if where else \
            f"NOT verified for {run} (verified only for {verified_v2_runs()})"
        return RunnerChoice(picked, False, True, f"DATAGEN_CAPTURE_RUNNER_V2=1 allows the V2 capture, {verified}; "
                                                 f"{picked_why}", unverified_v2=not where)
    if asked is False:
        why = "DATAGEN_CAPTURE_RUNNER_V2=0 pins V1 (patch pin-v1-model-runner)"
    elif where:
        return RunnerChoice(picked, False, True, f"the V2 capture is verified for {run} ({where}): V1 not pinned; "
                                                 f"{picked_why}")
    else:
        why = (f"the V2 capture is not verified for {run} (verified only for {verified_v2_runs()}): V1 pinned "
               "(patch pin-v1-model-runner)")
    refused = None
    if forced == "1":
        refused = (f"VLLM_USE_V2_MODEL_RUNNER=1, but {why}: the capture reads the V1 model runner's "
                   "execute_model_state")
    return RunnerChoice("v1", True, False, why, refused=refused)


def model_runner(version: str | None, path: str, *, cpu_build: bool, tensor_parallel_size: int | None = None,
                 architecture: str | None = None, environ=None) -> str:
    """The model runner a run will take: "v1", "v2", or "auto" (vLLM picks by model and GPU); the
    engine record's ``model_runner`` (``runner_choice``)."""
    return runner_choice(version, path, cpu_build=cpu_build, tensor_parallel_size=tensor_parallel_size,
                         architecture=architecture, environ=environ).runner


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


def describe(version: str | None, *, cpu_build: bool, tensor_parallel_size: int | None = None,
             architecture: str | None = None, environ=None) -> dict:
    """The path and runner a run takes on this vLLM, and why (env-check's report); ``refused`` where
    the engine would refuse to start."""
    env = os.environ if environ is None else environ
    asked = requested_path(env)
    path = choose_path(version, env)
    choice = runner_choice(version, path, cpu_build=cpu_build, tensor_parallel_size=tensor_parallel_size,
                           architecture=architecture, environ=env)
    if asked is not None:
        why = f"{ENV}={asked}"
    elif path == INTERNAL:
        why = f"vLLM {version} is a verified release (internal capture verified on {', '.join(TESTED_VLLM_VERSIONS)})"
    else:
        why = (f"vLLM {version} is not a verified release: it would take vLLM's public extract_hidden_states API, "
               "but datagen extract refuses an unverified release (no start-up self-test yet)")
    out = {"capture_path": path, "model_runner": choice.runner, "why": f"{why}; runner: {choice.why}"}
    if choice.refused:
        out["refused"] = choice.refused
    return out
