"""The CUDA train image (datagen-train-cuda): its pins and tag (always), the built image (when it is
built), and a GPU pool's run picking it (always; no Docker needed).

Like the CUDA extract image it is over 10 GB, so `make test` does not build it: `make images-cuda`
builds both and runs this file with DATAGEN_CUDA_TRAIN_IMAGE=<the tag it built> (a missing image
then fails instead of skipping). Training on the GPU itself (what needs a GPU) is
bench/gpu/train.py on the GPU machine (docs/gpu.md).
"""

from __future__ import annotations

import importlib.metadata
import json
import os

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from images.lock_cuda import LOCK
from images.requirements import read_lock
from images.tags import RECIPES, ROOT, ImageName, plan_image
from tests.images.test_build import tree  # noqa: F401  (a fixture)
from tests.support.docker_engine import built_release_image, docker_client

TRAIN = ImageName.TRAIN_CUDA
OVERLAY = "images/train/pins-cuda.txt"
BUILT = "DATAGEN_CUDA_TRAIN_IMAGE"  # the tag `make images-cuda` built: checked, never skipped


def _pins(name: ImageName) -> dict[str, str]:
    return {p.name: p.version for p in plan_image(name).pins}


# -- the pins and the tag: no Docker, no network -------------------------------------------------


def test_the_cuda_train_image_is_the_cuda_extract_image_plus_speculators_on_the_same_base():
    train, extract = plan_image(TRAIN), plan_image(ImageName.EXTRACT_CUDA)
    pins = _pins(TRAIN)
    overlay = {p.name: p.version for p in read_lock(ROOT / OVERLAY).values()}

    assert train.build_args == extract.build_args  # the same base image, CUDA version and vLLM
    assert train.recipe.target == extract.recipe.target and train.recipe.python == extract.recipe.python
    assert pins == {**{p.name: p.version for p in read_lock(ROOT / LOCK).values()}, **overlay}
    assert pins["speculators"] == "0.9.0" and pins["torch"] == "2.11.0"
    assert pins["nvidia-cuda-runtime"].startswith("13.0.")
    assert train.tag.startswith("datagen-train-cuda:") and train.tag != extract.tag


def test_speculators_is_pinned_to_the_release_the_cpu_train_image_pins():
    cpu = (ROOT / "images/train/requirements.in").read_text()
    assert "speculators==" + _pins(TRAIN)["speculators"] in cpu
    assert _pins(TRAIN)["speculators"] == importlib.metadata.version("speculators")


def test_every_requirement_of_speculators_is_met_by_the_images_pins():
    pins = _pins(TRAIN)
    unmet = []
    for line in importlib.metadata.requires("speculators") or []:
        req = Requirement(line)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue  # an extra (dev, mooncake): not installed
        have = pins.get(canonicalize_name(req.name))
        if have is None or (req.specifier and have not in req.specifier):
            unmet.append(f"{req} (pinned: {have})")
    assert unmet == []


def test_an_overlay_pin_change_changes_only_the_train_tag(tree):  # noqa: F811
    from tests.images.test_build import tags

    before = tags(tree)
    path = tree / OVERLAY
    path.write_text(path.read_text().replace("hs-connectors==0.9.0", "hs-connectors==0.9.1"))
    after = tags(tree)

    assert [n for n in before if before[n] != after[n]] == [TRAIN]


