"""End to end against a real Prefect server and a real process worker, with the real vLLM engine:
`prefect deploy` from prefect.yaml, `prefect deployment run extract/tiny --watch`, a run that fails
for real and is retried through the API as the UI's Retry button does (the retry's plan step meets a
transient fault, retried; its range comes from the cache), and the training deployment triggered by
the dataset's event.

The project is a copy of prefect.yaml next to links to the code, in a temporary directory: the
tiny deployment's relative paths (model, dataset, output) land there, not in the checkout.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from uuid import UUID

import pytest

from datagen.errors import EXIT_BAD_INPUT, EXIT_TRANSIENT
from tests.flows.pools import create_process_pools
from tests.support.prefect_server import PrefectServer, flow_run_id, start_server
from tests.support.step_hooks import worker_env

pytestmark = [pytest.mark.prefect_server, pytest.mark.engine]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A project directory: prefect.yaml, links to the code, the tiny model and dataset."""
    from flows.demo import prepare

    root = tmp_path_factory.mktemp("project")
    for name in ("flows", "tasks", "datagen", "images"):
        (root / name).symlink_to(REPO / name)
    (root / "prefect.yaml").write_text(for_this_module((REPO / "prefect.yaml").read_text()))
    prepare(root)
    return root


# What this module proves is the wiring, not the amounts, so its copy of prefect.yaml asks for less:
# - the tiny deployment's 4 shards in one range (one `datagen extract` program and engine start per
#   extracting run, not two): the retry and the cache hold per range, whatever their number
#   (several ranges, in order and at once, are tests/flows/test_extract_flow.py's and
#   tests/flows/test_scale_out.py's);
# - the triggered train run's optimizer steps: the event starts it on its pool's worker, it trains,
#   measures and reports a draft; how well a draft learns is tests/test_train_smollm2.py's and
#   tests/training/'s. The default 60 steps were most of its 230-260 s in the suite.
SHARDS, TRAIN_STEPS = 4, 4


def for_this_module(text: str) -> str:
    """prefect.yaml with the tiny deployment's shards in one range and the train trigger asking for
    TRAIN_STEPS optimizer steps (each edit checked: a moved line fails here, not later)."""
    edits = {
        "        samples_per_shard: 8\n        shards_per_task: 2\n":
            f"        samples_per_shard: 8\n        shards_per_task: {SHARDS}\n",
        '          fingerprint: "{{ event.payload.fingerprint }}"\n':
            '          fingerprint: "{{ event.payload.fingerprint }}"\n'
            f'          settings: {{"steps": {TRAIN_STEPS}}}\n',
    }
    for old, new in edits.items():
        assert text.count(old) == 1, f"prefect.yaml changed where this module edits its copy: {old!r}"
        text = text.replace(old, new)
    return text


@pytest.fixture(scope="module")
def server(project, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("server"))
    try:
        create_process_pools(server, "cpu", "gpu", "control")
        server.cli("--no-prompt", "deploy", "--all", cwd=project)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults") / "faults.json"


@pytest.fixture(scope="module")
def worker(server, project, faults):
    return server.start_worker(
        "cpu", name="cpu-1", cwd=project,
        env={"DATAGEN_ENFORCE_EAGER": "1", "DATAGEN_CPU_KVCACHE_GIB": "1", **worker_env(faults=faults)},
    )


def run_tiny(server: PrefectServer, project: Path) -> tuple[int, str, float]:
    t0 = time.monotonic()
    proc = server.cli("deployment", "run", "extract/tiny", "--watch", "--watch-timeout", "900", cwd=project, check=False)
    return proc.returncode, flow_run_id(proc.stdout + proc.stderr), time.monotonic() - t0


def read_flow_run(server: PrefectServer, run_id: str):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: server.url}):
        with get_client(sync_client=True) as client:
            return client.read_flow_run(UUID(run_id))


def task_runs_of(server: PrefectServer, run_id: str, *, attempt: int | None = None) -> dict[str, list]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tests.support.prefect_runs import task_runs

    with temporary_settings(updates={PREFECT_API_URL: server.url}):
        runs = task_runs(run_id)
    if attempt is None:
        return runs
    return {k: [r for r in v if r.flow_run_run_count == attempt] for k, v in runs.items()}


def test_every_deployment_of_prefect_yaml_deploys_kimi_included(server):
    out = server.cli("deployment", "ls").stdout
    for name in ("extract/tiny", "extract/kimi", "extract/kimi-fleet", "extract-shards/gpu", "train/train"):
        assert name in out, out


