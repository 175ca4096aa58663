"""The marks hold (tests/support/marks.py): a test session of its own, whose tests start a vLLM
engine, a Docker client, a Prefect server or a declared S3 fixture with and without the mark (the
engine and the Prefect server in a slow test of their own: importing vLLM and Prefect's server takes
seconds).
Nothing really starts: the guard refuses before the thing runs, and the marked cases call the
guard alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CONFTEST = """
import pytest

from tests.support.marks import (  # noqa: F401
    S3, pytest_configure, pytest_runtest_makereport, pytest_runtest_protocol, pytest_runtest_setup,
    pytest_unconfigure, starts,
)


@pytest.fixture(scope="session")
@starts(S3, "a pretend S3 server")
def pretend_s3():
    return "s3"
"""

TESTS = '''
import subprocess
import sys

import pytest

from tests.support.marks import UnmarkedStart, check


def test_unmarked_engine_in_process():
    from vllm.entrypoints.llm import LLM

    LLM(model="no-such-model")


def test_unmarked_docker_client_in_a_child_whose_failure_the_test_expects():
    child = subprocess.run([sys.executable, "-c", "import docker; docker.APIClient(base_url='unix:///nothing.sock')"],
                           capture_output=True, text=True)
    assert child.returncode != 0
    assert "not marked `docker`" in child.stderr


def test_unmarked_docker_client_whose_error_the_test_swallows():
    import docker

    with pytest.raises(UnmarkedStart):
        docker.APIClient(base_url="unix:///no-such-docker.sock")


def test_unmarked_prefect_server():
    from prefect.server.api.server import SubprocessASGIServer

    SubprocessASGIServer(port=1).start()


@pytest.mark.s3
def test_marked_s3_fixture_first(pretend_s3):
    assert pretend_s3 == "s3"


def test_unmarked_s3_fixture_already_set_up(pretend_s3):
    assert pretend_s3 == "s3"


@pytest.mark.engine
@pytest.mark.docker
def test_marked_engine_and_docker():
    check("engine", "an engine")
    check("docker", "a Docker client")


def test_unmarked_start_of_nothing():
    assert 1 + 1 == 2
'''


def run_inner_session(tmp_path: Path, *select: str) -> tuple[dict[str, str], str]:
    """Run the tests above in a pytest session of their own; each test's outcome, and the output."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(TESTS))
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    engine: e\n    docker: d\n    s3: s\n    prefect_server: p\n"
    )
    env = {**{k: v for k, v in os.environ.items() if k != "DATAGEN_TEST_START_GUARD_MODE"},  # it refuses
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", "-rA", "-q",
         "--strict-markers", *select, "test_inner.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    out = run.stdout + run.stderr
    outcome = {}
    for line in out.splitlines():
        for word in ("PASSED", "FAILED", "ERROR"):
            if line.startswith(word + " test_inner.py::"):
                outcome[line.split("::")[1].split()[0]] = word
    return outcome, out


def test_a_start_without_its_mark_fails_the_test_in_its_process_in_a_child_and_through_a_fixture(tmp_path):
    outcome, out = run_inner_session(tmp_path, "-k", "not test_unmarked_engine_in_process and not test_unmarked_prefect_server")
    assert outcome == {
        "test_unmarked_docker_client_in_a_child_whose_failure_the_test_expects": "FAILED",
        "test_unmarked_docker_client_whose_error_the_test_swallows": "FAILED",
        "test_marked_s3_fixture_first": "PASSED",
        "test_unmarked_s3_fixture_already_set_up": "ERROR",
        "test_marked_engine_and_docker": "PASSED",
        "test_unmarked_start_of_nothing": "PASSED",
    }, out[-6000:]
    # the child's refusal, reported by the test session though the test passed
    assert "test_unmarked_docker_client_in_a_child_whose_failure_the_test_expects started a client of the Docker engine (process" in out
    assert "uses the fixture `pretend_s3`, which starts a pretend S3 server, but is not marked `s3`" in out


@pytest.mark.slow  # imports vLLM and Prefect's server (about 15 s)
def test_a_vllm_engine_or_a_prefect_server_started_without_its_mark_fails_the_test(tmp_path):
    outcome, out = run_inner_session(tmp_path, "-k", "test_unmarked_engine_in_process or test_unmarked_prefect_server")
    assert outcome == {"test_unmarked_engine_in_process": "FAILED", "test_unmarked_prefect_server": "FAILED"}, out[-6000:]
    assert "test_unmarked_engine_in_process starts a vLLM engine (vllm.LLM) but is not marked `engine`" in out
    assert "test_unmarked_prefect_server starts a Prefect server" in out and "not marked `prefect_server`" in out
