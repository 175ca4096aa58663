"""datagen.reader on a real S3 server (SeaweedFS): ranged reads only, objects checked and pinned."""

from __future__ import annotations

import pytest
import torch

from datagen.errors import StorageError
from datagen.reader import ShardRefused, Verify, open_dataset
from datagen.storage import publish
from tests.support.fake_dataset import approve
from tests.support.s3server import s3_env, s3_server, upload_tree  # noqa: F401  (fixtures)
from tests.support.synthetic_shards import make_synthetic_dataset

pytestmark = pytest.mark.s3


@pytest.fixture
def local(tmp_path):
    root = make_synthetic_dataset(tmp_path / "ds", rows=30, samples_per_shard=8, skipped=(4,), tokens=(20, 60),
                                  hidden=64)
    approve(root)  # `datagen publish` publishes validated datasets only
    return root


def published(s3_env, local) -> str:
    bucket = s3_env.create_bucket()
    uri = f"s3://{bucket}/nightly/ds"
    publish.publish(local, to=uri)
    return uri


def record_gets(reader) -> list[dict]:
    """Every GetObject the reader's client sends from now on (key, Range)."""
    calls: list[dict] = []
    reader.store.client().meta.events.register(
        "provide-client-params.s3.GetObject", lambda params, **_: calls.append(dict(params)))
    return calls


def test_a_published_dataset_reads_the_same_as_the_local_one_with_ranged_reads_only(s3_env, local):
    uri = published(s3_env, local)
    remote, here = open_dataset(uri), open_dataset(local)
    assert remote.verify is Verify.STORED  # the objects' sha256 metadata vouch for them: no whole-shard read
    gets = record_gets(remote)

    assert remote.rows == here.rows and remote.lengths == here.lengths
    for i in range(len(here)):
        a, b = remote[i], here[i]
        assert a.row == b.row and torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.hidden_states, b.hidden_states)

    row_bytes = len(remote.layer_ids) * remote.hidden_size * 2  # bf16
    assert len(gets) == len(here)  # one ranged read per sample, of exactly its states
    for i, call in enumerate(gets):
        assert call["IfMatch"]  # pinned to the object that was checked
        start, end = (int(x) for x in call["Range"].removeprefix("bytes=").split("-"))
        assert end + 1 - start == here.lengths[i] * row_bytes


def test_objects_without_a_recorded_checksum_are_refused_unless_hashed(s3_env, local):
    bucket = s3_env.create_bucket()
    upload_tree(s3_env.client(), bucket, "copied", local)  # plain boto3: no sha256 metadata
    uri = f"s3://{bucket}/copied"

    with pytest.raises(ShardRefused, match="records no sha256"):
        open_dataset(uri)
    hashed = open_dataset(uri, verify=Verify.FULL)
    assert hashed[0].row == 0


def test_a_corrupt_object_is_refused_by_its_checksum(s3_env, local):
    uri = published(s3_env, local)
    bucket, key = uri.removeprefix("s3://").split("/", 1)[0], "nightly/ds/shards/shard-000001.safetensors"
    client = s3_env.client()
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[-len(data) // 3] ^= 0x10
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))  # same size, no metadata

    with pytest.raises(ShardRefused, match="shard-000001.*records no sha256"):
        open_dataset(uri)
    reader = open_dataset(uri, verify=Verify.FULL)
    assert reader[0].row == 0  # shard 0 is fine
    with pytest.raises(ShardRefused, match="shard-000001.*sha256"):
        reader[reader.rows.index(8)]

    # a forged claim: the metadata says the manifest's sha256, the bytes differ; the full hash catches it
    sha = reader.manifest.shards[1].sha256
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data), Metadata={"sha256": sha})
    with pytest.raises(ShardRefused, match="shard-000001.*sha256"):
        open_dataset(uri, verify=Verify.FULL)[reader.rows.index(8)]


def test_an_object_replaced_while_training_is_not_mixed_in(s3_env, local):
    uri = published(s3_env, local)
    reader = open_dataset(uri)
    bucket, key = uri.removeprefix("s3://").split("/", 1)[0], "nightly/ds/shards/shard-000000.safetensors"
    client = s3_env.client()
    old = client.get_object(Bucket=bucket, Key=key)
    data = bytearray(old["Body"].read())
    data[-100] ^= 0x01
    # other bytes under the same key, size and sha256 claim: only the pinned ETag tells
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data), Metadata=old["Metadata"])

    with pytest.raises(StorageError, match="shard-000000"):
        reader[0]


def test_the_stream_reads_each_shard_in_large_ranged_reads(s3_env, local):
    from datagen.reader import ShardStreamDataset

    uri = published(s3_env, local)
    reader = open_dataset(uri)
    gets = record_gets(reader)
    rows = [x["row"] for x in ShardStreamDataset(reader, seed=0)]

    assert sorted(rows) == reader.rows
    assert len(gets) == len(reader.shards)  # each shard's states in one read (they are smaller than a run)
    rows_again = [x["row"] for x in ShardStreamDataset(reader, seed=0, run_bytes=10_000)]
    assert rows_again != rows and sorted(rows_again) == reader.rows
    assert len(gets) > 2 * len(reader.shards)  # smaller runs: more reads, each of whole samples
