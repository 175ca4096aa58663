"""The local runner: each step program as a subprocess of the current Python.

``LocalRunner.run`` starts ``python -m datagen <step> <args>`` with the interpreter that runs the
flow (so the step sees the same environment: the embedded default, and the CPU tests), streams
every line of its output to ``log`` as it comes, and returns its ``StepOutcome``.

The step runs in a process group of its own, so that everything it starts (vLLM's engine core
and workers) can be stopped together: when the task is interrupted (a cancelled flow run raises
in the task's thread) and when this interpreter exits while a step still runs.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable

from tasks.runners import StepInvocation, StepOutcome, parse_result_line

logger = logging.getLogger(__name__)

LAST_LINES = 50  # output lines kept for error messages
STOP_GRACE_S = 10.0  # seconds between SIGTERM and SIGKILL when a step is stopped

_running: set[subprocess.Popen] = set()
_running_lock = threading.Lock()


class LocalRunner:
    """Runs ``datagen <step> <args>`` as a subprocess of ``python`` (default: this interpreter).

    Args:
        python: the interpreter; None: ``sys.executable``.
        cwd: the working directory of the step; None: this process's.
    """

    def __init__(self, *, python: str | None = None, cwd: str | None = None) -> None:
        self.python = python or sys.executable
        self.cwd = cwd

    def run(self, invocation: StepInvocation, log: Callable[[str], None]) -> StepOutcome:
        """Runs the step to its end; stops it (and all it started) if this call is interrupted."""
        proc = self._start(invocation)
        try:
            result, last = self._stream(proc, log)
            exit_code = proc.wait()
        except BaseException:
            _stop(proc)
            raise
        finally:
            with _running_lock:
                _running.discard(proc)
        return StepOutcome(exit_code=exit_code, result=result, last_lines=tuple(last))

    def _command(self, invocation: StepInvocation) -> list[str]:
        return [self.python, "-m", "datagen", invocation.step, *invocation.args]

    def _environment(self, invocation: StepInvocation) -> dict[str, str]:
        # Secret names need nothing here: the subprocess inherits this process's environment.
        return {**os.environ, **invocation.env, "PYTHONUNBUFFERED": "1"}

    def _start(self, invocation: StepInvocation) -> subprocess.Popen:
        logger.debug("%s: running %s", invocation.step, self._command(invocation))
        proc = subprocess.Popen(
            self._command(invocation),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self._environment(invocation),
            cwd=self.cwd,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,  # its own process group: stopped as a whole
        )
        with _running_lock:
            _running.add(proc)
        return proc

    @staticmethod
    def _stream(proc: subprocess.Popen, log: Callable[[str], None]) -> tuple[dict | None, deque]:
        result = None
        last: deque[str] = deque(maxlen=LAST_LINES)
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\r\n")
            parsed = parse_result_line(line)
            result = parsed if parsed is not None else result
            last.append(line)
            log(line)
        return result, last


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the step's process group, SIGKILL it if it is still there after the grace time."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


@atexit.register
def _stop_all() -> None:
    # A flow run that ends (cancelled, crashed) while a step runs must not leave the step behind.
    with _running_lock:
        procs = list(_running)
    for proc in procs:
        _stop(proc)
