"""Work pools on a real Prefect server (``tests.support.prefect_server``), made in this process.
(``PrefectServer.stop`` kills the server's workers before it stops the server.)

`prefect work-pool create NAME --type process` is a program of its own: each one imports Prefect
and its CLI again and asks the server for the collections registry's worker types (seconds of CPU
apiece, and the end-to-end modules make two or three pools each). The pools it makes are the
same: the process worker's own default job template, not paused, not the default pool.
"""

from __future__ import annotations


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
