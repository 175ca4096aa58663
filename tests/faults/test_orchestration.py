"""Orchestration faults against a real Prefect server and real process workers: the worker killed
in the middle of a run (with the flow run and the extraction it started), and the Prefect server
stopped and restarted in the middle of a run.

The deployment runs the `extract` flow on a dataset of 12 shards (one shard range); the worker's
extraction pauses after each shard (tests/support/slow_datagen.py) so that the faults land during
extraction. Each ends in a completed run whose dataset is byte-identical to an uninterrupted
extraction, the shards written before the fault kept.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import httpx
import pytest
import yaml

from datagen.data.contract import MANIFEST_NAME
from tests.builders import REPO, run_datagen
from tests.faults.conftest import full_campaign
from tests.support.prefect_server import Process, PrefectServer, flow_run_id, start_server
from tests.support.step_hooks import worker_env

pytestmark = [pytest.mark.prefect_server, pytest.mark.timeout(1500),
              pytest.mark.skipif(not full_campaign(), reason="full campaign only (make faults): a Prefect server and "
                                 "two flow runs per test; the flow tests cover Prefect in make test")]

# The transformers engine: what is under test is Prefect's handling of the fault; killing the vLLM
# engine's process group is the crash campaign's (test_crash_anywhere.py).
ENGINE = "hf"
SHARDS = 12
SPEC = {"engine": {"name": ENGINE, "max_num_batched_tokens": 512}, "samples_per_shard": 2,
        "shards_per_task": SHARDS, "preprocessing": {"max_seq_len": 256}, "validation": {"golden_samples": 1}}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_llama) -> dict:
    from datagen.testmodels.tiny import make_chat_dataset

    root = tmp_path_factory.mktemp("orchestration-inputs")
    rows = make_chat_dataset(root / "rows.jsonl", rows=2 * SHARDS, seed=11)
    ref = root / "reference"
    # the flow extracts with the revision its download step resolved (for a local directory: its
    # content fingerprint), which is part of every shard key: the reference uses the same
    from datagen.storage.download import download
    from datagen.specs.source import parse_sources_spec

    revision = download(parse_sources_spec({"model": str(tiny_llama), "out": str(ref)})).model_revision
    args = ["extract", "--model", str(tiny_llama), "--model-revision", revision, "--dataset", str(rows),
            "--out", str(ref), "--engine", ENGINE,
            "--samples-per-shard", "2", "--max-seq-len", "256", "--max-num-batched-tokens", "512"]
    proc = run_datagen(*args, env={"DATAGEN_ENFORCE_EAGER": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"model": str(tiny_llama), "rows": rows, "reference": ref}


@pytest.fixture(scope="module")
def project(tmp_path_factory, inputs) -> Path:
    """A project directory: links to the code and a prefect.yaml with one deployment per test."""
    root = tmp_path_factory.mktemp("orchestration-project")
    for name in ("flows", "tasks", "datagen", "images"):
        (root / name).symlink_to(REPO / name)
    deployments = []
    for name in ("worker-killed", "server-restarted"):
        spec = {"model": inputs["model"], "dataset": str(inputs["rows"]), "output": str(root / "out" / name), **SPEC}
        deployments.append({"name": name, "entrypoint": "flows/extract.py:extract", "work_pool": {"name": "cpu"},
                            "parameters": {"spec": spec}})
    (root / "prefect.yaml").write_text(yaml.safe_dump({"name": "datagen-faults", "prefect-version": "3.9.1",
                                                       "build": None, "push": None, "deployments": deployments}))
    return root


@pytest.fixture(scope="module")
def server(project, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("orchestration-server"))
    try:
        server.cli("work-pool", "create", "cpu", "--type", "process")
        server.cli("--no-prompt", "deploy", "--all", cwd=project)
        yield server
    finally:
        server.stop()


ENGINE_ENV = {"DATAGEN_ENFORCE_EAGER": "1", "DATAGEN_CPU_KVCACHE_GIB": "1"}
WORKER_ENV = {**ENGINE_ENV, **worker_env(slow_shard_s=1.5)}


def _client(server: PrefectServer):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    class _Ctx:
        def __enter__(self):
            self.settings = temporary_settings(updates={PREFECT_API_URL: server.url})
            self.settings.__enter__()
            self.client = get_client(sync_client=True)
            return self.client.__enter__()

        def __exit__(self, *exc):
            self.client.__exit__(*exc)
            self.settings.__exit__(*exc)

    return _Ctx()


def _flow_run(server: PrefectServer, run_id: str):
    with _client(server) as c:
        return c.read_flow_run(UUID(run_id))


def _wait_final(server: PrefectServer, run_id: str, *, timeout: float = 900, min_run_count: int = 1):
    deadline = time.monotonic() + timeout
    while True:
        try:
            run = _flow_run(server, run_id)
            if run.state.is_final() and run.run_count >= min_run_count:
                return run
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the flow run did not finish"
        time.sleep(2)


def _wait_shards(out: Path, n: int, *, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while len(list((out / "shards").glob("shard-*.safetensors"))) < n if (out / "shards").is_dir() else True:
        assert time.monotonic() < deadline, f"fewer than {n} shards appeared in {out}"
        time.sleep(0.2)


def _shards(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "shards").glob("shard-*.safetensors"))}


def _same_as_reference(out: Path, reference: Path) -> None:
    assert _shards(out) == _shards(reference)
    got = json.loads((out / MANIFEST_NAME).read_text())
    want = json.loads((reference / MANIFEST_NAME).read_text())
    assert got["shards"] == want["shards"] and got["fingerprint"] == want["fingerprint"]


def _extract_results(server: PrefectServer, run_id: str) -> list[dict]:
    """The result lines of every `datagen extract` the run started, from its log (oldest first)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with _client(server) as c:
        logs = c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(run_id)])))
    found = []
    for lg in sorted(logs, key=lambda x: x.timestamp):
        msg = lg.message or ""
        if "datagen-result: " in msg and '"shards_cached"' in msg:
            found.append(json.loads(msg.split("datagen-result: ", 1)[1]))
    return found


