"""How a step program's failure reaches the orchestration: ``StepFailed`` (a non-zero exit, with the
step's own message and whether a retry may help) and ``StepResultMissing`` (exit 0, no result line).
The retry policy that reads them is ``tasks/retries.py``."""

from __future__ import annotations

from datagen.errors import EXIT_BAD_INPUT, EXIT_CANNOT_RUN_HERE, EXIT_FAILED, EXIT_TRANSIENT, EXIT_VALIDATION
from tasks.runners import StepOutcome

_EXIT_MEANINGS = {
    EXIT_FAILED: "the step crashed",
    EXIT_BAD_INPUT: "bad input",
    EXIT_CANNOT_RUN_HERE: "cannot run here",
    EXIT_VALIDATION: "validation failed",
    EXIT_TRANSIENT: "transient fault",
    125: "the container could not run",
    137: "killed (SIGKILL, e.g. out of memory)",
    143: "killed (SIGTERM)",
    -9: "killed (SIGKILL, e.g. out of memory)",
    -15: "killed (SIGTERM)",
}


class StepFailed(RuntimeError):
    """A step program ended with a non-zero exit code.

    Attributes:
        step: the datagen command ("extract", "validate", ...).
        exit_code: its exit status (negative: killed by that signal).
        retryable: True for a transient fault (the task's retry condition reads it).
        lines: the step's error lines (its message and hint), or the end of its output.
    """

    def __init__(self, step: str, outcome: StepOutcome) -> None:
        self.step = step
        self.exit_code = outcome.exit_code
        self.retryable = outcome.retryable
        self.lines = _error_lines(outcome.last_lines)
        meaning = _EXIT_MEANINGS.get(outcome.exit_code, "failed")
        retry = "will be retried" if self.retryable else "not retried"
        detail = "\n".join(self.lines) or "(the step printed nothing)"
        super().__init__(f"datagen {step}: {meaning} (exit {outcome.exit_code}, {retry})\n{detail}")


class StepResultMissing(RuntimeError):
    """A step exited 0 without printing its result line (a bug in the step or the runner)."""


def _error_lines(lines: tuple[str, ...]) -> list[str]:
    """The step's `error: ...` message and its hint lines; else the last lines of its output."""
    for i, line in enumerate(lines):
        if line.startswith("error: "):
            return list(lines[i : i + 12])
    return list(lines[-12:])
