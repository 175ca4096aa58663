"""TEST HOOK: faults the local runner injects, for the orchestration tests only.

The tests point ``DATAGEN_TEST_HOOK_FAULTS`` at a JSON file such as::

    {"plan": {"exit_code": 75, "times": 1}}

and the next ``times`` invocations whose task label (or step name) is ``plan`` do not run: the
runner returns that exit code and the message, as if the step had failed. That is how the tests
make one step fail once (a transient fault the flow must retry) or for real (a permanent fault the
flow must not retry) in a worker process they do not control. Outside the tests the variable is
unset and this module does nothing.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from filelock import FileLock

from tasks.runners import StepInvocation, StepOutcome
from tasks.settings import fault_hook_file

logger = logging.getLogger(__name__)


def injected_fault(invocation: StepInvocation) -> StepOutcome | None:
    """The fault to return instead of running ``invocation``, or None to run it."""
    path = fault_hook_file()
    if path is None or not path.exists():
        return None
    names = [n for n in (invocation.labels.get("task"), invocation.step) if n]
    with FileLock(str(path) + ".lock"):
        faults = json.loads(path.read_text() or "{}")
        name = next((n for n in names if faults.get(n, {}).get("times", 0) > 0), None)
        if name is None:
            return None
        fault = faults[name]
        fault["times"] -= 1
        _write(path, faults)
    message = fault.get("message", f"{invocation.step}: fault injected by the test hook")
    logger.warning("test hook: %s fails with exit code %s", name, fault["exit_code"])
    return StepOutcome(exit_code=int(fault["exit_code"]), result=None, last_lines=(f"error: {message}",))


def _write(path: Path, faults: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(faults))
    tmp.replace(path)
