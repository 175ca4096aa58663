"""Scale-out on Prefect's own primitives and on object storage, with a real Prefect server, a real S3
server (SeaweedFS) and real process workers that share no directory: each worker has its own
working directory (the project's code), its own Prefect home and its own spool; the dataset lives
in the bucket, task results in a prefect-aws S3 block.

- two workers share the ranges; the dataset in the bucket is byte-identical to the single-node
  run's (below: one flow run, no fan-out); a second run of the same spec submits no range;
- a worker killed in the middle of a range: the lost-host automation marks its run Crashed when
  the heartbeats stop, the parent submits the range again, the other worker takes it once the
  range's lease (a global concurrency slot) expired, extracts only what the bucket lacks; the
  dataset is still identical (the timeline is printed);
- a single-node run whose worker's process group is killed: marked Crashed by the automation,
  retried through the API as the UI's Retry does, completes keeping the shards it had written; its
  dataset is the reference the fleets' datasets must equal byte for byte (a run with no fan-out: one
  flow run extracts every range), so the kill and retry are held to the same bytes as well.

Settings that keep it short: heartbeats every 30 s (Prefect's minimum), a lost-host window of
60 s, range leases of 60 s (the server's minimum), slow shards (a test hook) so that a range can
be caught half done. The engine is transformers on a tiny Llama.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import pytest

from datagen.testmodels.tiny import make_chat_dataset
from tests.flows.pools import create_process_pools
from tests.support.prefect_server import PrefectServer, Process, start_server
from tests.support.s3server import s3_server  # noqa: F401  (fixture)
from tests.support.step_hooks import worker_env

pytestmark = [pytest.mark.prefect_server, pytest.mark.s3]

REPO = Path(__file__).resolve().parents[2]
ENGINE = os.environ.get("DATAGEN_SCALE_OUT_ENGINE", "hf")
SHARDS, RANGES = 8, 2  # 8 shards of 2 rows, 2 ranges of 4 shards
LEASE_S = 60.0  # the server's minimum
HEARTBEAT_S = 30  # Prefect's minimum
LOST_HOST_WINDOW_S = 60
SLOW_SHARD_S = 2.0  # pause after each shard (tests/support/slow_datagen.py), to catch a range half done
BLOCK = "datagen-results-scale-out"
CODE = ("flows", "tasks", "datagen", "images")


def _code_dir(root: Path) -> Path:
    """A directory of its own with the project's code (what each host has: the image)."""
    root.mkdir(parents=True, exist_ok=True)
    for name in CODE:
        if not (root / name).exists():
            (root / name).symlink_to(REPO / name)
    return root


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_llama) -> Path:
    """The control host's directory: prefect.yaml, the code, the inputs (model, dataset)."""
    root = _code_dir(tmp_path_factory.mktemp("scale-out"))
    (root / "prefect.yaml").write_text((REPO / "prefect.yaml").read_text())
    make_chat_dataset(root / "chat.jsonl", rows=2 * SHARDS, seed=3)
    (root / "model").symlink_to(tiny_llama)
    return root


@pytest.fixture(scope="module")
def s3(s3_server):  # noqa: F811
    return s3_server


@pytest.fixture(scope="module")
def server(project, s3, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("server"))
    try:
        create_process_pools(server, "gpu", "cpu")
        # Deploying deploys the lost-host automation too (a build step of prefect.yaml).
        out = server.cli("--no-prompt", "deploy", "--name", "gpu", "--name", "tiny", cwd=project,
                         env={"DATAGEN_LOST_HOST_WINDOW_S": str(LOST_HOST_WINDOW_S)}).stdout
        assert "datagen-lost-host" in out, out
        _save_results_block(server, s3)
        yield server
    finally:
        server.stop()


def _save_results_block(server: PrefectServer, s3) -> None:  # noqa: F811
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_aws import AwsCredentials, S3Bucket
    from prefect_aws.client_parameters import AwsClientParameters

    bucket = s3.create_bucket()
    with temporary_settings(updates={PREFECT_API_URL: server.url}):
        S3Bucket(
            bucket_name=bucket,
            credentials=AwsCredentials(
                aws_access_key_id=s3.access_key, aws_secret_access_key=s3.secret_key, region_name=s3.region,
                aws_client_parameters=AwsClientParameters(endpoint_url=s3.endpoint_url),
            ),
        ).save(BLOCK, overwrite=True)


