"""The `download` step: S3 mirrors against a real S3 server (SeaweedFS), Hub repos against a
pre-populated huggingface_hub cache (offline), local directories in place.

Gap: the Hub's network path (repo_info, the transfers themselves) is huggingface_hub's and is not
exercised here (no network); the resolution through refs/, the snapshot, the verification and
the cache are.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import datagen.storage.s3 as s3mod
from datagen.errors import EXIT_BAD_INPUT, EXIT_TRANSIENT, ModelError, ModelNotFoundError, SpecError, StorageError
from datagen.testmodels.tiny import TinyArch, make_model
from datagen.storage import download
from datagen.specs.source import parse_sources_spec
from tests.support.hub_cache import populate_hub_cache, snapshot_file
from tests.support.s3server import s3_env, s3_server, upload_tree  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024


def spec_for(model: str, **overrides):
    return parse_sources_spec({"model": model, "out": "unused-out", **overrides})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A 4-layer random Llama, hidden 512: a 21 MB weight file (21 ranges of 1 MiB), plus files
    the engine does not need."""
    d = make_model(tmp_path_factory.mktemp("mirror") / "model", arch=TinyArch.LLAMA, num_layers=4, hidden=512)
    (d / "README.md").write_text("# a model card the engine does not need\n")
    (d / "modeling_custom.py").write_text("# custom code: only with trust_remote_code\n")
    return d


@pytest.fixture(scope="module")
def big_model_dir(tmp_path_factory, model_dir) -> Path:
    """model_dir plus a 96 MiB weight file: a download that lasts long enough to be killed."""
    import shutil

    import numpy as np
    from safetensors.numpy import save_file

    d = shutil.copytree(model_dir, tmp_path_factory.mktemp("big") / "model")
    save_file({"extra": np.random.default_rng(0).integers(0, 255, 96 * MiB, dtype=np.uint8)}, str(d / "zz-extra.safetensors"))
    return d


