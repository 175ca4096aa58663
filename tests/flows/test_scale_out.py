"""Scale-out: shard ranges as flow runs of extract-shards/gpu on a work pool, taken by real process
workers of a real Prefect server on this machine.

- one worker, then two workers, share a run of several ranges: both take ranges, the dataset is
  byte-identical to a single-process run (the timeline and the speed-up are printed);
- a worker killed in the middle of a range: the range's lease expires, the range is submitted
  again and taken by the other worker, the dataset is still identical, nothing lost or doubled;
- a second run of the same spec submits no range at all.

The engine is transformers on a tiny Llama (the engine is not the point here; set
DATAGEN_SCALE_OUT_ENGINE=vllm to measure with the vLLM engine instead).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import pytest

from datagen.tiny import make_chat_dataset
from tests.support.prefect_server import PrefectServer, Process, start_server

pytestmark = [pytest.mark.prefect_server]

REPO = Path(__file__).resolve().parents[2]
ENGINE = os.environ.get("DATAGEN_SCALE_OUT_ENGINE", "hf")
SHARDS, RANGES = 8, 2  # 8 shards of 2 rows, 2 ranges of 4 shards
# DATAGEN_SCALE_OUT_BENCH=1: also run the fan-out with one worker, for the speed-up of two.
BENCH = os.environ.get("DATAGEN_SCALE_OUT_BENCH") == "1"
LEASE_TTL_S = 20.0


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_llama) -> Path:
    root = tmp_path_factory.mktemp("scale-out")
    for name in ("flows", "tasks", "datagen", "images"):
        (root / name).symlink_to(REPO / name)
    (root / "prefect.yaml").write_text((REPO / "prefect.yaml").read_text())
    make_chat_dataset(root / "chat.jsonl", rows=2 * SHARDS, seed=3)
    (root / "model").symlink_to(tiny_llama)
    return root


@pytest.fixture(scope="module")
def server(project, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("server"))
    try:
        server.cli("work-pool", "create", "gpu", "--type", "process")
        server.cli("--no-prompt", "deploy", "--name", "gpu", cwd=project)
        yield server
    finally:
        server.stop()


def worker_env(project: Path) -> dict[str, str]:
    return {"DATAGEN_PROJECT_DIR": str(project), "DATAGEN_ENFORCE_EAGER": "1", "DATAGEN_CPU_KVCACHE_GIB": "1"}


def spec(project: Path, output: str, **overrides) -> dict:
    raw = {
        "model": str(project / "model"),
        "dataset": str(project / "chat.jsonl"),
        "output": str(project / output),
        "engine": {"name": ENGINE, "dtype": "float32"},
        "samples_per_shard": 2,
        "shards_per_task": SHARDS // RANGES,
        "ranges_in_flight": 2,
        "fan_out": {"deployment": "extract-shards/gpu", "lease_ttl_s": LEASE_TTL_S, "poll_interval_s": 1.0},
    }
    raw.update(overrides)
    return raw


def start_parent(server: PrefectServer, project: Path, raw_spec: dict, name: str) -> Process:
    """The extract flow, in a process of its own, against the server."""
    path = server.home / f"{name}.spec.json"
    path.write_text(json.dumps(raw_spec))
    log = server.home / f"{name}.parent.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.extract", "--spec", str(path)], cwd=project,
        env={**server.env, **worker_env(project)}, stdout=log.open("w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return Process(proc, log)


def finish(parent: Process, timeout: float = 1500) -> dict:
    parent.proc.wait(timeout=timeout)
    out = parent.output()
    lines = [line for line in out.splitlines() if line.startswith("extract-result: ")]
    assert parent.proc.returncode == 0 and lines, out[-5000:]
    return json.loads(lines[-1][len("extract-result: "):])


def run_parent(server, project, raw_spec, name) -> tuple[dict, float]:
    t0 = time.monotonic()
    result = finish(start_parent(server, project, raw_spec, name))
    return result, time.monotonic() - t0


def dataset_digest(path: Path) -> dict:
    """sha256 of every shard file, and the manifest without its creation time."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.pop("created_at")
    shards = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((path / "shards").iterdir())}
    return {"manifest": manifest, "shards": shards}