@pytest.fixture(scope="module")
def retried_run(server, project, worker, faults) -> dict:
    """The module's first run, into an empty output: it extracts its one range (a vLLM engine),
    then its finalize step fails for good; then the UI's Retry button, through the API, whose plan
    step meets a transient fault (retried within the attempt). Every test that needs a finished
    dataset or a warm cache asks for this, so the tests run in any order. (A fully cached re-run of
    its own, which this module made before, is tests/flows/test_extract_flow.py's: every step
    Cached, with the transient fault's retry in a run of that module too.)"""
    faults.write_text(json.dumps({"finalize": {"exit_code": EXIT_BAD_INPUT, "times": 1, "message": "manifest refused"}}))
    code, run_id, _ = run_tiny(server, project)
    failed = read_flow_run(server, run_id)
    first = task_runs_of(server, run_id, attempt=1)
    faults.write_text(json.dumps({"plan": {"exit_code": EXIT_TRANSIENT, "times": 1, "message": "storage hiccup"}}))

    # The UI's Retry button: the flow run goes back to Scheduled ("AwaitingRetry"); a worker takes it.
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import AwaitingRetry

    if failed.state.is_failed():
        with temporary_settings(updates={PREFECT_API_URL: server.url}):
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(UUID(run_id), AwaitingRetry(message="Retry from the UI"), force=True)
        deadline = time.monotonic() + 600
        while not (run := read_flow_run(server, run_id)).state.is_final() or run.run_count < 2:
            assert time.monotonic() < deadline, f"the retried run did not finish: {run.state}"
            time.sleep(2)
    faults.write_text("{}")
    return {"code": code, "failed": failed, "first": first, "run": read_flow_run(server, run_id),
            "second": task_runs_of(server, run_id, attempt=2)}


def test_a_run_that_failed_for_real_is_retried_from_the_api_without_recomputing_its_steps(project, retried_run):
    assert retried_run["code"] == 1
    failed = retried_run["failed"]
    assert failed.state.is_failed() and "manifest refused" in (failed.state.message or "")
    first = retried_run["first"]
    assert [r.state.name for r in first["extract-range"]] == ["Completed"]
    assert [r.run_count for r in first["finalize"]] == [1], "a permanent fault is not retried"

    run = retried_run["run"]
    assert run.run_count >= 2 and run.state.is_completed(), run.state.message
    second = retried_run["second"]
    assert [r.state.name for r in second["extract-range"]] == ["Cached"], "the retry starts no engine"
    assert [r.state.name for r in second["finalize"]] == ["Completed"]

    dataset = project / "out" / "tiny"
    manifest = json.loads((dataset / "manifest.json").read_text())
    report = json.loads((dataset / ".datagen" / "validation.json").read_text())
    assert report["ok"] is True and manifest["totals"]["shards"] == SHARDS


def test_the_retrys_transient_fault_is_retried_within_the_attempt_and_the_run_completes(retried_run):
    """A transient fault (EXIT_TRANSIENT) in the retried run's plan step: the task is retried and the
    flow run completes, through the real server and worker."""
    [plan] = retried_run["second"]["plan"]
    assert plan.run_count == 2 and plan.state.is_completed()
    assert retried_run["run"].state.is_completed()


def test_the_new_dataset_triggered_the_training_deployment(server, project, retried_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    fingerprint = json.loads((project / "out" / "tiny" / "manifest.json").read_text())["fingerprint"]
    deadline = time.monotonic() + 60
    with temporary_settings(updates={PREFECT_API_URL: server.url}):
        with get_client(sync_client=True) as client:
            while True:
                runs = client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["train"])))
                if runs or time.monotonic() > deadline:
                    break
                time.sleep(2)
    assert [r.parameters["fingerprint"] for r in runs] == [fingerprint], "one training run, for the new dataset only"


def test_the_triggered_training_run_trains_and_measures_a_draft_on_its_pools_worker(server, project, retried_run):
    """The event's train run is taken by a worker of the deployment's pool (`gpu`: in production a
    GPU host; here a process worker on this CPU machine), trains an EAGLE-3 draft next to the
    dataset with speculators' trainer, measures it on the held-out rows and reports it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, DeploymentFilter, DeploymentFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    manifest = json.loads((project / "out" / "tiny" / "manifest.json").read_text())
    # this CPU machine stands in for a GPU host: its worker declares that it trains on the CPU
    gpu_worker = server.start_worker("gpu", name="gpu-1", cwd=project,
                                     env={"DATAGEN_ENFORCE_EAGER": "1", "DATAGEN_PROJECT_DIR": str(project),
                                          "DATAGEN_TRAIN_DEVICE": "cpu"})
    deadline = time.monotonic() + 900
    with temporary_settings(updates={PREFECT_API_URL: server.url}):
        with get_client(sync_client=True) as client:
            while True:  # the event creates the run a few seconds after the extraction ends
                runs = client.read_flow_runs(
                    deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["train"])))
                if (runs and runs[0].state.is_final()) or time.monotonic() > deadline:
                    break
                time.sleep(3)
            reports = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["draft-report"])))
    assert len(runs) == 1, f"{len(runs)} train runs\n{gpu_worker.output()[-3000:]}"
    run = runs[0]
    assert run.state.is_completed(), f"{run.state.type}: {run.state.message}\n{gpu_worker.output()[-3000:]}"
    lineage = json.loads(next((project / "out").glob("tiny.draft-*/datagen_draft.json")).read_text())
    assert lineage["dataset_fingerprint"] == manifest["fingerprint"]
    assert lineage["steps_done"] == TRAIN_STEPS, lineage  # the trigger's parameters reached the step
    assert reports, "the night's draft report is an artifact of the run"
