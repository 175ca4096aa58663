"""Builds the step images that are missing and prints their tags (`make images`).

    python images/build.py                      # datagen-steps and datagen-extract-cpu
    python images/build.py datagen-extract-cuda # the GPU image, from wheels (`make images-cuda`)
    python images/build.py datagen-extract-cuda-official --base-image vllm/vllm-openai@sha256:...

An image whose tag (``images/tags.py``: project version + hash of its inputs) already exists
is not built again, so a second run with nothing changed builds nothing and prints the same
tags. Everything is built offline: the Python packages come from a wheelhouse made on the
host (``pip download`` of the lock's pins, kept in ``.cache/wheelhouse/``), and the CPU
images' base is made with debootstrap (``images/base.py``) unless ``--base-image`` names
another. The tags and image ids are also written to ``.cache/images.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script (`make images`): make `images` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from packaging.utils import parse_wheel_filename
from packaging.version import Version

from datagen.errors import CannotRunHereError, DatagenError
from images.base import OFFLINE_BASES, ensure_base_image
from images.lock_cuda import pip_env
from images.requirements import Pin
from images.paths import CACHE, ROOT, WHEELHOUSE
from images.tags import DEFAULT_IMAGES, DOCKERFILE, ImageName, ImagePlan, plan_image

logger = logging.getLogger("images.build")

CONTEXTS = CACHE / "images" / "context"
TAGS_JSON = CACHE / "images.json"
BUILD_TIMEOUT_S = 3600  # a cold build of the extract image installs ~3 GB of wheels
STAGING_ATTEMPTS = 3  # plans again when the tree changes while the context is laid out


def build_images(
    names: list[ImageName],
    *,
    client,
    base_image: str | None = None,
    wheelhouse: Path = WHEELHOUSE,
    debian_mirror: str | None = None,
) -> list[tuple[ImagePlan, str, bool]]:
    """Builds each image unless its tag exists.

    Args:
        names: the images.
        client: a ``docker.DockerClient``.
        base_image: the base image for all of them; None for each recipe's default.
        wheelhouse: where the wheels are kept between runs.
        debian_mirror: the mirror debootstrap uses for the offline base (None: its default).

    Returns:
        (plan, image id, built now) for each image, in order.

    Raises:
        DatagenError: a build failed; the message holds the end of the build log.
    """
    done = []
    for name in names:
        for _ in range(STAGING_ATTEMPTS):
            plan = plan_image(name, base_image=base_image)
            image = _existing(client, plan.tag)
            built = image is None
            if not built:
                break
            started = time.monotonic()
            offline_base = OFFLINE_BASES.get(plan.build_args["BASE_IMAGE"])
            if offline_base is not None:
                ensure_base_image(client, offline_base, mirror=debian_mirror)
            wheels = _ensure_wheels(plan, wheelhouse / _abi(plan))
            context = _stage_context(plan, wheels)
            try:
                # The context holds the files as they were when copied: if the tree changed
                # since the tag was computed, that tag would name other contents. Plan again.
                if plan_image(name, base_image=base_image).tag != plan.tag:
                    logger.info("%s: the tree changed while staging; planning again", plan.tag)
                    continue
                _build(client, plan, context)
            finally:
                shutil.rmtree(context, ignore_errors=True)
            image = client.images.get(plan.tag)
            logger.info("%s: built in %.0f s", plan.tag, time.monotonic() - started)
            break
        else:
            raise DatagenError(
                f"{name.value}: the project's files changed during each of "
                f"{STAGING_ATTEMPTS} attempts to stage the build",
                hint="build again when the tree is quiet",
            )
        done.append((plan, image.id, built))
    return done


def _existing(client, tag: str):
    import docker

    try:
        return client.images.get(tag)
    except docker.errors.ImageNotFound:
        return None


def _abi(plan: ImagePlan) -> str:
    return "cp" + plan.recipe.python.replace(".", "")


def _ensure_wheels(plan: ImagePlan, folder: Path) -> list[Path]:
    """The wheel of every pin of the plan, downloading what is missing."""
    folder.mkdir(parents=True, exist_ok=True)
    missing = [p for p in plan.pins if _key(p) not in _wheels_in(folder)]
    if missing:
        logger.info("wheelhouse %s: downloading %d wheels", folder.name, len(missing))
        # A whole-lock image's pins came from the index alone (images/lock_cuda.py): fetch them
        # from there too, not from a local wheel folder that may hold another build of a pin
        # (`torch==2.11.0` also matches a `2.11.0+cpu` wheel).
        env = pip_env() if plan.recipe.whole_lock else None
        _download(missing, folder, python=plan.recipe.python, env=env)
    have = _wheels_in(folder)
    for pin in plan.pins:
        if _key(pin) not in have:
            raise CannotRunHereError(
                f"no wheel of {pin.line} for Python {plan.recipe.python} in {folder}",
                hint="the package index has no binary wheel for it; pin another version",
            )
    return [have[_key(pin)] for pin in plan.pins]


def _key(pin: Pin) -> tuple[str, Version]:
    return pin.name, Version(pin.version)


def _wheels_in(folder: Path) -> dict[tuple[str, Version], Path]:
    wheels = {}
    for path in folder.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(path.name)
        wheels[name, version] = path
    return wheels


def _download(pins: list[Pin], folder: Path, *, python: str, env: dict | None = None) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as reqs:
        reqs.write("".join(p.line + "\n" for p in pins))
        reqs.flush()
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
        cmd += ["--only-binary=:all:", "-d", str(folder), "-r", reqs.name]
        if python != f"{sys.version_info.major}.{sys.version_info.minor}":
            abi = "cp" + python.replace(".", "")
            cmd += ["--python-version", python, "--implementation", "cp"]
            cmd += ["--abi", abi, "--abi", "abi3", "--abi", "none"]
            for platform in ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "linux_x86_64"):
                cmd += ["--platform", platform]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.splitlines()[-10:])
        raise CannotRunHereError(
            f"pip download of {len(pins)} wheels failed:\n{tail}",
            hint="check that the package index is reachable from this host",
        )


def _stage_context(plan: ImagePlan, wheels: list[Path]) -> Path:
    """The build context: Dockerfile, requirements.txt, wheels/, project/ (the project's wheel)."""
    CONTEXTS.mkdir(parents=True, exist_ok=True)
    # A folder of its own per build: two builds at once (two test runs) do not share one.
    context = Path(tempfile.mkdtemp(prefix=plan.recipe.name.value + "-", dir=CONTEXTS))
    (context / "wheels").mkdir()
    shutil.copyfile(ROOT / DOCKERFILE, context / "Dockerfile")
    (context / "requirements.txt").write_text(plan.requirements_txt)
    for wheel in wheels:
        _link_or_copy(wheel, context / "wheels" / wheel.name)
    _build_project_wheel(plan, context / "project")
    return context


def _build_project_wheel(plan: ImagePlan, target: Path) -> None:
    """The project's wheel, built here from exactly the files the tag covers.

    Built on the host (with the environment's setuptools) so the image needs no build backend.
    """
    with tempfile.TemporaryDirectory(prefix="datagen-src-") as tmp:
        for rel in plan.project_files:
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / rel, Path(tmp) / rel)
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        done = subprocess.run(cmd + ["-w", str(target), tmp], capture_output=True, text=True)
    if done.returncode != 0:
        raise DatagenError(
            f"building the project's wheel failed:\n{done.stderr[-2000:]}",
            hint="run `make setup`, then `make images` again",
        )


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)  # the wheelhouse is on the same file system: no copy
    except OSError:
        shutil.copyfile(source, target)


