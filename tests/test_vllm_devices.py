"""Where the CPU engine runs: in the caller's process at tensor parallel 1 (one process where vLLM's
own layout starts three, each importing torch and vLLM), except where vLLM's start cannot run there."""

from __future__ import annotations

import sys

import pytest

from datagen.engines import vllm_devices

LAYOUT = "VLLM_ENABLE_V1_MULTIPROCESSING"


@pytest.fixture
def clean_env(monkeypatch):
    for name in (LAYOUT, "DATAGEN_CPU_ENGINE_IN_PROCESS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(sys.modules, "llvmlite", raising=False)
    return monkeypatch


def test_the_cpu_engine_at_tp1_starts_in_this_process(clean_env):
    import os

    vllm_devices.set_process_env(on_cuda=False, tensor_parallel_size=1)
    assert os.environ[LAYOUT] == "0"


@pytest.mark.parametrize("why", ["tp2", "multimodal", "numba loaded", "setting off", "cuda",
                                 "an earlier in-process engine's setting"])
def test_vllms_own_layout_where_this_process_cannot_hold_the_engine_or_is_not_asked_to(clean_env, why):
    import os

    tp, multimodal, on_cuda = 1, False, False
    if why == "tp2":
        tp = 2
    elif why == "multimodal":  # LLM itself loads the model's processor here, Kimi-K2.5's imports numba
        multimodal = True
    elif why == "numba loaded":  # vLLM 0.32's kernel scan at worker start trips over llvmlite
        clean_env.setitem(sys.modules, "llvmlite", sys)
    elif why == "setting off":
        clean_env.setenv("DATAGEN_CPU_ENGINE_IN_PROCESS", "0")
    elif why == "cuda":
        on_cuda = True
        clean_env.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # restored after the test
    elif why == "an earlier in-process engine's setting":  # left in os.environ: not handed on
        clean_env.setenv(LAYOUT, "0")
        multimodal = True
    vllm_devices.set_process_env(on_cuda=on_cuda, tensor_parallel_size=tp, multimodal=multimodal)
    assert os.environ.get(LAYOUT) == (None if on_cuda else "1")
