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


@pytest.mark.parametrize("version, cpu_build, environ, turned_off", [
    ("0.32.0", True, {}, True),                                # vllm-cpu 0.32.0: its AOT artifact never loads back
    ("0.32.0", True, {"VLLM_USE_AOT_COMPILE": "1"}, False),    # the user's setting wins
    ("0.32.0", False, {}, False),                              # not the CPU build: vLLM's own default
    ("0.24.0", True, {}, False),                               # a release not known to fail
])
def test_aot_compile_is_turned_off_only_where_vllms_artifact_cannot_load(version, cpu_build, environ, turned_off,
                                                                         monkeypatch):
    import os

    for name in ("VLLM_USE_AOT_COMPILE", "VLLM_WORKER_MULTIPROC_METHOD"):
        monkeypatch.setenv(name, "")  # so that the test's end restores it as it was, set or not
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    if cpu_build:
        assert vllm_devices.aot_compile_off(version) is turned_off
    else:  # the CUDA branch of what every engine sets before it starts
        vllm_devices.set_process_env(on_cuda=True)
    assert {k: v for k, v in os.environ.items() if k == "VLLM_USE_AOT_COMPILE"} == \
        ({**environ, "VLLM_USE_AOT_COMPILE": "0"} if turned_off else environ)
