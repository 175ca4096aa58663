"""Faults and slowed steps for the orchestration tests, injected from the test side.

The product has no switch for them: the tests wrap its runners.

* Faults: a JSON file such as ``{"plan": {"exit_code": 75, "times": 1, "message": "..."}}``. The
  next ``times`` invocations whose task label (or step name) is ``plan`` do not run: the runner
  returns that exit code and the message, as if the step had failed. That is how a test makes one
  step fail once (a transient fault the flow must retry) or for real (a permanent fault the flow
  must not retry).
* A slowed step: the local runner runs ``python -m tests.support.slow_datagen SECONDS <step> ...``
  instead of ``python -m datagen <step> ...``, which pauses after each shard it submits, so that a
  test can kill a run in the middle of its extraction.

In the test's own process a fixture swaps the runner class (``hooked_runner``). In a process the
test does not start itself (a Prefect worker's flow run), ``worker_env`` puts the folder
``tests/support/worker_hooks`` on the worker's PYTHONPATH: Python imports its ``sitecustomize`` at
the start of every process of the worker, which swaps the runner classes when ``tasks`` loads them
(``install_on_import``), configured by the variables below.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

from filelock import FileLock

from tasks.runners import StepInvocation, StepOutcome

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
WORKER_HOOKS_DIR = Path(__file__).resolve().parent / "worker_hooks"
FAULTS_ENV = "DATAGEN_TEST_HOOK_FAULTS"  # path of the fault file
SLOW_SHARD_ENV = "DATAGEN_TEST_SLOW_SHARD_S"  # seconds of pause after each shard (0: none)


def write_faults(path: Path, **faults: dict) -> Path:
    """Write the fault file: step or task name -> {"exit_code": N, "times": N, "message": "..."}."""
    path.write_text(json.dumps(faults))
    return path


def worker_env(*, faults: Path | None = None, slow_shard_s: float | None = None) -> dict[str, str]:
    """Environment of a worker whose flow runs' steps get these faults and pauses."""
    paths = [str(WORKER_HOOKS_DIR), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"PYTHONPATH": os.pathsep.join(paths)}
    if faults is not None:
        env[FAULTS_ENV] = str(faults)
    if slow_shard_s is not None:
        env[SLOW_SHARD_ENV] = str(slow_shard_s)
    return env


def take_fault(faults: Path | None, invocation: StepInvocation) -> StepOutcome | None:
    """The fault to return instead of running ``invocation`` (its count decremented), or None."""
    if faults is None or not faults.exists():
        return None
    names = [n for n in (invocation.labels.get("task"), invocation.step) if n]
    with FileLock(str(faults) + ".lock"):
        table = json.loads(faults.read_text() or "{}")
        name = next((n for n in names if table.get(n, {}).get("times", 0) > 0), None)
        if name is None:
            return None
        fault = table[name]
        fault["times"] -= 1
        tmp = faults.with_suffix(".tmp")
        tmp.write_text(json.dumps(table))
        tmp.replace(faults)
    message = fault.get("message", f"{invocation.step}: fault injected by the test")
    logger.warning("test fault: %s fails with exit code %s", name, fault["exit_code"])
    return StepOutcome(exit_code=int(fault["exit_code"]), result=None, last_lines=(f"error: {message}",))


def hooked_runner(base: type, *, faults: Path | None = None, slow_shard_s: float | None = None) -> type:
    """A subclass of the runner class ``base`` that injects the faults of ``faults`` and (a local
    runner) runs its steps slowed by ``slow_shard_s`` seconds per shard."""

    class HookedRunner(base):
        def run(self, invocation: StepInvocation, log) -> StepOutcome:
            fault = take_fault(faults, invocation)
            if fault is not None:
                for line in fault.last_lines:
                    log(line)
                return fault
            return super().run(invocation, log)

        if slow_shard_s and hasattr(base, "_command"):
            def _command(self, invocation: StepInvocation) -> list[str]:
                return [self.python, "-m", "tests.support.slow_datagen", str(slow_shard_s), invocation.step,
                        *invocation.args]

            def _environment(self, invocation: StepInvocation) -> dict[str, str]:
                env = super()._environment(invocation)
                return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}

    HookedRunner.__name__ = HookedRunner.__qualname__ = f"Hooked{base.__name__}"
    return HookedRunner


# module -> name of the runner class it defines
RUNNER_CLASSES = {"tasks.local_runner": "LocalRunner", "tasks.docker_runner": "DockerRunner"}


def install_on_import() -> None:
    """Swap the runner classes for hooked ones as their modules load (configured by the variables
    FAULTS_ENV and SLOW_SHARD_ENV of this process); nothing when neither is set."""
    faults = Path(os.environ[FAULTS_ENV]) if os.environ.get(FAULTS_ENV) else None
    slow = float(os.environ.get(SLOW_SHARD_ENV) or 0) or None
    if faults is None and slow is None:
        return
    sys.meta_path.insert(0, _SwapOnImport(faults, slow))


class _SwapOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the loader of a runner module so that the class is swapped
    right after the module runs."""

    def __init__(self, faults: Path | None, slow_shard_s: float | None) -> None:
        self.faults, self.slow_shard_s = faults, slow_shard_s

    def find_spec(self, fullname, path, target=None):
        if fullname not in RUNNER_CLASSES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module, cls_name, hooks = spec.loader.exec_module, RUNNER_CLASSES[fullname], self

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return None

            def exec_module(self, module):
                exec_module(module)
                setattr(module, cls_name, hooked_runner(getattr(module, cls_name), faults=hooks.faults,
                                                        slow_shard_s=hooks.slow_shard_s))

        spec.loader = _Loader()
        return spec
