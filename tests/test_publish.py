"""The `publish` step against a real S3 server (SeaweedFS on loopback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from datagen.data.contract import MANIFEST_NAME
from datagen.errors import EXIT_TRANSIENT, EXIT_VALIDATION, OutputConflictError, SpecError, ValidationFailed
from datagen.storage import publish
from tests.support.fake_dataset import approve, make_dataset
from tests.support.s3server import s3_env, s3_server, s3_server_private  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.s3


@pytest.fixture
def fast_faults(monkeypatch):
    """Few retries and short timeouts: a stopped server fails the step in seconds."""
    monkeypatch.setenv("DATAGEN_S3_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("DATAGEN_S3_CONNECT_TIMEOUT", "1")
    monkeypatch.setenv("DATAGEN_S3_READ_TIMEOUT", "5")
    monkeypatch.setenv("DATAGEN_S3_CHUNK_MB", "5")  # S3's smallest part: several parts per shard


def objects(client, bucket: str, prefix: str) -> dict[str, dict]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"][len(prefix) + 1 :]: o for page in pages for o in page.get("Contents", [])}


def manifest_of(dataset: Path) -> dict:
    return json.loads((dataset / MANIFEST_NAME).read_text())


def test_publish_uploads_every_shard_then_the_manifest(s3_env, tmp_path):
    ds = make_dataset(tmp_path / "ds", shards=3)
    bucket = s3_env.create_bucket()
    result = publish.publish(ds, to=f"s3://{bucket}/runs/a")

    client = s3_env.client()
    shards = [s["path"] for s in manifest_of(ds)["shards"]]
    assert set(objects(client, bucket, "runs/a")) == {MANIFEST_NAME, *shards}, ".datagen/ is not published"
    assert result.uploaded == shards and result.skipped == [] and result.manifest_uploaded
    assert result.manifest_uri == f"s3://{bucket}/runs/a/manifest.json"
    for s in manifest_of(ds)["shards"]:
        obj = client.get_object(Bucket=bucket, Key=f"runs/a/{s['path']}")
        assert obj["Body"].read() == (ds / s["path"]).read_bytes()
        assert obj["Metadata"]["sha256"] == s["sha256"]
    assert client.get_object(Bucket=bucket, Key="runs/a/manifest.json")["Body"].read() == (ds / MANIFEST_NAME).read_bytes()
    assert result.bytes_uploaded == result.bytes_total


def test_publishing_again_uploads_nothing(s3_env, tmp_path):
    ds = make_dataset(tmp_path / "ds", shards=3)
    bucket = s3_env.create_bucket()
    publish.publish(ds, to=f"s3://{bucket}/runs/a")
    before = {k: (o["ETag"], o["LastModified"]) for k, o in objects(s3_env.client(), bucket, "runs/a").items()}
    time.sleep(1.1)  # LastModified has one-second resolution
    again = publish.publish(ds, to=f"s3://{bucket}/runs/a")
    assert again.uploaded == [] and len(again.skipped) == 3 and not again.manifest_uploaded
    assert again.bytes_uploaded == 0
    after = {k: (o["ETag"], o["LastModified"]) for k, o in objects(s3_env.client(), bucket, "runs/a").items()}
    assert after == before, "nothing was rewritten"


def test_a_partly_published_dataset_is_completed(s3_env, tmp_path):
    ds = make_dataset(tmp_path / "ds", shards=4)
    bucket = s3_env.create_bucket()
    publish.publish(ds, to=f"s3://{bucket}/p")
    client = s3_env.client()
    client.delete_object(Bucket=bucket, Key="p/manifest.json")
    client.delete_object(Bucket=bucket, Key="p/shards/shard-000002.safetensors")
    client.put_object(Bucket=bucket, Key="p/shards/shard-000003.safetensors", Body=b"a torn upload")
    result = publish.publish(ds, to=f"s3://{bucket}/p")
    assert result.uploaded == ["shards/shard-000002.safetensors", "shards/shard-000003.safetensors"]
    assert result.skipped == ["shards/shard-000000.safetensors", "shards/shard-000001.safetensors"]
    assert result.manifest_uploaded


def test_manifest_appears_only_after_every_shard(s3_env, tmp_path, fast_faults):
    ds = make_dataset(tmp_path / "ds", shards=6, samples_per_shard=32, tokens_per_sample=64, hidden=512)
    shards = {s["path"] for s in manifest_of(ds)["shards"]}
    bucket = s3_env.create_bucket()
    client = s3_env.client()
    seen: list[set[str]] = []
    done = threading.Event()

    def poll():
        while not done.is_set():
            seen.append(set(objects(client, bucket, "m")))
            time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        publish.publish(ds, to=f"s3://{bucket}/m")
    finally:
        done.set()
        poller.join()
    seen.append(set(objects(client, bucket, "m")))
    with_manifest = [keys for keys in seen if MANIFEST_NAME in keys]
    assert with_manifest and all(shards <= keys for keys in with_manifest), "a reader saw a manifest before its shards"
    assert any(keys & shards and MANIFEST_NAME not in keys for keys in seen), "the poll never saw the upload in flight"
    listing = objects(client, bucket, "m")
    assert listing[MANIFEST_NAME]["LastModified"] >= max(listing[s]["LastModified"] for s in shards)


def _publish_cmd(dataset: Path, to: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "datagen", "publish", str(dataset), "--to", to],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_server_stopped_mid_upload_then_restarted_publish_completes(s3_server_private, tmp_path, fast_faults):
    server = s3_server_private
    ds = make_dataset(tmp_path / "ds", shards=8, samples_per_shard=32, tokens_per_sample=64, hidden=512)
    shards = [s["path"] for s in manifest_of(ds)["shards"]]
    bucket = server.create_bucket()
    to = f"s3://{bucket}/r"
    env = os.environ | server.env() | {"DATAGEN_S3_MAX_CONCURRENCY": "2"}
    client = server.client()

    proc = _publish_cmd(ds, to, env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None and len(objects(client, bucket, "r")) < 2:
        time.sleep(0.01)
    assert proc.poll() is None, "the publish finished before the server could be stopped"
    server.kill()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_TRANSIENT, err  # retryable: the orchestrator tries again

    server.start()
    present = objects(client, bucket, "r")
    assert MANIFEST_NAME not in present, "an interrupted publish never shows a manifest"
    assert 2 <= len(present) < len(shards)

    proc = _publish_cmd(ds, to, env)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1].split(": ", 1)[1])
    assert len(result["skipped"]) >= 2 and sorted(result["uploaded"] + result["skipped"]) == shards
    assert set(objects(client, bucket, "r")) == {MANIFEST_NAME, *shards}
    for s in manifest_of(ds)["shards"]:
        assert client.get_object(Bucket=bucket, Key=f"r/{s['path']}")["Body"].read() == (ds / s["path"]).read_bytes()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_unvalidated_dataset_is_refused(s3_env, tmp_path):
    ds = make_dataset(tmp_path / "ds", validated=False)
    bucket = s3_env.create_bucket()
    with pytest.raises(ValidationFailed, match="has not been validated") as e:
        publish.publish(ds, to=f"s3://{bucket}/x")
    assert e.value.exit_code == EXIT_VALIDATION and "datagen validate" in str(e.value)
    assert objects(s3_env.client(), bucket, "x") == {}


def test_manifest_changed_after_validation_is_refused(s3_env, tmp_path):
    ds = make_dataset(tmp_path / "ds")
    m = manifest_of(ds) | {"created_at": "2000-01-01T00:00:00+00:00"}
    (ds / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(ValidationFailed, match="changed after it was validated"):
        publish.publish(ds, to=f"s3://{s3_env.create_bucket()}/x")


def test_shard_changed_after_validation_is_never_uploaded(s3_env, tmp_path):
    ds = make_dataset(tmp_path / "ds", shards=3)
    shard = ds / "shards/shard-000001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    bucket = s3_env.create_bucket()
    with pytest.raises(ValidationFailed, match=r"shard shards/shard-000001\.safetensors changed after validation"):
        publish.publish(ds, to=f"s3://{bucket}/x")
    keys = objects(s3_env.client(), bucket, "x")
    assert "shards/shard-000001.safetensors" not in keys and MANIFEST_NAME not in keys


def test_another_datasets_destination_is_refused(s3_env, tmp_path):
    bucket = s3_env.create_bucket()
    publish.publish(make_dataset(tmp_path / "a", seed=1), to=f"s3://{bucket}/same")
    other = make_dataset(tmp_path / "b", seed=2)
    with pytest.raises(OutputConflictError, match="already holds another dataset"):
        publish.publish(other, to=f"s3://{bucket}/same")


def test_missing_bucket_is_named(s3_env, tmp_path):
    ds = make_dataset(tmp_path / "ds")
    approve(ds)
    with pytest.raises(SpecError, match="bucket does not exist"):
        publish.publish(ds, to="s3://no-such-bucket-anywhere/x")


def test_a_dataset_extracted_and_validated_by_datagen_is_published(s3_env, tmp_path, tmp_path_factory):
    """The gate end to end: the real extraction and `datagen validate` write what publish reads."""
    from datagen.validation.dataset import validate
    from tests.support.extracted import copy_dataset, extracted_dataset

    ds = copy_dataset(extracted_dataset(tmp_path_factory), tmp_path / "ds")
    (ds / ".datagen" / "validation.json").unlink(missing_ok=True)
    bucket = s3_env.create_bucket()
    with pytest.raises(ValidationFailed, match="has not been validated"):
        publish.publish(ds, to=f"s3://{bucket}/real")
    assert validate(ds)["ok"]
    result = publish.publish(ds, to=f"s3://{bucket}/real")
    assert result.manifest_uploaded and len(result.uploaded) == result.shards == len(manifest_of(ds)["shards"])
