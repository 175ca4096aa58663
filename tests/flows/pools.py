"""Work pools on a real Prefect server (``tests.support.prefect_server``), made in this process,
and its workers stopped at the end of a module.

`prefect work-pool create NAME --type process` is a program of its own: each one imports Prefect
and its CLI again and asks the server for the collections registry's worker types (seconds of CPU
apiece, and the end-to-end modules make two or three pools each). The pools it makes are the
same: the process worker's own default job template, not paused, not the default pool.
"""

from __future__ import annotations

import signal


def create_process_pools(server, *names: str) -> None:
    """Work pools ``names`` of type ``process`` on ``server`` (a ``PrefectServer``)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessWorker

    with temporary_settings(updates={PREFECT_API_URL: server.url}):
        with get_client(sync_client=True) as client:
            for name in names:
                client.create_work_pool(WorkPoolCreate(
                    name=name, type=ProcessWorker.type, base_job_template=ProcessWorker.get_default_base_job_template()))


def kill_workers(server) -> None:
    """Kill every worker of ``server`` and whatever it started, at once (SIGKILL), before
    ``server.stop()``. A process worker that has run a flow did not exit on SIGTERM within
    ``Process.stop``'s grace here (15 s, then 20 s more, then SIGKILL: 35 s a worker, 70 s for two);
    an idle one exits at once. At the end of a module nothing of it is left to keep."""
    for worker in server.workers:
        if worker.proc.poll() is None:  # not reaped yet: its pid is still its own
            worker.kill_tree(signal.SIGKILL)
