"""A dataset written straight to object storage by many hosts: the store a fanned-out run shares.

A fanned-out run (``ranges_in_flight > 1``) has no shared file system. Each range extracts into
its host's local spool, uploads every finished shard to the dataset's location (the spec's
``publish_to``) through the publish path (parallel multipart uploads, a SHA-256 checksum per part
verified by the server, the file's sha256 as object metadata, every object checked after upload),
and removes it from the spool. The parent writes the manifest last, after checking every shard
object. Layout under ``s3://bucket/prefix``::

    shards/shard-000000.safetensors        the contract's shard objects
    .datagen/shards/shard-000000.json      the shard's record (ShardRecord), written only after
                                           its object was uploaded and checked
    .datagen/ranges/<range key>.json       what the run that completed a range did
    manifest.json                          written LAST, by the parent

A shard is *in the bucket* when its record names the shard key the plan expects and its object
has the record's size and sha256: that is what a resumed range skips and what the manifest lists.
Readers see ``manifest.json`` and ``shards/`` (the data contract); ``.datagen/`` is private state,
as in a local dataset. No Prefect here: the flow's tasks call these functions.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import ValidationError

from datagen.data.checksums import sha256_file
from datagen.data.contract import MANIFEST_NAME, STATE_DIR, Manifest, ShardRecord, shard_name
from datagen.specs.extraction import sha256_hex
from datagen.errors import OutputConflictError, ValidationFailed
from datagen.storage import s3
from datagen.specs.source import S3Source, parse_s3_uri

log = logging.getLogger(__name__)

HEAD_WORKERS = 16  # parallel GET/HEAD requests when the bucket's shards are checked


def location(uri: str) -> S3Source:
    return parse_s3_uri(uri)


def record_rel(index: int) -> str:
    return f"{STATE_DIR}/shards/shard-{index:06d}.json"


def receipt_rel(range_key: str) -> str:
    return f"{STATE_DIR}/ranges/{range_key}.json"


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


# --- what the bucket holds ----------------------------------------------------------------------

def shards_in_bucket(client, dest: S3Source, expected: Mapping[int, str]) -> dict[int, ShardRecord]:
    """The shards of ``expected`` (index -> shard key) that are complete in the bucket (module
    docstring), with their records. One listing, then a GET and a HEAD per listed shard."""
    listed = {o.key: o for o in s3.list_objects(client, dest)}
    candidates = [k for k in expected if dest.key(record_rel(k)) in listed]

    def check(k: int) -> ShardRecord | None:
        try:
            rec = ShardRecord.model_validate_json(s3.get_bytes(client, dest.bucket, dest.key(record_rel(k))))
        except (ValidationError, ValueError):
            return None  # not a record of ours: the shard is extracted again
        if rec.index != k or rec.path != shard_name(k) or rec.shard_key != expected[k]:
            return None
        obj = listed.get(dest.key(rec.path))
        if obj is None or obj.size != rec.bytes:
            return None
        head = s3.head_object(client, dest.bucket, obj.key)
        return rec if head is not None and head.sha256 == rec.sha256 else None

    with ThreadPoolExecutor(max_workers=HEAD_WORKERS, thread_name_prefix="bucket-check") as ex:
        found = dict(zip(candidates, ex.map(check, candidates)))
    return {k: rec for k, rec in sorted(found.items()) if rec is not None}


def manifest_in_bucket(client, dest: S3Source) -> tuple[bytes, Manifest] | None:
    """The manifest at the destination, or None when there is none (yet)."""
    if s3.head_object(client, dest.bucket, dest.key(MANIFEST_NAME)) is None:
        return None
    raw = s3.get_bytes(client, dest.bucket, dest.key(MANIFEST_NAME))
    try:
        return raw, Manifest.model_validate_json(raw)
    except ValidationError as e:
        raise OutputConflictError(
            f"{dest.uri}/{MANIFEST_NAME} is not a manifest of this data contract: {e.errors()[0]['msg']}",
            hint="write the dataset to a new prefix",
        ) from None


def check_destination(client, dest: S3Source, fingerprint: str) -> Manifest | None:
    """The destination's manifest if it is this dataset's; None when there is none.

    Raises:
        OutputConflictError: it holds another dataset (datasets are immutable once written).
    """
    found = manifest_in_bucket(client, dest)
    if found is None:
        return None
    _, manifest = found
    if manifest.fingerprint != fingerprint:
        raise OutputConflictError(
            f"{dest.uri} already holds another dataset (fingerprint {manifest.fingerprint[:12]}, "
            f"this run's is {fingerprint[:12]})",
            hint="write the dataset to a new prefix (publish_to); datasets are immutable once written",
        )
    return manifest


# --- a range's uploads ---------------------------------------------------------------------------

def upload_shards(client, spool: Path, records: Iterable[ShardRecord], dest: S3Source, *,
                  transfer: s3.TransferSettings) -> int:
    """Upload finished shards from a local dataset directory (the spool), then their records.

    Each file is hashed again and must match its record; each object is checked (size, sha256)
    after upload, and only then is its record written. Returns the bytes uploaded.

    Raises:
        ValidationFailed: a spool file differs from its record (it is extracted again).
        StorageError: an object does not hold what was uploaded.
    """
    records = list(records)
    items = []
    for rec in records:
        path = spool / rec.path
        if not path.is_file() or path.stat().st_size != rec.bytes or sha256_file(path) != rec.sha256:
            raise ValidationFailed(
                f"spool file {path} differs from its record (size or sha256)",
                hint="remove it from the spool; the range extracts it again",
            )
        items.append(s3.UploadItem(path=path, key=dest.key(rec.path), sha256=rec.sha256))
    if not items:
        return 0
    sent = s3.upload_many(client, dest.bucket, items, transfer=transfer)
    for rec in records:
        s3.verify_uploaded(client, dest, [rec], hint="retry (the range uploads what does not match again)")
        raw = _json_bytes(rec.model_dump(mode="json"))
        s3.put_bytes(client, dest.bucket, dest.key(record_rel(rec.index)), raw, sha256=sha256_hex(raw),
                     content_type="application/json")
    return sent


def write_receipt(client, dest: S3Source, range_key: str, receipt: dict) -> None:
    raw = _json_bytes(receipt)
    s3.put_bytes(client, dest.bucket, dest.key(receipt_rel(range_key)), raw, sha256=sha256_hex(raw),
                 content_type="application/json")


def read_receipt(client, dest: S3Source, range_key: str) -> dict | None:
    if s3.head_object(client, dest.bucket, dest.key(receipt_rel(range_key))) is None:
        return None
    try:
        return json.loads(s3.get_bytes(client, dest.bucket, dest.key(receipt_rel(range_key))))
    except ValueError:
        return None


# --- the manifest, last -------------------------------------------------------------------------

def put_manifest(client, dest: S3Source, raw: bytes) -> None:
    """Write the manifest: the object whose presence means "complete"."""
    s3.put_bytes(client, dest.bucket, dest.key(MANIFEST_NAME), raw, sha256=sha256_hex(raw),
                 content_type="application/json")


def download_shards(client, dest: S3Source, records: Iterable[ShardRecord], out: Path, *,
                    transfer: s3.TransferSettings) -> int:
    """The shard objects of ``records`` as the files of a local dataset directory ``out`` (each
    written under a temporary name, then renamed): the bytes as the bucket holds them, for a check
    that reads every byte (`datagen validate`). Returns the bytes downloaded."""
    total = 0
    for rec in records:
        path = out / rec.path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-download"
        s3.download_file(client, dest.bucket, dest.key(rec.path), tmp, transfer=transfer)
        tmp.replace(path)
        total += path.stat().st_size
    return total


def write_records(records: Mapping[int, ShardRecord], directory: Path) -> None:
    """The records as local files (the input of `datagen assemble`)."""
    directory.mkdir(parents=True, exist_ok=True)
    for k, rec in records.items():
        (directory / f"shard-{k:06d}.json").write_bytes(_json_bytes(rec.model_dump(mode="json")))
