"""Small typed functions over boto3: every S3 call datagen makes goes through here.

The client comes from boto3's own configuration chain: endpoint (``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL``), region and credentials (environment, ``AWS_PROFILE``, instance role) are
read by boto3, never by datagen, and never logged. Transfer tuning comes from
``datagen.settings`` (part size, concurrency, retries, timeouts).

Errors are translated in one place (``datagen.storage._s3_errors``): transient faults become
``StorageError`` (the orchestrator retries), a missing bucket ``SpecError``, missing or refused
credentials ``CannotRunHereError``.

Integrity: uploads send a SHA-256 checksum per part (``ChecksumAlgorithm=SHA256``, verified by
the server on receipt) and store the whole file's sha256 as object metadata (``sha256``), which
``ObjectInfo.sha256`` reads back; that is what makes re-uploads skippable and downloads
verifiable.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from datagen import settings
from datagen.data import media_fetch as media
from datagen.errors import SpecError, StorageError
from datagen.storage._s3_errors import NO_BUCKET_HINT, NOT_FOUND_CODES, error_code, translated
from datagen.specs.source import S3Source, parse_s3_uri

if TYPE_CHECKING:
    from datagen.data.contract import ShardRecord

log = logging.getLogger(__name__)

SHA256_METADATA_KEY = "sha256"  # x-amz-meta-sha256: hex sha256 of the whole object


@dataclass(frozen=True)
class TransferSettings:
    """Tuning of one S3 client and its transfers."""

    chunk_bytes: int  # multipart part size and ranged-read size
    max_concurrency: int  # parts in flight
    max_attempts: int  # attempts per request (botocore "standard" retries)
    connect_timeout_s: float
    read_timeout_s: float

    @classmethod
    def from_settings(cls) -> TransferSettings:
        return cls(
            chunk_bytes=settings.s3_chunk_bytes(),
            max_concurrency=settings.s3_max_concurrency(),
            max_attempts=settings.s3_max_attempts(),
            connect_timeout_s=settings.s3_connect_timeout_s(),
            read_timeout_s=settings.s3_read_timeout_s(),
        )


@dataclass(frozen=True)
class ObjectInfo:
    """One S3 object as a listing or a HEAD reports it."""

    key: str
    size: int  # bytes
    etag: str  # without quotes; "<md5>-<parts>" for multipart uploads
    sha256: str | None = None  # hex sha256 of the whole object, when the object says so
    last_modified: datetime | None = None


def make_client(transfer: TransferSettings | None = None):
    """An S3 client from boto3's configuration chain plus datagen's transfer settings."""
    import boto3
    from botocore.config import Config

    t = transfer or TransferSettings.from_settings()
    config = Config(
        connect_timeout=t.connect_timeout_s,
        read_timeout=t.read_timeout_s,
        retries={"max_attempts": t.max_attempts, "mode": "standard"},
        max_pool_connections=max(10, t.max_concurrency * 2),
        # path-style works with every S3 implementation (SeaweedFS, MinIO, Ceph) and with AWS
        s3={"addressing_style": "path"},
    )
    with translated("create an S3 client", None):
        client = boto3.session.Session().client("s3", config=config)
    log.debug("S3 endpoint %s", client.meta.endpoint_url)
    return client


def _transfer_config(t: TransferSettings):
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(
        multipart_threshold=t.chunk_bytes,
        multipart_chunksize=t.chunk_bytes,
        max_concurrency=t.max_concurrency,
        use_threads=True,
    )


def _info(key: str, raw: dict) -> ObjectInfo:
    meta = raw.get("Metadata") or {}
    sha = meta.get(SHA256_METADATA_KEY)
    return ObjectInfo(
        key=key,
        size=int(raw.get("ContentLength", raw.get("Size", 0))),
        etag=str(raw.get("ETag", "")).strip('"'),
        sha256=sha.lower() if sha else None,
        last_modified=raw.get("LastModified"),
    )


def list_objects(client, location: S3Source) -> list[ObjectInfo]:
    """Every object under ``location`` (recursive). Listings carry no metadata: sha256 is None."""
    prefix = f"{location.prefix}/" if location.prefix else ""
    out: list[ObjectInfo] = []
    with translated("list", location.uri):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                out.append(_info(obj["Key"], obj))
    return out


def head_object(client, bucket: str, key: str) -> ObjectInfo | None:
    """The object's size, ETag and sha256 metadata; None when it does not exist."""
    from botocore.exceptions import ClientError

    with translated("read", f"s3://{bucket}/{key}"):
        try:
            raw = client.head_object(Bucket=bucket, Key=key)
        except ClientError as e:
            if error_code(e)[0] in NOT_FOUND_CODES:
                return None
            raise
    return _info(key, raw)