@pytest.fixture(scope="module")
def datasets(s3) -> str:  # noqa: F811
    return s3.create_bucket()


def host_env(s3, home: Path | None = None) -> dict[str, str]:  # noqa: F811
    env = {"DATAGEN_ENFORCE_EAGER": "1", "DATAGEN_CPU_KVCACHE_GIB": "1", "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
           "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S), **s3.env()}
    if home is not None:
        env["PREFECT_HOME"] = str(home / "prefect-home")
    return env


def start_worker(server: PrefectServer, s3, root: Path, pool: str, name: str) -> Process:  # noqa: F811
    """A worker host: its own working directory (the code), Prefect home and spool."""
    home = _code_dir(root / name)
    env = {**host_env(s3, home), "DATAGEN_PROJECT_DIR": str(home), "DATAGEN_SPOOL": str(home / "spool"),
           **worker_env(slow_shard_s=SLOW_SHARD_S)}
    return server.start_worker(pool, name=name, limit=1, cwd=home, env=env)


def spec(project: Path, datasets: str, name: str, **overrides) -> dict:
    raw = {
        "model": str(project / "model"),
        "dataset": str(project / "chat.jsonl"),
        "output": str(project / "out" / name),
        "publish_to": f"s3://{datasets}/{name}",
        "engine": {"name": ENGINE, "dtype": "float32"},
        "samples_per_shard": 2,
        "shards_per_task": SHARDS // RANGES,
        "ranges_in_flight": 2,
        "result_storage": f"s3-bucket/{BLOCK}",
        "validation": {"golden_samples": 0},  # the engine is not the point here
        "fan_out": {"deployment": "extract-shards/gpu", "lease_s": LEASE_S, "poll_interval_s": 1.0},
    }
    raw.update(overrides)
    return raw


def start_parent(server: PrefectServer, s3, project: Path, raw_spec: dict, name: str) -> Process:  # noqa: F811
    """The extract flow, in a process of its own (the control host), against the server."""
    path = server.home / f"{name}.spec.json"
    path.write_text(json.dumps(raw_spec))
    log = server.home / f"{name}.parent.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.extract", "--spec", str(path)], cwd=project,
        env={**server.env, **host_env(s3)}, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    return Process(proc, log)


def finish(parent: Process, timeout: float = 900) -> dict:
    parent.proc.wait(timeout=timeout)
    out = parent.output()
    lines = [line for line in out.splitlines() if line.startswith("extract-result: ")]
    assert parent.proc.returncode == 0 and lines, out[-5000:]
    return json.loads(lines[-1][len("extract-result: "):])


def run_parent(server, s3, project, raw_spec, name) -> tuple[dict, float]:  # noqa: F811
    t0 = time.monotonic()
    result = finish(start_parent(server, s3, project, raw_spec, name))
    return result, time.monotonic() - t0


def bucket_digest(s3, bucket: str, prefix: str) -> dict:  # noqa: F811
    """sha256 of every shard object, and the manifest without its creation time (what readers see)."""
    client = s3.client()
    objects = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/shards/").get("Contents", [])
    shards = {o["Key"].rsplit("/", 1)[1]: hashlib.sha256(client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()).hexdigest()
              for o in objects}
    manifest = json.loads(client.get_object(Bucket=bucket, Key=f"{prefix}/manifest.json")["Body"].read())
    manifest.pop("created_at")
    return {"manifest": manifest, "shards": shards}


def _api(server: PrefectServer):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    class _Ctx:
        def __enter__(self):
            self._settings = temporary_settings(updates={PREFECT_API_URL: server.url})
            self._settings.__enter__()
            self._client = get_client(sync_client=True)
            return self._client.__enter__()

        def __exit__(self, *exc):
            self._client.__exit__(*exc)
            self._settings.__exit__(*exc)

    return _Ctx()


