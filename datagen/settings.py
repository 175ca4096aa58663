"""Every environment variable datagen reads, in one place, read when asked (not at import)."""

from __future__ import annotations

import os
from pathlib import Path


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return default if raw in (None, "") else int(raw)


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return default if raw in (None, "") else float(raw)


def cpu_kvcache_gib() -> int:
    """DATAGEN_CPU_KVCACHE_GIB: KV cache of the CPU engine in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    return _int("DATAGEN_CPU_KVCACHE_GIB", 2)


def gpu_memory_utilization() -> float:
    """DATAGEN_GPU_MEMORY_UTILIZATION: vLLM's share of GPU memory (on CPU: of RAM)."""
    return _float("DATAGEN_GPU_MEMORY_UTILIZATION", 0.85 if _cuda() else 0.1)


def enforce_eager() -> bool:
    """DATAGEN_ENFORCE_EAGER: 1 to run vLLM without torch.compile / CUDA graphs."""
    return os.environ.get("DATAGEN_ENFORCE_EAGER", "0") == "1"


def model_cache() -> Path:
    """DATAGEN_MODEL_CACHE: the shared model cache for downloads."""
    return Path(os.environ.get("DATAGEN_MODEL_CACHE", Path.home() / ".cache" / "datagen" / "models"))


def progress_interval_s() -> float:
    """DATAGEN_PROGRESS_INTERVAL: seconds between progress log lines when not on a terminal."""
    return _float("DATAGEN_PROGRESS_INTERVAL", 10.0)


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
