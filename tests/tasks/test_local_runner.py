"""The local runner: streaming, results, exit codes, stopping; the tests' fault-injecting subclass."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import psutil
import pytest

from datagen.errors import EXIT_BAD_INPUT, EXIT_TRANSIENT
from tasks.local_runner import LocalRunner
from tasks.runners import StepInvocation
from tests.support.step_hooks import hooked_runner, write_faults


def fake_python(tmp_path: Path, body: str) -> str:
    """An executable standing in for `python`: it ignores `-m datagen STEP ...` and runs ``body`` (sh)."""
    path = tmp_path / "fake-python"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def invocation(**overrides) -> StepInvocation:
    fields = dict(step="plan", args=("--spec", "x.json"), labels={"task": "plan"})
    fields.update(overrides)
    return StepInvocation(**fields)


def test_streams_each_line_as_the_step_prints_it(tmp_path):
    runner = LocalRunner(python=fake_python(tmp_path, "echo one\nsleep 1.5\necho two\n"))
    seen = []
    outcome = runner.run(invocation(), lambda line: seen.append((line, time.monotonic())))
    assert [line for line, _ in seen] == ["one", "two"]
    assert seen[1][1] - seen[0][1] > 1.0, "the first line must reach the log before the step ends"
    assert outcome.exit_code == 0


def test_returns_the_result_line_and_the_exit_code(tmp_path):
    body = 'echo "error: the spec is bad" >&2\necho "  -> fix it"\necho \'datagen-result: {"a": 1}\'\nexit 2\n'
    outcome = LocalRunner(python=fake_python(tmp_path, body)).run(invocation(), lambda line: None)
    assert outcome.exit_code == EXIT_BAD_INPUT
    assert outcome.result == {"a": 1}
    assert outcome.last_lines[0] == "error: the spec is bad"
    assert not outcome.retryable


def test_a_killed_step_is_retryable(tmp_path):
    outcome = LocalRunner(python=fake_python(tmp_path, "kill -9 $$\n")).run(invocation(), lambda line: None)
    assert outcome.exit_code == -9
    assert outcome.retryable


def test_stops_the_step_and_everything_it_started_when_interrupted(tmp_path):
    pids = tmp_path / "pids"
    body = f"sleep 300 &\necho $! > {pids}\necho started\nwait\n"

    def interrupt(line: str) -> None:
        if line == "started":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        LocalRunner(python=fake_python(tmp_path, body)).run(invocation(), interrupt)
    child = int(pids.read_text())
    deadline = time.monotonic() + 5
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the step's child process survived"
        time.sleep(0.1)


def test_the_tests_fault_runner_injects_a_fault_without_running_the_step(tmp_path):
    faults = write_faults(tmp_path / "faults.json", plan={"exit_code": EXIT_TRANSIENT, "times": 1})
    ran = tmp_path / "ran"
    runner = hooked_runner(LocalRunner, faults=faults)(python=fake_python(tmp_path, f"touch {ran}\n"))
    first = runner.run(invocation(), lambda line: None)
    assert first.exit_code == EXIT_TRANSIENT and first.retryable and not ran.exists()
    second = runner.run(invocation(), lambda line: None)
    assert second.exit_code == 0 and ran.exists(), "the fault is injected only `times` times"


def test_runs_the_real_datagen_cli_and_reports_its_error(tmp_path):
    lines = []
    outcome = LocalRunner().run(
        StepInvocation(step="plan", args=("--spec", str(tmp_path / "missing.json"))), lines.append
    )
    assert outcome.exit_code == EXIT_BAD_INPUT
    assert any(line.startswith("error: cannot read spec file") for line in lines)