def range_runs(server: PrefectServer, since: float) -> list:
    """Flow runs of extract-shards/gpu created after ``since`` (epoch seconds), oldest first."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    with _api(server) as client:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["gpu"])))
    return sorted((r for r in runs if r.created.timestamp() >= since), key=lambda r: r.created)


def worker_of(workers: dict[str, Process], run_id: UUID) -> str:
    """The worker that ran the flow run (its log names the run's URL)."""
    for name, w in workers.items():
        if f"/flow-run/{run_id}" in w.output():
            return name
    return "?"


def live_workers(server: PrefectServer, s3, root: Path, pool: str, *names: str) -> dict[str, Process]:  # noqa: F811
    live = {w.log.stem.removeprefix("worker-"): w for w in server.workers if w.proc.poll() is None}
    for name in names:
        if name not in live:
            live[name] = start_worker(server, s3, root, pool, name)
    return {n: live[n] for n in names}


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hosts")


@pytest.fixture(scope="module")
def reference(single_node) -> dict:
    """The same spec extracted without fan-out (the single-node run: one flow run extracts every
    range), validated: what the fleets' datasets must be byte for byte."""
    return local_digest(single_node["output"])


def local_digest(output: Path) -> dict:
    """``bucket_digest`` of a dataset on a local disk."""
    shards = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (output / "shards").iterdir()}
    manifest = json.loads((output / "manifest.json").read_text())
    manifest.pop("created_at")
    return {"manifest": manifest, "shards": shards}


# The fleet's dataset is validated with golden rows (re-extracted by the reference), as production's.
FLEET_VALIDATION = {"golden_samples": 2}


@pytest.fixture(scope="module")
def fleet(server, s3, project, hosts, datasets):  # noqa: F811
    """A dataset extracted by two workers into the bucket's prefix "fleet": (the run's summary, its
    wall time, its range runs, the workers)."""
    workers = live_workers(server, s3, hosts, "gpu", "w1", "w2")
    since = time.time()
    result, wall = run_parent(server, s3, project, spec(project, datasets, "fleet", validation=FLEET_VALIDATION),
                              "fleet")
    return result, wall, range_runs(server, since), workers


def test_two_workers_share_the_ranges_the_bucket_holds_the_single_process_dataset_and_a_second_run_submits_nothing(
    server, s3, project, hosts, datasets, reference, fleet  # noqa: F811
):
    result, wall, runs, workers = fleet
    assert result["shards_extracted"] == list(range(SHARDS))
    assert result["validation"].startswith("passed") and "golden" in result["validation"], result["validation"]
    assert result["uri"] == f"s3://{datasets}/fleet"
    assert bucket_digest(s3, datasets, "fleet") == reference
    assert {worker_of(workers, r.id) for r in runs} == {"w1", "w2"}, [(r.name, r.state.name) for r in runs]
    assert len(runs) == RANGES and all(r.state.name == "Completed" for r in runs)
    for name in workers:  # the spool is only a spool: every uploaded shard left it (the stored plan stays)
        spool = hosts / name / "spool" / "fleet"  # $DATAGEN_SPOOL/<output name>: this run's (a killed
        assert spool.is_dir(), name               # worker of another test may have left its own beside it)
        assert not [p for p in spool.rglob("*.safetensors") if ".datagen" not in p.parts], name
    print(f"\ntwo workers, {RANGES} ranges: {wall:.1f} s")

    # A second run of the same spec submits no range at all.
    since = time.time()
    again, wall = run_parent(server, s3, project, spec(project, datasets, "fleet", validation=FLEET_VALIDATION),
                             "fleet-again")
    assert again["shards_extracted"] == [] and again["ranges_cached"] == RANGES
    assert range_runs(server, since) == []
    print(f"second run, nothing to do: {wall:.1f} s")


