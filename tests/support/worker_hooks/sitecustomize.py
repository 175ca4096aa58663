"""Imported by Python at the start of every process whose PYTHONPATH names this folder: every
process the tests start (``tests/support/marks.py`` puts the folder on the test session's
PYTHONPATH), and the processes of a Prefect worker that a test started with
``tests.support.step_hooks.worker_env``.

- ``start_guard``: a start of a vLLM engine, a Docker client or a Prefect server that the running
  test is not marked for fails (the guard's directory is named by DATAGEN_TEST_START_GUARD).
- The step runners are swapped for ones that inject the test's faults and pauses (see step_hooks),
  when a worker's environment asks for them.
"""

import os

if os.environ.get("DATAGEN_TEST_START_GUARD"):
    import start_guard

    start_guard.install()

if os.environ.get("DATAGEN_TEST_HOOK_FAULTS") or os.environ.get("DATAGEN_TEST_SLOW_SHARD_S"):
    from tests.support.step_hooks import install_on_import

    install_on_import()
