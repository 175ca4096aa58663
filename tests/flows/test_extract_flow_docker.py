"""The extract flow with the docker runner: every step in its container, on a real Docker engine.

The docker runner extracts a tiny dataset while a test thread `docker kill`s the first extract
container; the task retries, the run completes, the shards are byte-identical to the local
runner's extraction of the same rows (the ``runs`` fixture the extract-flow tests share), and no
container is left behind.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from flows.extract import extract
from images.tags import DEFAULT_IMAGES
from tasks.docker_runner import LABEL_PREFIX, MANAGED_LABEL
from tests.flows.builders import chat_rows, pipeline_spec
from tests.support.docker_engine import BUILD_TIMEOUT_S, built_images, docker_client

pytestmark = [
    pytest.mark.docker,
    pytest.mark.prefect_server,  # the prefect_harness, and the local run it compares with (tests/flows/conftest.py)
    pytest.mark.timeout(BUILD_TIMEOUT_S),
    pytest.mark.usefixtures("prefect_harness"),
]


def shard_checksums(output: Path) -> list[tuple[str, str]]:
    manifest = json.loads((output / "manifest.json").read_text())
    return [(shard["path"], shard["sha256"]) for shard in manifest["shards"]]


def kill_first_container(client, step: str, killed: list[str], *, under: Path, done: threading.Event,
                         timeout_s: float = 600) -> None:
    """`docker kill` the first running container of ``step`` the runner starts for this test: one
    that mounts a path under ``under`` (another run on the same Docker engine is left alone).
    Gives up when ``done`` is set (the run ended without one: the test fails on ``killed``)."""
    wanted = [f"{MANAGED_LABEL}=true", f"{LABEL_PREFIX}step={step}"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done.is_set():
        for container in client.containers.list(filters={"label": wanted}):
            if not any(str(m.get("Source", "")).startswith(f"{under}/") for m in container.attrs.get("Mounts", [])):
                continue
            container.kill()
            killed.append(container.labels.get(LABEL_PREFIX + "flow-run-id", ""))
            return
        time.sleep(0.1)


def test_tiny_flow_in_containers_survives_a_killed_container_and_matches_the_local_runner(
    tmp_path, tiny_llama, request
):
    client = docker_client()
    built_images(*DEFAULT_IMAGES)
    runs = request.getfixturevalue("runs")  # after the checks that skip without Docker
    dataset = chat_rows(tmp_path / "chat.jsonl", rows=10)  # the rows of the local runs' dataset
    assert dataset.read_bytes() == runs.story.original_rows

    def spec(runner: str):
        return pipeline_spec(
            model=tiny_llama, dataset=dataset, output=tmp_path / runner, runner=runner
        )

    killed: list[str] = []
    done = threading.Event()
    killer = threading.Thread(target=kill_first_container, args=(client, "extract", killed),
                              kwargs={"under": tmp_path, "done": done})
    killer.start()
    try:
        in_docker = extract(spec("docker"), return_state=True)
    finally:  # a run that ended before any extract container ran fails below, not ten minutes later
        done.set()
        killer.join()

    assert in_docker.is_completed(), in_docker
    assert killed == [str(in_docker.state_details.flow_run_id)], "no extract container was killed"
    local = [(shard["path"], shard["sha256"]) for shard in runs.manifest["shards"]]
    assert shard_checksums(tmp_path / "docker") == local
    run_label = f"{LABEL_PREFIX}flow-run-id={in_docker.state_details.flow_run_id}"
    assert client.containers.list(all=True, filters={"label": run_label}) == []