def test_a_gpu_pools_run_trains_on_the_gpu_in_the_cuda_train_image(monkeypatch):
    from tasks.runner_choice import _step_images
    from tasks.train import pool_device, settings_for

    monkeypatch.delenv("DATAGEN_TRAIN_DEVICE", raising=False)
    assert pool_device("gpu") == "cuda" and pool_device("cpu") == "cpu" and pool_device(None) == "cpu"
    assert settings_for({"steps": 5}, device="cuda") == {"steps": 5, "device": "cuda", "loader_workers": 8,
                                                         "loss_implementation": "eager"}
    assert settings_for({"steps": 5}, device="cpu") == {"steps": 5, "device": "cpu"}
    assert settings_for({"device": "cpu"}, device="cuda") == {"device": "cpu"}  # what the caller gives wins
    plan = {n: plan_image(n).tag for n in (TRAIN, ImageName.TRAIN_CPU)}
    import images.tags as tags_module

    real = tags_module.resolve_image
    tags_module.resolve_image = plan_image  # the tags, without asking a Docker engine
    try:
        assert _step_images(gpu=True)["train"] == plan[TRAIN] == _step_images(gpu=True)["measure-draft"]
        assert _step_images(gpu=False)["train"] == plan[ImageName.TRAIN_CPU]
    finally:
        tags_module.resolve_image = real


def test_the_missing_image_names_the_command_that_builds_it():
    assert RECIPES[TRAIN].build_command == "make images-cuda"


# -- the built image, on this machine (no GPU) ----------------------------------------------------


@pytest.fixture(scope="module")
def train_image() -> str:
    return built_release_image(os.environ.get(BUILT) or plan_image(TRAIN).tag, named_by=BUILT)


def _run(tag: str, command: list[str], *, entrypoint: list[str] | None = None) -> str:
    return docker_client().containers.run(tag, command, entrypoint=entrypoint, remove=True).decode()


@pytest.mark.docker
def test_the_image_trains_with_the_pinned_speculators_on_cuda_torch(train_image):
    probe = ("import importlib.metadata as m, torch, speculators.train.trainer, datagen.training.draft; "
             "print(m.version('speculators'), torch.version.cuda, torch.__version__)")
    out = _run(train_image, ["-c", probe], entrypoint=["python"])

    assert out.strip().splitlines()[-1] == "0.9.0 13.0 2.11.0+cu130"
    assert "--device" in _run(train_image, ["train", "--help"])


@pytest.mark.docker
def test_the_image_holds_exactly_its_pins(train_image):
    out = _run(train_image, ["list", "--format=json"], entrypoint=["pip"])
    installed = {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(out)}
    pins = _pins(TRAIN)

    assert {n: installed.get(n) for n in pins} == pins
    assert set(installed) - set(pins) == {"datagen", "pip"}


def test_stored_states_far_from_the_targets_fail_the_run_naming_the_dataset_and_layers():
    from datagen.steps.measure_draft import MeasureResult
    from datagen.training.agreement import FeatureError
    from flows.train import DEFAULT_FEATURE_THRESHOLD
    from tasks.train import FeaturesMismatch, check_features

    # measured: a right bf16 dataset 0.16% (p99 0.26%), fp8 2.3% (p99 2.9%), off-by-one layers 21-59%
    right = MeasureResult.model_construct(feature_error=[FeatureError(layer=k, median=0.023, p99=0.029)
                                                         for k in (2, 15, 27, 30)])
    check_features(right, dataset="/data/right", threshold=DEFAULT_FEATURE_THRESHOLD)
    off = MeasureResult.model_construct(feature_error=[FeatureError(layer=2, median=0.21, p99=0.4),
                                                       FeatureError(layer=30, median=0.002, p99=0.003)])
    with pytest.raises(FeaturesMismatch, match=r"/data/off.*layer 2 21\.0% away"):
        check_features(off, dataset="/data/off", threshold=DEFAULT_FEATURE_THRESHOLD)


def test_a_host_that_declares_its_device_trains_there_whatever_its_pool(monkeypatch):
    from tasks.train import pool_device

    monkeypatch.setenv("DATAGEN_TRAIN_DEVICE", "cpu")
    assert pool_device("gpu") == "cpu"
    monkeypatch.setenv("DATAGEN_TRAIN_DEVICE", "cuda")
    assert pool_device("cpu") == "cuda"
    monkeypatch.setenv("DATAGEN_TRAIN_DEVICE", "gpu0")
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        pool_device("gpu")