def _record(case, name: str, **kw) -> None:
    case.category = "infrastructure"
    case.case = name
    for k, v in kw.items():
        setattr(case, k, v) if k in ("attempts", "outcome", "data_lost") else case.details.__setitem__(k, v)


def test_a_worker_killed_mid_run_is_recovered_by_retrying_the_run(server, project, inputs, case):
    out = project / "out" / "worker-killed"
    worker = server.start_worker("cpu", name="w-killed", cwd=project, env=WORKER_ENV)
    run_id = flow_run_id(server.cli("deployment", "run", "extract/worker-killed", cwd=project).stdout)
    _wait_shards(out, 3)
    on_disk = len(_shards(out))
    worker.kill_tree()  # the host is gone: the worker, the flow run's process, the extraction
    time.sleep(5)
    after_kill = _flow_run(server, run_id).state
    assert not (out / MANIFEST_NAME).exists(), "a killed run left a manifest"

    # What the UI's Retry does for a run stuck Running on a lost host; a new worker takes it.
    from prefect.states import AwaitingRetry

    with _client(server) as c:
        c.set_flow_run_state(UUID(run_id), AwaitingRetry(message="worker lost: retry"), force=True)
    worker2 = server.start_worker("cpu", name="w-replacement", cwd=project, env=ENGINE_ENV)
    run = _wait_final(server, run_id, min_run_count=2)
    assert run.state.is_completed(), run.state.message
    _same_as_reference(out, inputs["reference"])
    resumed = [r for r in _extract_results(server, run_id) if r["shards_extracted"]]
    assert resumed and len(resumed[0]["shards_cached"]) >= on_disk, resumed
    worker2.stop()
    _record(case, f"Prefect worker killed (with its flow run and extraction) mid-run ({ENGINE} engine)",
            attempts=1, outcome=f"the run stayed {after_kill.name} on the server; retried from the API, a new worker "
                                f"finished it byte-identical, the {on_disk} shards written before the kill kept",
            data_lost="0", state_after_kill=after_kill.name, shards_before_kill=on_disk)


def _restart(server: PrefectServer, down_s: float) -> float:
    """Stop the server's process tree, wait, start it on the same port and home; seconds down."""
    t0 = time.monotonic()
    server.process.stop()
    time.sleep(down_s)
    port = server.url.rsplit(":", 1)[1].split("/")[0]
    log = server.home / "server-restarted.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", port],
        env={**server.env, "PREFECT_API_URL": ""}, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    server.process = Process(proc, log)
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return round(time.monotonic() - t0, 1)
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


def test_the_prefect_server_restarted_mid_run_ends_in_a_completed_run(server, project, inputs, case):
    out = project / "out" / "server-restarted"
    worker = server.start_worker("cpu", name="w-restart", cwd=project, env=WORKER_ENV)
    run_id = flow_run_id(server.cli("deployment", "run", "extract/server-restarted", cwd=project).stdout)
    _wait_shards(out, 2)
    downtime = _restart(server, down_s=10)
    run = _wait_final(server, run_id)
    first_state = run.state.name
    retried = False
    if not run.state.is_completed():
        # a clear failure: retry the run from the API; extraction resumes from the shards on disk
        from prefect.states import AwaitingRetry

        with _client(server) as c:
            c.set_flow_run_state(UUID(run_id), AwaitingRetry(message="server restart: retry"), force=True)
        run = _wait_final(server, run_id, min_run_count=run.run_count + 1)
        retried = True
    assert run.state.is_completed(), run.state.message
    _same_as_reference(out, inputs["reference"])
    worker.stop()
    _record(case, f"Prefect server stopped and restarted mid-run ({ENGINE} engine)", attempts=1,
            outcome=(f"server down {downtime} s; the run " + (f"ended {first_state}, was retried from the API and "
                     "completed" if retried else "completed without intervention") + "; dataset byte-identical"),
            data_lost="0", downtime_s=downtime, first_final_state=first_state, retried=retried)