def first_part_size(client, bucket: str, key: str) -> int | None:
    """Size of part 1 of a multipart object (what its ETag was computed with); None if unknown."""
    with translated("read", f"s3://{bucket}/{key}"):
        raw = client.head_object(Bucket=bucket, Key=key, PartNumber=1)
    return int(raw["ContentLength"]) if raw.get("PartsCount") else None


def get_bytes(client, bucket: str, key: str) -> bytes:
    with translated("read", f"s3://{bucket}/{key}"):
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()


def read_range_into(client, bucket: str, key: str, fd: int, *, start: int, end: int, etag: str) -> None:
    """Write bytes [start, end) of an object at the same offsets of the open file ``fd``,
    streaming (no chunk is held in memory). Refused (StorageError) if the object no longer has
    ``etag``: a mirror that changes during a download must not produce a mixed file."""
    where = f"s3://{bucket}/{key}"
    with translated("read", where):
        resp = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", IfMatch=f'"{etag}"')
        offset = start
        for block in resp["Body"].iter_chunks(1024 * 1024):
            os.pwrite(fd, block, offset)
            offset += len(block)
    if offset != end:
        raise StorageError(f"short read of {where} bytes {start}-{end}: got {offset - start}", hint="retry")


def get_range(client, bucket: str, key: str, *, start: int, end: int, etag: str | None = None) -> bytes:
    """Bytes [start, end) of an object in one ranged GET. With ``etag``, refused (StorageError)
    if the object no longer has it: a reader pinned to the object it checked never mixes two
    versions of a shard."""
    if end <= start:
        return b""
    where = f"s3://{bucket}/{key}"
    extra = {"IfMatch": f'"{etag}"'} if etag else {}
    with translated("read", where):
        data = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **extra)["Body"].read()
    if len(data) != end - start:
        raise StorageError(f"short read of {where} bytes {start}-{end}: got {len(data)}", hint="retry")
    return data


def sha256_object(client, bucket: str, key: str, *, etag: str | None = None) -> str:
    """sha256 of a whole object, streamed (nothing is kept in memory or on disk)."""
    extra = {"IfMatch": f'"{etag}"'} if etag else {}
    h = hashlib.sha256()
    with translated("read", f"s3://{bucket}/{key}"):
        body = client.get_object(Bucket=bucket, Key=key, **extra)["Body"]
        for block in body.iter_chunks(1024 * 1024):
            h.update(block)
    return h.hexdigest()


def put_bytes(client, bucket: str, key: str, data: bytes, *, sha256: str, content_type: str) -> None:
    """Write a small object in one request, with its checksum checked by the server."""
    with translated("write", f"s3://{bucket}/{key}"):
        client.put_object(
            Bucket=bucket,
            Key=key,
            Body=data,
            ContentType=content_type,
            ChecksumAlgorithm="SHA256",
            Metadata={SHA256_METADATA_KEY: sha256},
        )


def upload_file(client, path: Path, bucket: str, key: str, *, sha256: str, transfer: TransferSettings) -> None:
    """Upload a file with parallel multipart transfers; each part carries a SHA-256 checksum and
    the object records the whole file's ``sha256`` in its metadata."""
    with translated("upload", f"s3://{bucket}/{key}"):
        client.upload_file(
            str(path),
            bucket,
            key,
            ExtraArgs={"ChecksumAlgorithm": "SHA256", "Metadata": {SHA256_METADATA_KEY: sha256}},
            Config=_transfer_config(transfer),
        )


def download_file(client, bucket: str, key: str, path: Path, *, transfer: TransferSettings) -> None:
    """Download an object to ``path`` with parallel ranged transfers (the bytes as stored: a reader
    checks them against its own record)."""
    with translated("download", f"s3://{bucket}/{key}"):
        client.download_file(bucket, key, str(path), Config=_transfer_config(transfer))


