"""Step outcomes become results or StepFailed; only transient faults are retried."""

from __future__ import annotations

import pytest
from prefect import flow, task

from datagen.errors import EXIT_BAD_INPUT, EXIT_CANNOT_RUN_HERE, EXIT_FAILED, EXIT_TRANSIENT, EXIT_VALIDATION
from tasks.errors import StepFailed
from tasks.retries import retry_if_transient
from tasks.runners import StepOutcome


def outcome(exit_code: int, *lines: str) -> StepOutcome:
    return StepOutcome(exit_code=exit_code, result=None, last_lines=lines)


@pytest.mark.parametrize("code", [EXIT_TRANSIENT, 137, 143, -9, -15, 125])
def test_transient_and_infrastructure_failures_are_retryable(code):
    assert StepFailed("extract", outcome(code)).retryable


@pytest.mark.parametrize("code", [EXIT_FAILED, EXIT_BAD_INPUT, EXIT_CANNOT_RUN_HERE, EXIT_VALIDATION])
def test_permanent_failures_are_not(code):
    assert not StepFailed("extract", outcome(code)).retryable


def test_the_message_is_the_steps_error_and_hint():
    e = StepFailed("plan", outcome(EXIT_BAD_INPUT, "loading", "error: row 3 is not JSON", "  -> fix row 3"))
    assert str(e).splitlines() == [
        "datagen plan: bad input (exit 2, not retried)", "error: row 3 is not JSON", "  -> fix row 3",
    ]


@pytest.mark.prefect_server
@pytest.mark.usefixtures("prefect_harness")
def test_prefect_retries_a_transient_fault_and_not_a_permanent_one():
    calls = {"transient": 0, "permanent": 0}

    @task(retries=2, retry_delay_seconds=0, retry_condition_fn=retry_if_transient)
    def flaky(kind: str) -> str:
        calls[kind] += 1
        if calls[kind] == 1:
            raise StepFailed(kind, outcome(EXIT_TRANSIENT if kind == "transient" else EXIT_BAD_INPUT, "error: x"))
        return "ok"

    @flow
    def both():
        return flaky("transient"), flaky("permanent", return_state=True)

    ok, failed = both()
    assert ok == "ok" and calls["transient"] == 2
    assert failed.is_failed() and calls["permanent"] == 1
