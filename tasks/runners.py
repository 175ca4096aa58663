"""How a task runs its step program: the runner interface.

A step is ``datagen <step> <args...>``. A runner runs it somewhere (a local
subprocess, a container), streams every output line to ``log`` as it comes, and
returns a ``StepOutcome``. The step program prints its typed result as the last
line of stdout, prefixed with ``RESULT_PREFIX`` (see ``datagen.cli``).

Paths in ``args`` are host paths; a container runner bind-mounts each of
``mounts`` at the same path inside the container, so arguments need no rewriting.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Protocol

from datagen.cli import RESULT_PREFIX
from datagen.errors import EXIT_OK, EXIT_TRANSIENT

# Exit codes of infrastructure failures, not of the step's own logic:
# 137 = SIGKILL (docker kill, OOM killer), 143 = SIGTERM, 125 = docker could not run the container.
INFRASTRUCTURE_EXIT_CODES = frozenset({137, 143, 125, -9, -15})


@dataclass(frozen=True)
class Mount:
    """A host directory made visible to the step at the same path."""

    path: str  # absolute host path
    read_only: bool = False


@dataclass(frozen=True)
class StepInvocation:
    """One run of one step program."""

    step: str  # the datagen command: "extract", "validate", "download", ...
    args: tuple[str, ...]  # arguments after the step name
    mounts: tuple[Mount, ...] = ()  # host paths the step reads or writes
    env: dict[str, str] = field(default_factory=dict)  # plain settings, may be logged
    secret_env_names: tuple[str, ...] = ()  # names of env vars passed through, never logged
    gpus: int = 0  # GPUs the step needs (0 = CPU only)
    labels: dict[str, str] = field(default_factory=dict)  # e.g. flow-run id, step name


@dataclass(frozen=True)
class StepOutcome:
    """What came back from a step."""

    exit_code: int  # the process's exit status (negative: killed by that signal)
    result: dict | None  # the step's parsed result line, when it printed one
    last_lines: tuple[str, ...]  # the end of the output, for error messages

    @property
    def ok(self) -> bool:
        return self.exit_code == EXIT_OK

    @property
    def retryable(self) -> bool:
        """A transient fault: the step said so, or the infrastructure killed it."""
        return self.exit_code == EXIT_TRANSIENT or self.exit_code in INFRASTRUCTURE_EXIT_CODES


class StepRunner(Protocol):
    """Runs one step program and streams its output."""

    def run(self, invocation: StepInvocation, log: Callable[[str], None]) -> StepOutcome: ...


def parse_result_line(line: str) -> dict | None:
    """The step's result if ``line`` is its result line, else None."""
    if not line.startswith(RESULT_PREFIX):
        return None
    try:
        value = json.loads(line[len(RESULT_PREFIX) :])
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