def delete_object(client, bucket: str, key: str) -> None:
    with translated("delete", f"s3://{bucket}/{key}"):
        client.delete_object(Bucket=bucket, Key=key)


def abort_stale_uploads(client, location: S3Source) -> int:
    """Abort unfinished multipart uploads under ``location`` (left by a killed publish): they
    hold storage and never become objects. Returns how many were aborted."""
    prefix = f"{location.prefix}/" if location.prefix else ""
    n = 0
    with translated("list multipart uploads in", location.uri):
        pages = client.get_paginator("list_multipart_uploads").paginate(Bucket=location.bucket, Prefix=prefix)
        for page in pages:
            for up in page.get("Uploads", []):
                client.abort_multipart_upload(Bucket=location.bucket, Key=up["Key"], UploadId=up["UploadId"])
                n += 1
    return n


def check_bucket(client, bucket: str) -> None:
    """SpecError when the bucket does not exist, CannotRunHereError when it may not be used."""
    from botocore.exceptions import ClientError

    with translated("use", f"s3://{bucket}"):
        try:
            client.head_bucket(Bucket=bucket)
            return
        except ClientError as e:
            if error_code(e)[0] not in NOT_FOUND_CODES:  # HEAD has no body: a bare 404
                raise
    raise SpecError(f"cannot use s3://{bucket}: the bucket does not exist", hint=NO_BUCKET_HINT)


def probe_writable(client, location: S3Source) -> str:
    """Write, read back and delete a small probe object under ``location``. Returns its key."""
    check_bucket(client, location.bucket)
    key = "/".join(p for p in (location.prefix, f".datagen-probe-{uuid.uuid4().hex}") if p)
    data = b"datagen write probe\n"
    put_bytes(client, location.bucket, key, data, sha256=hashlib.sha256(data).hexdigest(), content_type="text/plain")
    try:
        if get_bytes(client, location.bucket, key) != data:
            raise StorageError(f"probe object s3://{location.bucket}/{key} read back wrong", hint="retry")
    finally:
        delete_object(client, location.bucket, key)
    return key


@dataclass(frozen=True)
class UploadItem:
    path: Path  # local file
    key: str  # destination key
    sha256: str  # hex sha256 of the file, stored as the object's metadata


def upload_many(client, bucket: str, items: Iterable[UploadItem], *, transfer: TransferSettings) -> int:
    """Upload files through one transfer manager: parts of all files share ``max_concurrency``
    threads, so many small files and a few large ones both keep the link busy. ``items`` may be
    a generator (the next file is prepared while earlier ones upload). On the first failure the
    others are cancelled and the error is raised (translated). Returns the bytes uploaded."""
    from boto3.s3.transfer import create_transfer_manager

    total = 0
    with translated("upload to", f"s3://{bucket}"):
        with create_transfer_manager(client, _transfer_config(transfer)) as manager:
            futures = []
            for item in items:
                extra = {"ChecksumAlgorithm": "SHA256", "Metadata": {SHA256_METADATA_KEY: item.sha256}}
                futures.append(manager.upload(str(item.path), bucket, item.key, extra_args=extra))
                total += item.path.stat().st_size
            for fut in futures:
                fut.result()
    return total


def verify_uploaded(client, dest: S3Source, shards: list["ShardRecord"], *,
                    hint: str = "retry the publish (it re-uploads what does not match)") -> None:
    """Raise StorageError unless every shard object in ``dest`` has its record's size and sha256."""
    for shard in shards:
        head = head_object(client, dest.bucket, dest.key(shard.path))
        if head is None or head.size != shard.bytes or head.sha256 != shard.sha256:
            raise StorageError(
                f"{dest.uri}/{shard.path} does not hold what was uploaded "
                f"({'missing' if head is None else f'{head.size} bytes, sha256 {head.sha256}'})",
                hint=hint,
            )


# --- images of chat rows (datagen.data.media_fetch reads s3:// urls through this) ---------------------

@functools.lru_cache(maxsize=1)
def _media_client():
    return make_client()


def read_url(url: str) -> bytes:
    """The bytes of the object at an s3:// url (StorageError when it cannot be read)."""
    src = parse_s3_uri(url)
    return get_bytes(_media_client(), src.bucket, src.prefix)


media.register_remote_reader("s3", read_url)
