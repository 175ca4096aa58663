"""Imported by Python at the start of every process whose PYTHONPATH names this folder: the
processes of a Prefect worker that a test started with ``tests.support.step_hooks.worker_env``.
It swaps the step runners for ones that inject the test's faults and pauses (see step_hooks)."""

import os

if os.environ.get("DATAGEN_TEST_HOOK_FAULTS") or os.environ.get("DATAGEN_TEST_SLOW_SHARD_S"):
    from tests.support.step_hooks import install_on_import

    install_on_import()