def ranges_done(cache: Path, name: str) -> int:
    """Ranges of file ``name`` fetched so far (its .ranges file: a header, then one line a range)."""
    n = 0
    for log in cache.rglob(f"{name}.ranges"):
        try:
            n += max(0, len(log.read_text().splitlines()) - 1)
        except FileNotFoundError:
            pass
    return n


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    """A fresh model cache, 1 MiB ranges, 4 in flight, few retries (faults fail fast)."""
    monkeypatch.setenv("DATAGEN_MODEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DATAGEN_S3_CHUNK_MB", "1")
    monkeypatch.setenv("DATAGEN_S3_MAX_CONCURRENCY", "4")
    monkeypatch.setenv("DATAGEN_S3_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("DATAGEN_S3_CONNECT_TIMEOUT", "2")
    return tmp_path / "cache"


def mirror(s3_env, model_dir: Path, **upload) -> str:
    bucket = s3_env.create_bucket()
    upload_tree(s3_env.client(), bucket, "models/tiny", model_dir, **upload)
    return f"s3://{bucket}/models/tiny"


def engine_files(model_dir: Path, *, trusted: bool = False) -> list[str]:
    skip = {"README.md"} | (set() if trusted else {"modeling_custom.py"})
    return sorted(p.name for p in model_dir.iterdir() if p.is_file() and p.name not in skip)


def content_fingerprint(model_dir: Path, tmp_path: Path) -> str:
    """The fingerprint of the engine's files of ``model_dir``, computed from a local copy."""
    import shutil

    d = shutil.copytree(model_dir, tmp_path / "local-copy")
    return download.download(spec_for(str(d))).fingerprint


# -- S3 mirrors ------------------------------------------------------------------------------


@pytest.mark.s3
def test_s3_mirror_is_downloaded_verified_into_the_cache(s3_env, cache_env, model_dir, tmp_path):
    uri = mirror(s3_env, model_dir, with_checksums=True)
    result = download.download(spec_for(uri))
    assert result.kind.value == "s3" and not result.cached
    assert result.files == engine_files(model_dir)
    assert result.bytes == result.fetched_bytes == sum((model_dir / f).stat().st_size for f in result.files)
    out = Path(result.model_dir)
    assert out.is_relative_to(cache_env / "s3")
    for f in result.files:
        assert (out / f).read_bytes() == (model_dir / f).read_bytes(), f
    assert not (out / "README.md").exists() and not (out / "modeling_custom.py").exists()
    assert not list(cache_env.rglob("*.partial")), "resume state is removed once complete"
    # the fingerprint is the model's content: the same as a local directory of the same files
    assert result.fingerprint == content_fingerprint(model_dir, tmp_path)


@pytest.mark.s3
def test_second_download_of_the_same_mirror_fetches_nothing(s3_env, cache_env, model_dir, monkeypatch):
    uri = mirror(s3_env, model_dir)
    first = download.download(spec_for(uri))

    def no_reads(*a, **k):
        raise AssertionError("a cached model was read from S3 again")

    monkeypatch.setattr(s3mod, "read_range_into", no_reads)
    second = download.download(spec_for(uri))
    assert second.cached and second.fetched_bytes == 0
    assert (second.model_dir, second.model_revision, second.fingerprint) == (
        first.model_dir, first.model_revision, first.fingerprint,
    )


@pytest.mark.s3
def test_a_changed_mirror_is_a_new_revision(s3_env, cache_env, model_dir):
    uri = mirror(s3_env, model_dir)
    first = download.download(spec_for(uri))
    bucket = uri.split("/")[2]
    config = json.loads((model_dir / "config.json").read_text()) | {"note": "changed"}
    s3_env.client().put_object(Bucket=bucket, Key="models/tiny/config.json", Body=json.dumps(config).encode())
    second = download.download(spec_for(uri))
    assert not second.cached and second.model_revision != first.model_revision
    assert second.model_dir != first.model_dir and second.fingerprint != first.fingerprint


@pytest.mark.s3
def test_interrupted_download_resumes_where_it_stopped(s3_env, cache_env, model_dir, monkeypatch):
    uri = mirror(s3_env, model_dir)
    real = s3mod.read_range_into
    fetched = []

    def network_drops_after_five_ranges(client, bucket, key, fd, *, start, end, etag):
        if len(fetched) >= 5:
            raise StorageError("connection reset (injected)", hint="retry")
        real(client, bucket, key, fd, start=start, end=end, etag=etag)
        fetched.append(end - start)

    monkeypatch.setattr(s3mod, "read_range_into", network_drops_after_five_ranges)
    with pytest.raises(StorageError) as e:
        download.download(spec_for(uri))
    assert e.value.exit_code == EXIT_TRANSIENT
    assert list(cache_env.rglob("*.ranges")), "the finished ranges are recorded"

    monkeypatch.setattr(s3mod, "read_range_into", real)
    result = download.download(spec_for(uri))
    assert result.fetched_bytes == result.bytes - sum(fetched), "only the missing ranges are fetched again"
    for f in result.files:
        assert (Path(result.model_dir) / f).read_bytes() == (model_dir / f).read_bytes()


def _run_download(spec_path: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "datagen", "download", "--spec", str(spec_path)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _result(proc: subprocess.Popen) -> tuple[int, dict | None, str]:
    out, err = proc.communicate(timeout=120)
    lines = [ln for ln in out.splitlines() if ln.startswith("datagen-result: ")]
    return proc.returncode, json.loads(lines[-1].split(": ", 1)[1]) if lines else None, err


@pytest.mark.s3
def test_killed_download_process_resumes(s3_env, cache_env, big_model_dir, tmp_path):
    model_dir = big_model_dir
    uri = mirror(s3_env, model_dir)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": uri, "out": str(tmp_path / "out")}))
    env = os.environ | {"DATAGEN_S3_MAX_CONCURRENCY": "1"}
    proc = _run_download(spec, env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None and ranges_done(cache_env, "zz-extra.safetensors") < 3:
        time.sleep(0.005)
    assert proc.poll() is None, "the download finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    rc, result, err = _result(_run_download(spec, env))
    assert rc == 0, err
    assert 0 < result["fetched_bytes"] <= result["bytes"] - 3 * MiB
    for f in result["files"]:
        assert (Path(result["model_dir"]) / f).read_bytes() == (model_dir / f).read_bytes()


@pytest.mark.s3
def test_concurrent_downloads_of_one_model_fetch_it_once(s3_env, cache_env, model_dir, tmp_path):
    uri = mirror(s3_env, model_dir)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": uri, "out": str(tmp_path / "out")}))
    procs = [_run_download(spec, dict(os.environ)) for _ in range(2)]
    results = [_result(p) for p in procs]
    assert all(rc == 0 for rc, _, _ in results), [err for _, _, err in results]
    a, b = (r for _, r, _ in results)
    assert a["model_dir"] == b["model_dir"] and a["fingerprint"] == b["fingerprint"]
    assert a["fetched_bytes"] + b["fetched_bytes"] == a["bytes"], "the lock made one of them wait and reuse"


@pytest.mark.s3
def test_corrupted_object_in_the_mirror_is_detected_named_and_deleted(s3_env, cache_env, model_dir):
    uri = mirror(s3_env, model_dir, with_checksums=True)
    bucket = uri.split("/")[2]
    data = bytearray((model_dir / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped: only a checksum can tell
    s3_env.client().put_object(Bucket=bucket, Key="models/tiny/model.safetensors", Body=bytes(data))

    with pytest.raises(ModelError, match=r"model\.safetensors is corrupt: checksums\.sha256") as e:
        download.download(spec_for(uri))
    assert e.value.exit_code == EXIT_BAD_INPUT
    assert not list(cache_env.rglob("model.safetensors")), "the bad file is deleted"
    assert not list(cache_env.rglob("model.safetensors.ranges"))


@pytest.mark.s3
@pytest.mark.parametrize(
    ("part_bytes", "origin"), [(None, "ETag (MD5)"), (5 * MiB, "multipart ETag (5242880-byte parts)")]
)
def test_bytes_damaged_in_transit_fail_the_etag_check(s3_env, cache_env, model_dir, monkeypatch, part_bytes, origin):
    uri = mirror(s3_env, model_dir, part_bytes=part_bytes)
    real = s3mod.read_range_into

    def flip_a_byte(client, bucket, key, fd, *, start, end, etag):
        real(client, bucket, key, fd, start=start, end=end, etag=etag)
        if key.endswith(".safetensors") and start == 0:
            os.pwrite(fd, b"\x00" * 3, 1000)

    monkeypatch.setattr(s3mod, "read_range_into", flip_a_byte)
    with pytest.raises(ModelError, match=r"model\.safetensors is corrupt: the object's " + re.escape(origin)):
        download.download(spec_for(uri))


@pytest.mark.s3
def test_objects_published_by_datagen_are_checked_against_their_sha256(s3_env, cache_env, model_dir):
    bucket = s3_env.create_bucket()
    client = s3mod.make_client()
    for p in model_dir.iterdir():
        from datagen.data.checksums import sha256_file

        s3mod.upload_file(client, p, bucket, f"m/{p.name}", sha256=sha256_file(p), transfer=s3mod.TransferSettings.from_settings())
    download.download(spec_for(f"s3://{bucket}/m"))
    record = json.loads(next((cache_env / "verified").glob("*.json")).read_text())
    assert {f["checksum"].split(":")[0] for f in record["files"]} == {"sha256"}


@pytest.mark.s3
def test_missing_bucket_and_missing_model_are_permanent_errors(s3_env, cache_env):
    with pytest.raises(SpecError, match="bucket does not exist"):
        download.download(spec_for("s3://no-such-bucket-here/models/x"))
    bucket = s3_env.create_bucket()
    with pytest.raises(ModelNotFoundError, match="holds no config.json"):
        download.download(spec_for(f"s3://{bucket}/empty"))


# -- Hub repos, from a pre-populated cache (HF_HUB_OFFLINE=1) --------------------------------------


@pytest.fixture
def hub_offline(cache_env, monkeypatch, model_dir):
    """The hub cache under the model cache holds acme/tiny at one commit (refs main and v1)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    sha = populate_hub_cache(cache_env / "hub", "acme/tiny", model_dir, refs=("main", "v1"))
    return sha


def test_hub_branch_resolves_to_its_commit_and_serves_the_snapshot(hub_offline, cache_env, model_dir, tmp_path):
    result = download.download(spec_for("hf://acme/tiny@main"))
    assert result.kind.value == "hf" and result.model_revision == hub_offline
    assert Path(result.model_dir) == snapshot_file(cache_env / "hub", "acme/tiny", hub_offline, "")
    assert result.files == engine_files(model_dir)
    assert result.fingerprint == content_fingerprint(model_dir, tmp_path)


def test_hub_tag_pinned_commit_and_default_branch_are_one_cache_entry(hub_offline):
    results = [download.download(spec_for(m)) for m in ("hf://acme/tiny", "hf://acme/tiny@v1", f"hf://acme/tiny@{hub_offline}")]
    assert {r.model_revision for r in results} == {hub_offline}
    assert [r.cached for r in results] == [False, True, True]


def test_hub_revision_not_in_the_cache_offline_says_what_to_do(hub_offline):
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE") as e:
        download.download(spec_for("hf://acme/tiny@no-such-branch"))
    assert "unset HF_HUB_OFFLINE" in str(e.value)


def test_hub_corrupted_blob_is_named_and_deleted(hub_offline, cache_env):
    link = snapshot_file(cache_env / "hub", "acme/tiny", hub_offline, "model.safetensors")
    blob = link.resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(ModelError, match=r"model\.safetensors is corrupt: the Hub's LFS sha256 is [0-9a-f]{64}"):
        download.download(spec_for("hf://acme/tiny@main"))
    assert not blob.exists() and not link.exists()
    # offline, the deleted file cannot come back: the next run says so instead of using a bad file
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE"):
        download.download(spec_for("hf://acme/tiny@main"))


def test_hub_second_download_does_not_rehash(hub_offline, monkeypatch):
    download.download(spec_for("hf://acme/tiny@main"))
    import datagen.storage.hub

    monkeypatch.setattr(datagen.storage.hub, "verify_snapshot", lambda *a, **k: pytest.fail("verified again"))
    assert download.download(spec_for("hf://acme/tiny@main")).cached


def test_hub_custom_code_only_when_trusted(hub_offline, model_dir):
    plain = download.download(spec_for("hf://acme/tiny@main"))
    trusted = download.download(spec_for("hf://acme/tiny@main", engine={"trust_remote_code": True}))
    assert "modeling_custom.py" not in plain.files
    assert "modeling_custom.py" in trusted.files and trusted.model_dir == plain.model_dir


# -- local directories ---------------------------------------------------------------------------


def test_local_directory_is_used_in_place_with_a_content_fingerprint(tmp_path, cache_env, model_dir):
    import shutil

    d = shutil.copytree(model_dir, tmp_path / "local")
    first = download.download(spec_for(str(d)))
    assert first.model_dir == str(d) and first.model_revision == first.fingerprint
    assert not cache_env.exists(), "nothing is copied into the cache"
    (d / "generation_config.json").write_text("{}")
    assert download.download(spec_for(str(d))).fingerprint != first.fingerprint


def test_missing_local_directory_is_a_bad_input(tmp_path, cache_env):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        download.download(spec_for(str(tmp_path / "nope")))