def test_a_shard_corrupted_in_the_bucket_fails_validation_and_nothing_is_handed_off(
    server, s3, project, datasets, fleet  # noqa: F811
):
    """The bucket's check (size, sha256 metadata) cannot see bytes that rotted in place; validation
    reads them, and the manifest is never written: no dataset is announced to training."""
    client = s3.client()
    key, manifest_key = "fleet/shards/shard-000001.safetensors", "fleet/manifest.json"
    original = client.get_object(Bucket=datasets, Key=key)
    data, metadata = original["Body"].read(), original["Metadata"]
    manifest = client.get_object(Bucket=datasets, Key=manifest_key)["Body"].read()
    rotted = bytearray(data)
    rotted[-64:] = bytes(b ^ 0xFF for b in rotted[-64:])  # tensor bytes rotted: same size, same metadata
    client.put_object(Bucket=datasets, Key=key, Body=bytes(rotted), Metadata=metadata)
    client.delete_object(Bucket=datasets, Key=manifest_key)
    try:
        parent = start_parent(server, s3, project, spec(project, datasets, "fleet", validation=FLEET_VALIDATION),
                              "fleet-corrupt")
        parent.proc.wait(timeout=900)
        out = parent.output()
        assert parent.proc.returncode != 0, out[-5000:]
        assert "shard_checksum" in out and "Task run 'validate" in out, out[-5000:]
        assert "Task run 'publish-manifest" not in out and "Task run 'announce" not in out, out[-5000:]
        assert "Contents" not in client.list_objects_v2(Bucket=datasets, Prefix=manifest_key)
    finally:  # the prefix as the module's other tests expect it
        client.put_object(Bucket=datasets, Key=key, Body=data, Metadata=metadata)
        client.put_object(Bucket=datasets, Key=manifest_key, Body=manifest)


def test_a_worker_killed_in_the_middle_of_a_range_loses_nothing(
    server, s3, project, hosts, datasets, reference  # noqa: F811
):
    workers = live_workers(server, s3, hosts, "gpu", "w1", "w2")
    since = time.time()
    parent = start_parent(server, s3, project, spec(project, datasets, "killed"), "killed")
    victim, victim_run, kept = _wait_for_a_half_done_range(server, s3, workers, datasets, "killed", since)
    workers[victim].kill_tree()
    killed_at = time.time()
    result = finish(parent)

    runs = range_runs(server, since)
    states = {r.name: r.state.name for r in runs}
    victim_final = next(r for r in runs if r.id == victim_run.id)
    assert victim_final.state.is_crashed() and "No heartbeat" in (victim_final.state.message or ""), states
    retry = next(r for r in runs if r.name == f"{victim_run.name}-retry1")
    survivor = next(n for n in workers if n != victim)
    assert retry.state.is_completed() and worker_of(workers, retry.id) == survivor, states
    assert sum(1 for r in runs if r.state.name == "Completed") == RANGES, states
    assert bucket_digest(s3, datasets, "killed") == reference
    assert not set(kept) & set(result["shards_extracted"]), "the shards the killed worker uploaded were kept"

    with _api(server) as client:
        crashed_at = next(s.timestamp for s in client.read_flow_run_states(victim_run.id) if s.is_crashed()).timestamp()
    logs = _run_logs(server, retry.id)
    waited = next((m for m in logs if "lease held" in m), "?")
    print(f"\nworker {victim} killed with range {victim_run.name} half done (shards {kept} in the bucket); "
          f"lease {LEASE_S:.0f} s, heartbeats every {HEARTBEAT_S} s, lost-host window {LOST_HOST_WINDOW_S} s")
    print(f"  kill                          0.0 s")
    print(f"  marked Crashed (automation)  {crashed_at - killed_at:5.1f} s")
    print(f"  range submitted again        {retry.created.timestamp() - killed_at:5.1f} s  ({retry.name})")
    print(f"  retry started on {survivor:<10}  {retry.start_time.timestamp() - killed_at:5.1f} s  ({waited})")
    print(f"  retry completed              {retry.end_time.timestamp() - killed_at:5.1f} s")
    print(f"  parent done                  {time.time() - killed_at:5.1f} s")


def _run_logs(server: PrefectServer, run_id) -> list[str]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with _api(server) as client:
        return [log.message for log in client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=200)]


