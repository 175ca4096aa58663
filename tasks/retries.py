"""Retrying transient faults, with backoff: Prefect's retry policy of every step task (and of the
fan-out's tasks), and ``retrying``, the same delays for a bucket call a range run makes outside any task.

A step failure raises ``tasks.errors.StepFailed``; ``retry_if_transient`` (every task's
``retry_condition_fn``) lets Prefect retry it only when the outcome was transient: the step exited
with ``EXIT_TRANSIENT`` (75), or the infrastructure killed it (137, 143, docker's 125). Bad input,
"cannot run here", validation failures and crashes fail at once, with the step's own message.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from datagen.errors import TransientError
from tasks.errors import StepFailed

STEP_RETRIES = 3
STEP_RETRY_DELAYS_S = [5, 30, 120]  # a storage hiccup passes in seconds, a lost node in minutes
STEP_RETRY_JITTER = 0.3

T = TypeVar("T")


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


def retrying(call: Callable[[], T], what: str, log) -> T:
    """``call()``, again after STEP_RETRY_DELAYS_S when the bucket fails transiently.

    Why not Prefect's retries: each call site is a bucket call made where a Prefect retry would
    redo much more than the call, or nothing at all.

    * The range's child (``tasks/fanout/child.py``: the bucket listings of ``extract_to_bucket``,
      the uploader's last pass, ``write_receipt``) runs in the `extract-shards` flow, not in a
      task: no task retry covers it, and a retry of that flow run would take the lease again and
      start another engine for a listing hiccup; a range run that fails is permanent to the parent
      (``dispatch_range`` fails the whole run on it).
    * The parent's ``dispatch_range`` (reading the range's receipt) is a task without retries on
      purpose: retrying it would submit the range as a new flow run although the range completed.

    Making each call a task of its own would add a task run per shard listing and receipt without
    changing what is retried (docs/decisions.md, "The bucket-call retry of a range run stays a
    loop of its own").
    """
    for delay in [*STEP_RETRY_DELAYS_S, None]:
        try:
            return call()
        except TransientError as e:
            if delay is None:
                raise
            log.warning("%s failed (%s); retrying in %d s", what, str(e).splitlines()[0], delay)
            time.sleep(delay)
