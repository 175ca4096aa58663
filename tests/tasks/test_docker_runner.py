"""The docker runner against a real Docker engine and the real steps image."""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest

from datagen.errors import EXIT_BAD_INPUT, CannotRunHereError
from images.tags import ImageName
from tasks.docker_runner import (
    COMPILE_CACHE_PATH,
    LABEL_PREFIX,
    MANAGED_LABEL,
    DockerRunner,
    remove_leftover_containers,
)
from tasks.runners import Mount, StepInvocation
from tests.support.docker_engine import (
    BUILD_TIMEOUT_S,
    TEST_LABEL,
    built_images,
    containers_labelled,
    docker_client,
)

pytestmark = [pytest.mark.docker, pytest.mark.timeout(BUILD_TIMEOUT_S)]


@pytest.fixture(scope="module")
def client():
    return docker_client()


@pytest.fixture(scope="module")
def runner(client):
    tags = built_images(ImageName.STEPS)
    return DockerRunner({"*": tags[ImageName.STEPS]}, client=client)


@pytest.fixture
def test_id(client):
    """A label value unique to the test; afterwards no container may carry it."""
    value = uuid.uuid4().hex[:12]
    yield value
    assert containers_labelled(client, value) == [], "the runner left a container behind"


def make_tiny(out: Path, test_id: str, *extra: str, **overrides) -> StepInvocation:
    """A `datagen make-tiny` invocation writing under ``out`` (bind-mounted)."""
    fields = dict(
        step="make-tiny",
        args=("--out", str(out / "tiny"), "--arch", "llama", "--layers", "2", "--rows", "4")
        + extra,
        mounts=(Mount(str(out)),),
        labels={TEST_LABEL: test_id, "flow-run-id": "test-run"},
    )
    fields.update(overrides)
    return StepInvocation(**fields)


def test_step_runs_in_container_and_its_result_line_is_parsed(runner, tmp_path, test_id):
    lines: list[str] = []

    outcome = runner.run(make_tiny(tmp_path, test_id), lines.append)

    assert outcome.ok, outcome.last_lines
    assert outcome.result == {
        "model": str(tmp_path / "tiny" / "model"),
        "dataset": str(tmp_path / "tiny" / "chat.jsonl"),
    }
    assert any("make-tiny INFO" in line for line in lines), "step log lines were not streamed"
    written = tmp_path / "tiny" / "chat.jsonl"
    assert len(written.read_text().splitlines()) == 4
    # Files on the bind mount belong to the host user, not to root or the image's user.
    assert (written.stat().st_uid, written.stat().st_gid) == (os.getuid(), os.getgid())


def test_container_carries_flow_run_step_and_version_labels(runner, client, tmp_path, test_id):
    seen: dict = {}

    def log(line: str) -> None:
        if not seen:
            (container,) = containers_labelled(client, test_id)
            seen.update(container.labels)

    outcome = runner.run(make_tiny(tmp_path, test_id), log)

    assert outcome.ok
    assert seen[MANAGED_LABEL] == "true"
    assert seen[LABEL_PREFIX + "step"] == "make-tiny"
    assert seen[LABEL_PREFIX + "flow-run-id"] == "test-run"
    assert seen[LABEL_PREFIX + "version"]


def test_container_killed_mid_step_gives_a_retryable_outcome(runner, client, tmp_path, test_id):
    killed = threading.Event()

    def kill_when_running() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            running = [c for c in containers_labelled(client, test_id) if c.status == "running"]
            if running:
                running[0].kill()
                killed.set()
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_when_running)
    killer.start()
    outcome = runner.run(make_tiny(tmp_path, test_id), lambda line: None)
    killer.join()

    assert killed.is_set()
    assert outcome.exit_code == 137
    assert outcome.retryable
    assert outcome.result is None


def test_step_exiting_with_bad_input_is_not_retryable(runner, tmp_path, test_id):
    outcome = runner.run(make_tiny(tmp_path, test_id, "--layers", "many"), lambda line: None)

    assert outcome.exit_code == EXIT_BAD_INPUT
    assert not outcome.retryable
    assert any("--layers" in line for line in outcome.last_lines)