def _build(client, plan: ImagePlan, context: Path) -> None:
    import docker

    logger.info("%s: building", plan.tag)
    args = {**plan.build_args, **_label_args(plan)}
    tail: list[str] = []
    try:
        for chunk in client.api.build(
            path=str(context),
            tag=plan.tag,
            target=plan.recipe.target,
            buildargs=args,
            rm=True,
            forcerm=True,
            decode=True,
            timeout=BUILD_TIMEOUT_S,
        ):
            if "error" in chunk:
                raise DatagenError(
                    f"building {plan.tag} failed: {chunk['error'].strip()}\n" + "\n".join(tail),
                    hint=f"fix {DOCKERFILE} (stage {plan.recipe.target}) or its inputs and run `make images`",
                )
            for line in chunk.get("stream", "").splitlines():
                if line.strip():
                    logger.debug("%s", line)
                    tail = (tail + [line])[-20:]
    except docker.errors.APIError as e:
        raise DatagenError(
            f"building {plan.tag} failed: {e.explanation or e}",
            hint="check that the Docker engine runs (scripts/docker-up.sh)",
        ) from e


def _label_args(plan: ImagePlan) -> dict[str, str]:
    """OCI label values. Not part of the tag: the revision changes with every commit."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    source = git("remote", "get-url", "origin")
    return {
        "VERSION": plan.version,
        "REVISION": git("rev-parse", "HEAD") or "unknown",
        "SOURCE": source if "://" in source or "@" in source else "unknown",
    }


def prune_other_tags(client, plans: list[ImagePlan]) -> list[str]:
    """Removes the tags of the planned images' repositories other than the planned ones.

    Layers the current images share are kept; the stages' build cache is kept too (a source
    change rebuilds only the project layer).
    """
    keep = {plan.tag for plan in plans}
    removed = []
    for repository in sorted({plan.recipe.name.value for plan in plans}):
        for image in client.images.list(name=repository):
            for tag in image.tags:
                if tag.startswith(repository + ":") and tag not in keep:
                    client.images.remove(tag)
                    removed.append(tag)
                    logger.info("removed old tag %s", tag)
    return removed


def write_tags_json(results: list[tuple[ImagePlan, str, bool]], path: Path = TAGS_JSON) -> None:
    """Writes {repository: {"tag": ..., "id": ...}} (atomically)."""
    record = {
        plan.recipe.name.value: {"tag": plan.tag, "id": image_id} for plan, image_id, _ in results
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="images/build.py", description=__doc__.split("\n")[0])
    parser.add_argument(
        "images",
        nargs="*",
        type=ImageName,
        metavar="IMAGE",
        help=f"images to build (default: {' '.join(n.value for n in DEFAULT_IMAGES)}); "
        f"one of {', '.join(n.value for n in ImageName)}",
    )
    parser.add_argument("--base-image", help="base image reference (production: pin a digest)")
    parser.add_argument("--wheelhouse", type=Path, default=WHEELHOUSE, help="wheel cache folder")
    parser.add_argument("--debian-mirror", help="Debian mirror for the offline base image")
    parser.add_argument(
        "--prune", action="store_true", help="remove the other tags of these images' repositories"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show the build log")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s images %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    import docker

    try:
        # Removing or committing a multi-GB layer can take minutes on a busy disk.
        client = docker.from_env(timeout=BUILD_TIMEOUT_S)
        client.ping()
    except docker.errors.DockerException as e:
        print(f"error: no Docker engine answers ({e})", file=sys.stderr)
        print("  -> run scripts/docker-up.sh", file=sys.stderr)
        return CannotRunHereError.exit_code
    try:
        results = build_images(
            args.images or list(DEFAULT_IMAGES),
            client=client,
            base_image=args.base_image,
            wheelhouse=args.wheelhouse,
            debian_mirror=args.debian_mirror,
        )
    except DatagenError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    write_tags_json(results)
    if args.prune:
        prune_other_tags(client, [plan for plan, _, _ in results])
    for plan, _, built in results:
        logger.info("%s: %s", plan.tag, "built" if built else "exists, not rebuilt")
        print(plan.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
