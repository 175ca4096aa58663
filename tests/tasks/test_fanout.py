"""Per-host GPU limits: a range holds its engine's GPUs in the host's global concurrency limit."""

from __future__ import annotations

import threading
import time

import pytest

from tasks.fanout import gpu_slots, gpu_slots_name

pytestmark = pytest.mark.usefixtures("prefect_harness")


def test_a_host_never_runs_more_engines_than_its_gpus_allow():
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=gpu_slots_name(), limit=8))
    spans: list[tuple[float, float]] = []

    def engine() -> None:
        with gpu_slots(8):  # TP 8 on an 8-GPU host: one engine at a time
            start = time.monotonic()
            time.sleep(1.0)
            spans.append((start, time.monotonic()))

    threads = [threading.Thread(target=engine) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    (a0, a1), (b0, b1) = sorted(spans)
    assert b0 >= a1, "two TP-8 engines held the host's 8 GPUs at the same time"


def test_a_cpu_range_takes_no_slots():
    with gpu_slots(0):
        pass