def test_container_is_removed_when_the_caller_is_interrupted(runner, tmp_path, test_id):
    def interrupt(line: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.run(make_tiny(tmp_path, test_id), interrupt)
    # The fixture checks that no container with this test's label is left.


def _container_env(client, test_id):
    """A step's ``log`` callback that records its container's environment at the first line, and that list."""
    env: list[str] = []

    def log(line: str) -> None:
        if not env:
            (container,) = containers_labelled(client, test_id)
            env.extend(container.attrs["Config"]["Env"])

    return env, log


def test_secret_env_vars_are_passed_by_name_and_never_logged(
    runner, client, tmp_path, test_id, monkeypatch, caplog
):
    monkeypatch.setenv("DATAGEN_TEST_SECRET", "s3cr3t-value")
    env_in_container, log = _container_env(client, test_id)

    invocation = make_tiny(
        tmp_path,
        test_id,
        "--layers",
        "oops",  # exits at once with a usage error: only the environment matters here
        env={"PLAIN": "1"},
        secret_env_names=("DATAGEN_TEST_SECRET", "DATAGEN_TEST_UNSET"),
    )
    with caplog.at_level("DEBUG"):
        runner.run(invocation, log)

    assert "DATAGEN_TEST_SECRET=s3cr3t-value" in env_in_container
    assert "PLAIN=1" in env_in_container
    assert not any(e.startswith("DATAGEN_TEST_UNSET=") for e in env_in_container)
    assert "s3cr3t-value" not in caplog.text
    assert "DATAGEN_TEST_UNSET" in caplog.text  # named, so the user knows it is missing


def test_the_workers_engine_settings_reach_the_step_container_and_the_steps_own_env_wins(
    runner, client, tmp_path, test_id, monkeypatch
):
    # a local step inherits the worker's DATAGEN_ENFORCE_EAGER and the like with its environment; a
    # container gets only what it is given, so the runner passes them on (tasks.settings.ENGINE_SETTINGS_ENV)
    monkeypatch.setenv("DATAGEN_ENFORCE_EAGER", "1")
    monkeypatch.setenv("DATAGEN_CPU_KVCACHE_GIB", "3")
    monkeypatch.setenv("DATAGEN_NOT_AN_ENGINE_SETTING", "x")
    env_in_container, log = _container_env(client, test_id)

    invocation = make_tiny(tmp_path, test_id, "--layers", "oops", env={"DATAGEN_CPU_KVCACHE_GIB": "1"})
    runner.run(invocation, log)

    assert "DATAGEN_ENFORCE_EAGER=1" in env_in_container
    assert "DATAGEN_CPU_KVCACHE_GIB=1" in env_in_container  # the step's own setting, not the worker's 3
    assert not any(e.startswith("DATAGEN_NOT_AN_ENGINE_SETTING=") for e in env_in_container)


def test_the_compile_cache_is_a_host_folder_the_step_writes_to_as_the_host_user(
    runner, client, tmp_path, test_id, monkeypatch
):
    # each container is fresh: the kernels its engine compiles are kept in one host folder, mounted
    # into every step container, where the next container's engine finds them
    cache = tmp_path / "compile-cache"  # not there yet: the runner makes it
    monkeypatch.setenv("DATAGEN_COMPILE_CACHE", str(cache))
    env_in_container, log = _container_env(client, test_id)
    # the step writes into the cache's folder in the container, as an engine's compiler would
    inside = f"{COMPILE_CACHE_PATH}/torchinductor/written-by-the-step"
    invocation = make_tiny(tmp_path, test_id, "--out", inside)

    outcome = runner.run(invocation, log)

    assert outcome.ok, outcome.last_lines
    assert f"TORCHINDUCTOR_CACHE_DIR={COMPILE_CACHE_PATH}/torchinductor" in env_in_container
    assert f"VLLM_CACHE_ROOT={COMPILE_CACHE_PATH}/vllm" in env_in_container
    assert f"TRITON_CACHE_DIR={COMPILE_CACHE_PATH}/triton" in env_in_container
    written = cache / "torchinductor" / "written-by-the-step" / "chat.jsonl"
    assert len(written.read_text().splitlines()) == 4, "the step's write did not reach the host folder"
    assert (written.stat().st_uid, written.stat().st_gid) == (os.getuid(), os.getgid())


def test_the_report_step_draws_its_plot_in_the_steps_image(runner, tmp_path, test_id):
    # the flow's layer report runs in the steps image ("*"): it draws with matplotlib, which the
    # image must install (images/steps/requirements.in); the flow only logs a report it cannot draw
    from tests.support.synthetic_shards import make_synthetic_dataset

    nights = [make_synthetic_dataset(tmp_path / f"night{i}", rows=16, seed=0) for i in range(2)]
    out = tmp_path / "plots" / "report.png"
    invocation = StepInvocation(
        step="report", args=(str(nights[1]), "--previous", str(nights[0]), "--out", str(out)),
        mounts=(Mount(str(tmp_path)),), labels={TEST_LABEL: test_id},
    )

    outcome = runner.run(invocation, lambda line: None)

    assert outcome.ok, outcome.last_lines
    assert outcome.result["runs"] == 2 and outcome.result["drifted_layers"] == []
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_missing_image_raises_with_the_build_command(client, tmp_path, test_id):
    runner = DockerRunner({"*": "datagen-steps:0.0.0-notbuilt"}, client=client)

    with pytest.raises(CannotRunHereError, match="not built") as info:
        runner.run(make_tiny(tmp_path, test_id), lambda line: None)
    assert "make images" in str(info.value)


def test_gpu_step_on_an_engine_without_gpu_support_cannot_run_here(
    runner, client, tmp_path, test_id
):
    if "nvidia" in client.info().get("Runtimes", {}) or shutil.which("nvidia-smi"):
        pytest.skip("this host has GPUs and its engine may give them to containers")

    with pytest.raises(CannotRunHereError, match="GPU") as info:
        runner.run(make_tiny(tmp_path, test_id, gpus=1), lambda line: None)
    assert "NVIDIA Container Toolkit" in str(info.value)


def test_leftover_containers_are_removed_by_label(runner, client, test_id):
    image = runner.images["*"]
    labels = {MANAGED_LABEL: "true", f"{LABEL_PREFIX}{TEST_LABEL}": test_id}
    client.containers.create(image, command=["--help"], labels=labels)
    assert len(containers_labelled(client, test_id)) == 1

    removed = remove_leftover_containers({TEST_LABEL: test_id}, client=client)

    assert len(removed) == 1
