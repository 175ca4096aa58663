"""A step's result as the orchestration receives it: run the step through a runner and take its
result record, or raise its failure (``run_step``); that record as the step's typed ``Result``
(``parse_result``)."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel

from tasks.errors import StepFailed, StepResultMissing
from tasks.runners import StepInvocation, StepRunner

T = TypeVar("T", bound=BaseModel)


def run_step(invocation: StepInvocation, runner: StepRunner, *, log) -> dict:
    """Run one step; stream each output line to ``log``; return its result record.

    Raises:
        StepFailed: a non-zero exit (``retryable`` says whether a retry may help).
        StepResultMissing: exit 0 without a result line.
    """
    outcome = runner.run(invocation, log)
    if not outcome.ok:
        raise StepFailed(invocation.step, outcome)
    if outcome.result is None:
        raise StepResultMissing(f"datagen {invocation.step} exited 0 but printed no result line")
    return outcome.result


def parse_result(result: dict, model: type[T]) -> T:
    """The step's result record as its typed model: keys the model does not declare are dropped,
    unless it keeps extra ones (``extra="allow"``)."""
    if model.model_config.get("extra") != "allow":
        result = {k: v for k, v in result.items() if k in model.model_fields}
    return model.model_validate(result)