def range_runs(server: PrefectServer, since: float) -> list:
    """Flow runs of extract-shards/gpu created after ``since`` (epoch seconds), oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: server.url}):
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["gpu"])))
    return sorted((r for r in runs if r.created.timestamp() >= since), key=lambda r: r.created)


def worker_of(workers: dict[str, Process], run_id: UUID) -> str:
    """The worker that ran the flow run. Several workers may try to submit one run (one wins):
    the winner's log holds the run's own output, which names its URL."""
    for name, w in workers.items():
        if f"/flow-run/{run_id}" in w.output():
            return name
    return "?"


def timeline(server, workers, since: float, t0: float) -> list[dict]:
    rows = []
    for r in range_runs(server, since):
        start = r.start_time.timestamp() - t0 if r.start_time else None
        end = r.end_time.timestamp() - t0 if r.end_time else None
        rows.append({"run": r.name, "worker": worker_of(workers, r.id), "state": r.state.name,
                     "start_s": round(start, 1) if start is not None else None,
                     "end_s": round(end, 1) if end is not None else None})
    return rows


def print_timeline(title: str, rows: list[dict], wall: float) -> None:
    print(f"\n{title}: {wall:.1f} s")
    for row in rows:
        print(f"  {row['run']:<22} {row['worker']:<8} {row['state']:<10} {row['start_s']!s:>7} -> {row['end_s']!s:>7}")


def ensure_workers(server: PrefectServer, project: Path, *names: str) -> dict[str, Process]:
    """Live workers of pool gpu by name, started when missing."""
    live = {w.log.stem.removeprefix("worker-"): w for w in server.workers if w.proc.poll() is None}
    for name in names:
        if name not in live:
            live[name] = server.start_worker("gpu", name=name, limit=1, cwd=project, env=worker_env(project))
    return live


@pytest.fixture(scope="module")
def reference(project, server) -> dict:
    """The same spec extracted in one process (ranges one after the other, no fan-out)."""
    result, _ = run_parent(server, project, spec(project, "single", ranges_in_flight=1), "single")
    assert result["shards_extracted"] == list(range(SHARDS))
    return dataset_digest(project / "single")


def test_two_workers_share_the_ranges_and_the_dataset_is_identical_to_a_single_process_run(
    server, project, reference
):
    if BENCH:
        one = ensure_workers(server, project, "w1")
        t0, since = time.time(), time.time()
        result, wall_one = run_parent(server, project, spec(project, "one-worker"), "one-worker")
        print_timeline(f"one worker ({ENGINE} engine)", timeline(server, one, since, t0), wall_one)
        assert result["shards_extracted"] == list(range(SHARDS))
        assert dataset_digest(project / "one-worker") == reference

    two = ensure_workers(server, project, "w1", "w2")
    t0, since = time.time(), time.time()
    result, wall_two = run_parent(server, project, spec(project, "two-workers"), "two-workers")
    rows_two = timeline(server, two, since, t0)
    assert result["shards_extracted"] == list(range(SHARDS))
    assert dataset_digest(project / "two-workers") == reference
    assert {row["worker"] for row in rows_two} == {"w1", "w2"}, rows_two
    assert len(rows_two) == RANGES and all(row["state"] == "Completed" for row in rows_two)

    print_timeline(f"two workers ({ENGINE} engine)", rows_two, wall_two)
    if BENCH:
        print(f"speed-up of two workers over one: {wall_one / wall_two:.2f}x")


def test_a_second_run_of_the_same_spec_submits_no_range(server, project):
    ensure_workers(server, project, "w1", "w2")
    run_parent(server, project, spec(project, "two-workers"), "two-workers-first")  # cached if the test above ran
    since = time.time()
    result, wall = run_parent(server, project, spec(project, "two-workers"), "two-workers-again")
    assert result["shards_extracted"] == [] and result["ranges_cached"] == RANGES
    assert range_runs(server, since) == []
    print(f"\nsecond run, nothing to do: {wall:.1f} s")


def test_a_worker_killed_in_the_middle_of_a_range_loses_nothing(server, project, reference):
    workers = ensure_workers(server, project, "w1", "w2")
    since = time.time()
    parent = start_parent(server, project, spec(project, "killed"), "killed")
    victim, victim_run = _wait_for_a_half_done_range(server, workers, project / "killed", since)
    workers[victim].kill_tree()
    result = finish(parent)

    runs = range_runs(server, since)
    states = {r.name: r.state.name for r in runs}
    assert states[victim_run.name] == "Crashed", states
    assert sum(1 for r in runs if r.state.name == "Completed") == RANGES, states
    assert dataset_digest(project / "killed") == reference
    manifest = json.loads((project / "killed" / "manifest.json").read_text())
    assert [s["index"] for s in manifest["shards"]] == list(range(SHARDS))
    assert len(result["shards_extracted"]) < SHARDS, "the shards the killed worker wrote were kept"
    print_timeline(f"worker {victim} killed", timeline(server, workers, since, since), 0.0)


def _wait_for_a_half_done_range(server, workers, output: Path, since: float, timeout: float = 600):
    """A range that has written some of its shards and not all: (its worker's name, its flow run)."""
    records = output / ".datagen" / "shards"
    deadline = time.monotonic() + timeout
    running, last_api = [], 0.0
    while time.monotonic() < deadline:
        if time.monotonic() - last_api > 1.0:
            running = [r for r in range_runs(server, since) if r.state.is_running()]
            last_api = time.monotonic()
        for run in running:
            first, stop = (int(x) for x in run.name.split("-")[1:3])
            written = sum((records / f"shard-{k:06d}.json").exists() for k in range(first, stop))
            if 0 < written < stop - first and (name := worker_of(workers, run.id)) != "?":
                return name, run
        time.sleep(0.05)
    raise AssertionError("no range was caught between its first and its last shard")
