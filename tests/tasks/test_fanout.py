"""Global concurrency limits on the server: per-host GPU limits (a range holds its engine's GPUs),
and a range's lease (one slot per range: one writer at a time)."""

from __future__ import annotations

import threading
import time

import pytest

from tasks.fanout.child import gpu_slots, gpu_slots_name

pytestmark = [pytest.mark.prefect_server, pytest.mark.usefixtures("prefect_harness")]


@pytest.fixture
def host_gpus():
    """Creates this host's GPU limit on the server (``host_gpus(8)``); removed after the test."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectNotFound

    def create(gpus: int) -> None:
        with get_client(sync_client=True) as client:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=gpu_slots_name(), limit=gpus))

    yield create
    with get_client(sync_client=True) as client:
        try:
            client.delete_global_concurrency_limit_by_name(gpu_slots_name())
        except ObjectNotFound:
            pass


def _active_slots() -> int:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(gpu_slots_name()).active_slots


def test_a_host_never_runs_more_engines_than_its_gpus_allow(host_gpus):
    host_gpus(8)
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


def test_a_cpu_range_takes_no_slots(host_gpus, caplog):
    """A CPU range (0 GPUs) enters at once even while every GPU slot of the host is held."""
    import logging

    host_gpus(1)
    held, release = threading.Event(), threading.Event()

    def gpu_engine() -> None:
        with gpu_slots(1):
            held.set()
            release.wait(60)

    holder = threading.Thread(target=gpu_engine)
    holder.start()
    try:
        assert held.wait(60), "the GPU engine did not get the host's only slot"
        entered: list[int] = []

        def cpu_range() -> None:
            with gpu_slots(0, log=logging.getLogger("test-cpu-range")):
                entered.append(_active_slots())

        with caplog.at_level(logging.INFO, logger="test-cpu-range"):
            cpu = threading.Thread(target=cpu_range)
            cpu.start()
            cpu.join(10)
        assert entered == [1], "the CPU range waited for a GPU slot (or took one)"
        assert not caplog.records, "a CPU range takes no slots, so it logs none"
    finally:
        release.set()
        holder.join(60)
    assert _active_slots() == 0


def test_a_range_lease_is_held_by_one_run_at_a_time_and_given_back():
    """The range's slot on the server: a second holder waits until the first has left."""
    import logging

    from prefect import get_client

    from tasks.fanout.child import range_lease
    from tasks.fanout.range_limit import range_limit_name
    from tasks.pipeline_spec import PipelineSpec, ShardRange

    spec = PipelineSpec.model_validate({"model": "m", "dataset": "d.jsonl", "output": "o", "ranges_in_flight": 2,
                                        "publish_to": "s3://datasets/ds", "fan_out": {"lease_s": 60}})
    shard_range, fingerprint = ShardRange(first=0, stop=4), "f" * 64
    spans: list[tuple[float, float]] = []

    def run() -> None:
        with range_lease(spec, shard_range, fingerprint, log=logging.getLogger("test")):
            start = time.monotonic()
            time.sleep(1.0)
            spans.append((start, time.monotonic()))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    (a0, a1), (b0, b1) = sorted(spans)
    assert b0 >= a1, "two runs held one range's lease at the same time"
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(range_limit_name(fingerprint, shard_range))
    assert limit.limit == 1 and limit.active_slots == 0, "the lease was given back"
