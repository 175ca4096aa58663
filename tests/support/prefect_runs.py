"""Reading what a flow run did, from the Prefect API: its task runs (by name), logs, artifacts.

Task run states reach the API as events, a moment after the task ends; ``task_runs`` waits until
every task run of the flow run is in a final state.
"""

from __future__ import annotations

import time
from collections import defaultdict
from uuid import UUID

from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId


def task_runs(flow_run_id: UUID | str, *, timeout: float = 30.0) -> dict[str, list]:
    """Task name (the part before the run's suffix) -> its task runs, once all are final."""
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(str(flow_run_id))])))
            if (runs and all(r.state is not None and r.state.is_final() for r in runs)) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    by_name: dict[str, list] = defaultdict(list)
    for r in runs:
        by_name[_task_name(r)].append(r)
    return dict(by_name)


def _task_name(run) -> str:
    # Task run names are "<task name>-<suffix>" or, for ranges, "extract-range-A:B".
    name = run.name
    for prefix in ("extract-range", "dispatch-range", "env-check"):
        if name.startswith(prefix):
            return prefix
    return name.rsplit("-", 1)[0]


def state_names(runs: list) -> list[str]:
    return sorted(r.state.name for r in runs)


def flow_run_logs(flow_run_id: UUID | str) -> list[str]:
    """Every log message of the flow run and its task runs (after flushing this process's logs)."""
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    flt = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(str(flow_run_id))]))
    messages: list[str] = []
    with get_client(sync_client=True) as client:
        while page := client.read_logs(log_filter=flt, limit=200, offset=len(messages)):
            messages += [log.message for log in page]
    return messages


def artifacts_by_key(flow_run_id: UUID | str) -> dict[str, list]:
    """Artifact key -> the flow run's artifacts of that key (oldest first)."""
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(str(flow_run_id))]))
        )
    out: dict[str, list] = defaultdict(list)
    for a in sorted(found, key=lambda a: a.created):
        out[a.key or a.type].append(a)
    return dict(out)
