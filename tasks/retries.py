"""The retry policy of every step task (and of the fan-out's tasks): transient faults only, with backoff.

A step failure raises ``tasks.errors.StepFailed``; ``retry_if_transient`` (every task's
``retry_condition_fn``) lets Prefect retry it only when the outcome was transient: the step exited
with ``EXIT_TRANSIENT`` (75), or the infrastructure killed it (137, 143, docker's 125). Bad input,
"cannot run here", validation failures and crashes fail at once, with the step's own message.
"""

from __future__ import annotations

from datagen.errors import TransientError
from tasks.errors import StepFailed

STEP_RETRIES = 3
STEP_RETRY_DELAYS_S = [5, 30, 120]  # a storage hiccup passes in seconds, a lost node in minutes
STEP_RETRY_JITTER = 0.3


def retry_if_transient(task, task_run, state) -> bool:
    """``retry_condition_fn`` of every step task: retry transient faults, nothing else."""
    try:
        state.result()
    except StepFailed as e:
        return e.retryable
    except TransientError:  # raised in the task's own process (S3 calls of the fan-out's tasks)
        return True
    except Exception:
        return False
    return False


# The retry policy of every step task: transient faults only, with backoff.
STEP_RETRY_POLICY = dict(
    retries=STEP_RETRIES,
    retry_delay_seconds=STEP_RETRY_DELAYS_S,
    retry_jitter_factor=STEP_RETRY_JITTER,
    retry_condition_fn=retry_if_transient,
)
