"""The real Docker engine and the step images, for tests marked ``docker``.

``docker_client()`` starts the engine with scripts/docker-up.sh when none answers (as
`make test` does) and skips only when it cannot start. ``built_images()`` builds what is
missing with the same code as `make images` (cold: a few minutes; warm: about a second).
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.marks import DOCKER, check

ROOT = Path(__file__).resolve().parents[2]
# pytest-timeout for a test that may build the images: a cold build (empty engine, empty .cache/)
# takes about 14 minutes on 2 cores, past the suite's default of 900 s.
BUILD_TIMEOUT_S = 2700
TEST_LABEL = "test-id"  # invocation label the tests put on their containers


@functools.cache
def _engine() -> tuple[object | None, str]:
    import docker

    try:
        client = docker.from_env()
        client.ping()
        return client, ""
    except docker.errors.DockerException:
        pass
    up = subprocess.run(
        [str(ROOT / "scripts/docker-up.sh")], capture_output=True, text=True, timeout=600
    )
    try:
        client = docker.from_env()
        client.ping()
        return client, ""
    except docker.errors.DockerException as e:
        said = up.stderr[-500:]
        return None, f"no Docker engine could start ({e}); scripts/docker-up.sh said: {said}"


def docker_client():
    """A client of a running engine; skips the test when no engine can start here."""
    check(DOCKER, "a client of the Docker engine")
    client, reason = _engine()
    if client is None:
        pytest.skip(reason)
    return client


@contextlib.contextmanager
def images_lock(*names):
    """Held by every test while it builds step images ``names`` (``built_images``, `make images`
    run as a program, kimi-mini's project copy), across the pytest processes of `make test`: two
    processes that need the same missing image build it once, one after the other (the second finds
    it built), not twice at once on the same cores. One lock per image, taken in the order given
    (``DEFAULT_IMAGES``' where several): a build of another image is not waited for."""
    from filelock import FileLock

    folder = ROOT / ".cache"
    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(FileLock(str(folder / f"images-build-{getattr(name, 'value', name)}.lock")))
        yield


@functools.cache
def built_images(*names) -> dict:
    """Image name -> tag of each of ``names`` (``images.tags.ImageName``), built if missing."""
    from images.build import build_images

    client = docker_client()
    tags = {}
    for name in names:  # one lock at a time: never one held while another is waited for
        with images_lock(name):
            (plan, _, _), = build_images([name], client=client)
        tags[plan.recipe.name] = plan.tag
    return tags


def containers_labelled(client, test_id: str) -> list:
    """Every container (running or not) the runner made for the test ``test_id``."""
    from tasks.docker_runner import LABEL_PREFIX

    return client.containers.list(
        all=True, filters={"label": f"{LABEL_PREFIX}{TEST_LABEL}={test_id}"}
    )


def built_release_image(tag: str, *, named_by: str) -> str:
    """``tag`` if the engine has it; fails when the variable ``named_by`` asked for it, else skips.

    The release images (over 10 GB, many minutes cold) are built by `make images-cuda`, not by
    `make test`: their checks run on the image just built, or on the current tree's if it exists.
    """
    import docker

    try:
        docker_client().images.get(tag)
    except docker.errors.ImageNotFound:
        if os.environ.get(named_by):
            pytest.fail(f"{named_by}={tag}: no such image")
        pytest.skip(f"{tag} is not built (over 10 GB and many minutes cold, so `make test` does not "
                    "build it): `make images-cuda` builds it and runs these checks")
    return tag
