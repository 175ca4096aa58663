"""The bucket a fanned-out run writes its dataset to (``datagen.storage.fleet``), against a real S3 server:
what counts as a shard in the bucket, uploads checked against their records, another dataset's
location refused."""

from __future__ import annotations

import json

import pytest

from datagen.data.contract import Manifest, ShardRecord
from datagen.errors import OutputConflictError, ValidationFailed
from datagen.storage import fleet, s3
from tests.support.fake_dataset import make_dataset
from tests.support.s3server import s3_env, s3_server  # noqa: F401  (fixtures)

pytestmark = pytest.mark.s3


def _setup(s3_env, tmp_path, shards: int = 3):  # noqa: F811
    spool = make_dataset(tmp_path / "spool", shards=shards, validated=False)
    records = [ShardRecord.model_validate(r) for r in json.loads((spool / "manifest.json").read_text())["shards"]]
    dest = fleet.location(f"s3://{s3_env.create_bucket()}/ds")
    transfer = s3.TransferSettings.from_settings()
    return s3.make_client(transfer), transfer, spool, records, dest


def test_uploaded_shards_are_in_the_bucket_and_only_with_their_own_key(s3_env, tmp_path):  # noqa: F811
    client, transfer, spool, records, dest = _setup(s3_env, tmp_path)
    expected = {r.index: r.shard_key for r in records}
    assert fleet.shards_in_bucket(client, dest, expected) == {}

    sent = fleet.upload_shards(client, spool, records[:2], dest, transfer=transfer)
    assert sent == sum(r.bytes for r in records[:2])
    assert sorted(fleet.shards_in_bucket(client, dest, expected)) == [0, 1]
    # a record of another spec's key (another model, dataset or engine) is not this shard
    assert sorted(fleet.shards_in_bucket(client, dest, {**expected, 1: "another-key"})) == [0]

    # an object that does not hold what its record says is not in the bucket either
    raw = s3_env.client()
    raw.put_object(Bucket=dest.bucket, Key=f"ds/{records[0].path}", Body=b"x" * records[0].bytes,
                   Metadata={"sha256": "0" * 64})
    assert sorted(fleet.shards_in_bucket(client, dest, expected)) == [1]


def test_a_spool_file_that_differs_from_its_record_is_never_uploaded(s3_env, tmp_path):  # noqa: F811
    client, transfer, spool, records, dest = _setup(s3_env, tmp_path)
    path = spool / records[0].path
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValidationFailed, match="differs from its record"):
        fleet.upload_shards(client, spool, records[:1], dest, transfer=transfer)
    assert s3.list_objects(client, dest) == []


def test_a_location_holding_another_dataset_is_refused(s3_env, tmp_path):  # noqa: F811
    client, _, spool, _, dest = _setup(s3_env, tmp_path)
    raw = (spool / "manifest.json").read_bytes()
    fingerprint = Manifest.model_validate_json(raw).fingerprint
    assert fleet.check_destination(client, dest, fingerprint) is None
    fleet.put_manifest(client, dest, raw)
    assert fleet.check_destination(client, dest, fingerprint).fingerprint == fingerprint
    with pytest.raises(OutputConflictError, match="another dataset"):
        fleet.check_destination(client, dest, "f" * 64)


def test_a_range_receipt_round_trips(s3_env, tmp_path):  # noqa: F811
    client, _, _, _, dest = _setup(s3_env, tmp_path)
    assert fleet.read_receipt(client, dest, "extract-range-abc") is None
    fleet.write_receipt(client, dest, "extract-range-abc", {"worker": "run-1", "shards_extracted": [0, 1]})
    assert fleet.read_receipt(client, dest, "extract-range-abc") == {"worker": "run-1", "shards_extracted": [0, 1]}
