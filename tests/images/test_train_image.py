"""The train image runs the training handoff: `datagen train` and `datagen measure-draft` on the tiny
model's dataset inside `datagen-train-cpu`, with the speculators release it pins.

The image is built by the same code as `make images` when its tag is missing (cold, with the
dependency layer: about 13 minutes on 2 shared cores; after a `datagen/` edit only the project layer,
well under a minute), and is not in `make images`' default list.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from images.tags import ImageName
from tests.support.docker_engine import BUILD_TIMEOUT_S, built_images, docker_client
from tests.support.extracted import extracted_dataset

ROOT = Path(__file__).resolve().parents[2]


def _run(client, image: str, args: list[str], mounts: list[Path]) -> str:
    """``datagen ARGS`` in a container of ``image`` as the host user; its output (fails on a non-zero exit)."""
    import docker

    container = client.containers.run(
        image, args, user=f"{os.getuid()}:{os.getgid()}", environment={"HOME": "/tmp"}, detach=True,
        mounts=[docker.types.Mount(target=str(p), source=str(p), type="bind") for p in mounts])
    try:
        code = container.wait(timeout=900)["StatusCode"]
        logs = container.logs().decode(errors="replace")
    finally:
        container.remove(force=True)
    assert code == 0, logs[-4000:]
    return logs


@pytest.mark.docker
@pytest.mark.timeout(BUILD_TIMEOUT_S)
def test_the_train_image_trains_and_measures_a_draft_with_its_pinned_speculators(tmp_path_factory):
    client = docker_client()
    image = built_images(ImageName.TRAIN_CPU)[ImageName.TRAIN_CPU]
    dataset = extracted_dataset(tmp_path_factory)
    model = dataset.parent / "model"
    out = tmp_path_factory.mktemp("train-image")
    draft = out / "draft"
    mounts = [dataset.parent, out]

    _run(client, image, ["train", str(dataset), "--out", str(draft), "--model", str(model), "--steps", "2",
                         "--total-seq-len", "256", "--ttt-steps", "2"], mounts)
    pinned = re.search(r"^speculators==(\S+)", (ROOT / "images/train/requirements.in").read_text(), re.M).group(1)
    lineage = json.loads((draft / "datagen_draft.json").read_text())
    assert lineage["speculators_version"] == pinned and lineage["steps_done"] == 2
    assert json.loads((draft / "config.json").read_text())["speculators_model_type"] == "eagle3"

    logs = _run(client, image, ["measure-draft", str(draft), str(dataset), "--out", str(out / "measured.json")], mounts)
    measured = json.loads((out / "measured.json").read_text())
    assert measured["features"] == "target" and len(measured["positions"]) == 2, logs[-2000:]
    assert all(e["median"] < 0.01 for e in measured["feature_error"]), measured["feature_error"]