def _wait_for_a_half_done_range(server, s3, workers, bucket: str, prefix: str, since: float,  # noqa: F811
                                timeout: float = 600):
    """A range with some of its shards in the bucket and not all: (its worker, its flow run, shards)."""
    client = s3.client()
    deadline = time.monotonic() + timeout
    running, last_api = [], 0.0
    while time.monotonic() < deadline:
        if time.monotonic() - last_api > 1.0:
            running = [r for r in range_runs(server, since) if r.state.is_running()]
            last_api = time.monotonic()
        listed = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/.datagen/shards/").get("Contents", [])}
        for run in running:
            first, stop = (int(x) for x in run.name.split("-")[1:3])
            done = [k for k in range(first, stop) if f"{prefix}/.datagen/shards/shard-{k:06d}.json" in listed]
            if 0 < len(done) < stop - first and (name := worker_of(workers, run.id)) != "?":
                return name, run, done
        time.sleep(0.2)
    raise AssertionError("no range was caught between its first and its last shard")


@pytest.fixture(scope="module")
def single_node(server, s3, project, hosts, datasets) -> dict:  # noqa: F811
    """A single-node run (deployment extract/tiny on a worker of pool cpu, no fan-out) whose worker is
    killed with a range done and the next under way, then retried through the API as the UI's Retry
    does: what the test below checks, and the dataset ``reference`` reads."""
    from prefect.states import AwaitingRetry

    worker = live_workers(server, s3, hosts, "cpu", "cpu-1")["cpu-1"]
    output = project / "out" / "single-node"
    raw = spec(project, datasets, "single-node", ranges_in_flight=1, publish_to=None)
    with _api(server) as client:
        deployment = client.read_deployment_by_name("extract/tiny")
        run = client.create_flow_run_from_deployment(deployment.id, parameters={"spec": raw})
    shards = output / "shards"
    deadline = time.monotonic() + 600
    while len(list(shards.glob("shard-*.safetensors"))) < SHARDS // RANGES + 1:  # a range done, one under way
        assert time.monotonic() < deadline, "the run wrote no shards"
        time.sleep(0.2)
    kept = {p.name: p.stat().st_mtime_ns for p in shards.glob("shard-*.safetensors")}
    worker.kill_tree()  # the worker's process group and everything it started: a lost host
    killed_at = time.time()

    deadline = time.monotonic() + 5 * LOST_HOST_WINDOW_S
    with _api(server) as client:
        while not (state := client.read_flow_run(run.id).state).is_crashed():
            assert time.monotonic() < deadline and not state.is_final(), state
            time.sleep(1)
    crashed_s = time.time() - killed_at

    live_workers(server, s3, hosts, "cpu", "cpu-2")
    with _api(server) as client:
        client.set_flow_run_state(run.id, AwaitingRetry(message="Retry from the UI"), force=True)
        deadline = time.monotonic() + 600
        while not (final := client.read_flow_run(run.id)).state.is_final() or final.run_count < 2:
            assert time.monotonic() < deadline, f"the retried run did not finish: {final.state}"
            time.sleep(1)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tests.support.prefect_runs import task_runs

    with temporary_settings(updates={PREFECT_API_URL: server.url}):
        retried = [r for r in task_runs(run.id)["extract-range"] if r.flow_run_run_count == 2]
    return {"output": output, "kept": kept, "crashed": state, "crashed_s": crashed_s, "final": final,
            "retried": retried}


def test_a_single_node_run_whose_worker_is_killed_is_marked_crashed_and_completes_after_a_retry(single_node):
    output, kept, final = single_node["output"], single_node["kept"], single_node["final"]
    assert "No heartbeat" in (single_node["crashed"].message or ""), single_node["crashed"]
    assert final.state.is_completed(), final.state.message
    assert sorted(r.state.name for r in single_node["retried"]) == ["Cached", "Completed"], \
        "the finished range came from the cache"
    manifest = json.loads((output / "manifest.json").read_text())
    assert len(manifest["shards"]) == SHARDS
    now = {p.name: p.stat().st_mtime_ns for p in (output / "shards").glob("shard-*.safetensors")}
    assert {k: now[k] for k in kept} == kept, "shards written before the kill were kept, not written again"
    print(f"\nsingle-node run: worker killed with {len(kept)} of {SHARDS} shards written; marked Crashed "
          f"{single_node['crashed_s']:.1f} s later (window {LOST_HOST_WINDOW_S} s, heartbeats every {HEARTBEAT_S} s); "
          f"completed after a retry, keeping them")
