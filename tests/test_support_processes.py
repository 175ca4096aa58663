"""How the tests' helper stops a background process (``tests.support.prefect_server.Process``): SIGTERM
to it and everything it started, SIGKILL to what is still there after its grace, and no waiting
beyond that. A Prefect worker that had run a flow once ignored SIGTERM and was waited out for 35 s."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from tests.support.prefect_server import Process

# a parent and its child; with IGNORE both ignore SIGTERM
TREE = """
import signal, subprocess, sys, time
if "IGNORE" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(120)
"""
CHILD = "import signal, sys, time; {} time.sleep(120)"


def _start(tmp_path, ignore: bool, grace: float) -> tuple[Process, int]:
    child = CHILD.format("signal.signal(signal.SIGTERM, signal.SIG_IGN);" if ignore else "")
    args = [sys.executable, "-c", TREE, child] + (["IGNORE"] if ignore else [])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, start_new_session=True)
    child_pid = int(proc.stdout.readline())
    time.sleep(0.5)  # the child's handler is set
    return Process(proc, tmp_path / "log", grace=grace), child_pid


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # exited, not yet reaped
    except psutil.NoSuchProcess:
        return True


def test_a_tree_that_exits_on_sigterm_is_stopped_at_once(tmp_path):
    process, child = _start(tmp_path, ignore=False, grace=30)
    t0 = time.monotonic()
    process.stop()
    assert time.monotonic() - t0 < 5
    assert process.proc.poll() is not None and _gone(child)


def test_a_tree_that_ignores_sigterm_is_killed_after_its_grace(tmp_path):
    process, child = _start(tmp_path, ignore=True, grace=1)
    t0 = time.monotonic()
    process.stop()
    took = time.monotonic() - t0
    assert 1 <= took < 5, took
    assert process.proc.poll() is not None and _gone(child)
