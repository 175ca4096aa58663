"""The offline base image: Debian bookworm with Python 3.11, made without a registry.

No image registry is reachable on the test machines, so the CPU images are built on a base
made here: ``debootstrap --variant=minbase`` fills a root file system from the Debian
mirror, and ``docker import`` turns it into an image. Its tag is a hash of this recipe, so
it is built once per machine and reused. Production passes a real upstream base instead
(``--base-image``; see docs/images.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from datagen.errors import CannotRunHereError

logger = logging.getLogger(__name__)

SUITE = "bookworm"  # Python 3.11, the lock's Python
PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates")
CHANGES = (  # Dockerfile instructions applied on import (an imported image has no config)
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    'CMD ["/bin/bash"]',
)
# Files debootstrap leaves that the image does not need (package downloads, indexes, docs).
PRUNE = ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man")
_RECIPE = "\n".join((SUITE, "minbase", *PACKAGES, *CHANGES, *PRUNE))
BASE_REPOSITORY = "datagen-base"
BASE_IMAGE = f"{BASE_REPOSITORY}:{SUITE}-{hashlib.sha256(_RECIPE.encode()).hexdigest()[:12]}"


def ensure_base_image(client, *, mirror: str | None = None) -> str:
    """Builds the offline base image unless it exists; returns its tag.

    Args:
        client: a ``docker.DockerClient``.
        mirror: the Debian mirror for debootstrap; None for debootstrap's default.

    Raises:
        CannotRunHereError: debootstrap is missing or failed (the hint says what to do).
    """
    import docker

    try:
        client.images.get(BASE_IMAGE)
        return BASE_IMAGE
    except docker.errors.ImageNotFound:
        pass
    if shutil.which("debootstrap") is None:
        raise CannotRunHereError(
            "debootstrap is not installed", hint="run scripts/docker-up.sh (it installs it)"
        )
    logger.info("base image %s: debootstrap %s (takes a few minutes)", BASE_IMAGE, SUITE)
    with tempfile.TemporaryDirectory(prefix="datagen-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        _debootstrap(rootfs, mirror)
        for rel in PRUNE:
            shutil.rmtree(rootfs / rel, ignore_errors=True)
            (rootfs / rel).mkdir(parents=True, exist_ok=True)
        archive = Path(tmp) / "rootfs.tar"
        subprocess.run(
            ["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(archive), "."], check=True
        )
        repository, tag = BASE_IMAGE.split(":")
        client.api.import_image_from_file(
            str(archive), repository=repository, tag=tag, changes=list(CHANGES)
        )
    logger.info("base image %s: imported", BASE_IMAGE)
    return BASE_IMAGE


def _debootstrap(rootfs: Path, mirror: str | None) -> None:
    cmd = [
        "debootstrap",
        "--variant=minbase",
        f"--include={','.join(PACKAGES)}",
        SUITE,
        str(rootfs),
    ]
    if mirror:
        cmd.append(mirror)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise CannotRunHereError(
            f"debootstrap {SUITE} failed (exit {done.returncode}):\n{tail}",
            hint="check that the Debian mirror is reachable, or pass --debian-mirror",
        )
