"""Publishing a validated dataset to S3, shards first, manifest last (the library under the
`publish` step, ``datagen/steps/publish.py``: ``datagen publish DATASET --to s3://bucket/prefix``).

The validation gate: publish refuses a dataset unless ``DATASET/.datagen/validation.json``
(written by ``datagen validate``) says ``{"ok": true, "manifest_sha256": "<hex>"}`` and that sha256
equals the sha256 of the bytes of ``DATASET/manifest.json`` now. A dataset changed after it was
validated (a new manifest) must be validated again. Each shard's bytes are hashed again before
upload and must match the manifest's sha256 (a shard changed on disk after validation is refused).

Layout at the destination (the data contract, ``datagen.data.contract``)::

    s3://bucket/prefix/shards/shard-000000.safetensors   ...
    s3://bucket/prefix/manifest.json                     uploaded LAST

``.datagen/`` (private state) is not uploaded. A reader that polls for ``manifest.json`` never
sees a partial dataset: the manifest is written only after every shard is uploaded and checked.

Idempotent and resumable: a shard already at the destination with the same size and sha256
(object metadata ``sha256``, written by every upload) is skipped; a run that died mid-way is
re-run and uploads only what is missing. Multipart uploads left unfinished by a killed run are
aborted. A destination that already holds a different dataset's manifest is refused (publish to
a new prefix). One publisher per destination at a time.

Transfers: parallel multipart uploads (``datagen.storage.s3.upload_many``) with a SHA-256 checksum per
part, verified by the server; every object is checked (size, sha256) after upload.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterator

from pydantic import ValidationError

from datagen.data.checksums import sha256_file
from datagen.data.contract import MANIFEST_NAME, VALIDATION_REPORT, Manifest, ShardRecord
from datagen.specs.extraction import sha256_hex
from datagen.errors import OutputConflictError, UnsafePathError, ValidationFailed
from datagen.storage import s3
from datagen.specs.source import S3Source, parse_s3_uri

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Publication:
    """What one ``publish`` did; the step's ``PublishResult`` holds the same fields (described there)."""

    dataset: str  # the local dataset directory
    destination: str  # s3://bucket/prefix
    manifest_uri: str  # s3:// URI of the published manifest.json
    manifest_sha256: str  # sha256 of manifest.json (what validation approved)
    shards: int  # shards in the dataset
    uploaded: list[str]  # shard paths uploaded by this run
    skipped: list[str]  # shard paths already at the destination with the same sha256
    manifest_uploaded: bool  # False when the same manifest was already there
    bytes_uploaded: int  # bytes uploaded by this run (shards + manifest)
    bytes_total: int  # bytes of the dataset (shards + manifest)
    aborted_stale_uploads: int  # unfinished multipart uploads of killed runs, aborted
    seconds: float  # wall time
    upload_mb_per_s: float | None  # MB/s (1e6 bytes) of the shard uploads, when any


def read_validated_manifest(dataset: Path) -> tuple[bytes, Manifest]:
    """The manifest's bytes and record, if validation approved exactly these bytes.

    Raises ValidationFailed (naming what to run) otherwise.
    """
    manifest_path = dataset / MANIFEST_NAME
    try:
        raw = manifest_path.read_bytes()
    except FileNotFoundError:
        raise ValidationFailed(
            f"{dataset} has no {MANIFEST_NAME}: the dataset is incomplete",
            hint="finish the extraction (datagen extract) and validate it (datagen validate) first",
        ) from None
    report_path = dataset / VALIDATION_REPORT
    try:
        report = json.loads(report_path.read_text())
    except FileNotFoundError:
        raise ValidationFailed(
            f"{dataset} has not been validated ({VALIDATION_REPORT} is missing)",
            hint=f"run `datagen validate {dataset}` first; only validated datasets are published",
        ) from None
    except json.JSONDecodeError as e:
        raise ValidationFailed(f"{report_path} is not valid JSON: {e}", hint=f"run `datagen validate {dataset}` again") from e
    if not isinstance(report, dict) or report.get("ok") is not True:
        problems = report.get("problems", []) if isinstance(report, dict) else []
        raise ValidationFailed(
            f"{dataset} failed validation ({len(problems)} problems recorded in {VALIDATION_REPORT})",
            problems=problems,
            hint="fix the problems (or re-extract the shards they name), then validate again",
        )
    digest = sha256_hex(raw)
    if report.get("manifest_sha256") != digest:
        raise ValidationFailed(
            f"{dataset}/{MANIFEST_NAME} changed after it was validated "
            f"(validated {str(report.get('manifest_sha256'))[:12]}, now {digest[:12]})",
            hint=f"run `datagen validate {dataset}` again",
        )
    try:
        manifest = Manifest.model_validate_json(raw)
    except ValidationError as e:
        raise ValidationFailed(f"{manifest_path} does not follow the data contract: {e}", hint="re-extract") from e
    for shard in manifest.shards:
        p = PurePosixPath(shard.path)
        if p.is_absolute() or ".." in p.parts:
            raise UnsafePathError(f"manifest names shard path {shard.path!r} outside the dataset", hint="re-extract")
    return raw, manifest


def _check_destination(client, dest: S3Source, manifest_sha: str) -> bool:
    """True when this very manifest is already published there; OutputConflictError when another is."""
    head = s3.head_object(client, dest.bucket, dest.key(MANIFEST_NAME))
    if head is None:
        return False
    if head.sha256 == manifest_sha:
        return True
    raise OutputConflictError(
        f"{dest.uri} already holds another dataset's {MANIFEST_NAME} (sha256 {str(head.sha256)[:12]})",
        hint="publish to a new prefix; datasets are immutable once published",
    )


def _is_present(client, dest: S3Source, shard: ShardRecord, listed: dict[str, s3.ObjectInfo]) -> bool:
    info = listed.get(dest.key(shard.path))
    if info is None or info.size != shard.bytes:
        return False
    head = s3.head_object(client, dest.bucket, info.key)
    return head is not None and head.sha256 == shard.sha256


def _items(dataset: Path, dest: S3Source, shards: list[ShardRecord]) -> Iterator[s3.UploadItem]:
    """Each shard, re-hashed: bytes that differ from the validated manifest are never uploaded."""
    for shard in shards:
        path = dataset / shard.path
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise ValidationFailed(f"shard {shard.path} is missing from {dataset}", hint="re-extract and validate") from None
        if size != shard.bytes or sha256_file(path) != shard.sha256:
            raise ValidationFailed(
                f"shard {shard.path} changed after validation (its size or sha256 differs from the manifest)",
                hint=f"run `datagen validate {dataset}` again",
            )
        yield s3.UploadItem(path=path, key=dest.key(shard.path), sha256=shard.sha256)


def publish(dataset: str | Path, *, to: str, transfer: s3.TransferSettings | None = None) -> Publication:
    """Publish ``dataset`` to ``to`` (see the module docstring)."""
    start = time.monotonic()
    dataset = Path(dataset)
    dest = parse_s3_uri(to)
    raw, manifest = read_validated_manifest(dataset)
    manifest_sha = sha256_hex(raw)
    transfer = transfer or s3.TransferSettings.from_settings()
    client = s3.make_client(transfer)

    listed = {o.key: o for o in s3.list_objects(client, dest)}  # also: the bucket exists
    already = _check_destination(client, dest, manifest_sha)
    aborted = s3.abort_stale_uploads(client, dest)
    if aborted:
        log.info("aborted %d unfinished multipart uploads of an earlier run", aborted)
    todo = [s for s in manifest.shards if not _is_present(client, dest, s, listed)]
    skipped = [s.path for s in manifest.shards if s not in todo]
    log.info("publishing %s to %s: %d shards to upload, %d already there", dataset, dest.uri, len(todo), len(skipped))

    t0 = time.monotonic()
    sent = s3.upload_many(client, dest.bucket, _items(dataset, dest, todo), transfer=transfer) if todo else 0
    upload_s = time.monotonic() - t0
    s3.verify_uploaded(client, dest, todo)

    manifest_uploaded = not already
    if manifest_uploaded:
        s3.put_bytes(
            client, dest.bucket, dest.key(MANIFEST_NAME), raw, sha256=manifest_sha, content_type="application/json"
        )
        sent_total = sent + len(raw)
    else:
        sent_total = sent
    result = Publication(
        dataset=str(dataset),
        destination=dest.uri,
        manifest_uri=f"s3://{dest.bucket}/{dest.key(MANIFEST_NAME)}",
        manifest_sha256=manifest_sha,
        shards=len(manifest.shards),
        uploaded=[s.path for s in todo],
        skipped=skipped,
        manifest_uploaded=manifest_uploaded,
        bytes_uploaded=sent_total,
        bytes_total=sum(s.bytes for s in manifest.shards) + len(raw),
        aborted_stale_uploads=aborted,
        seconds=round(time.monotonic() - start, 3),
        upload_mb_per_s=round(sent / upload_s / 1e6, 1) if sent and upload_s > 0 else None,
    )
    log.info(
        "published %s: %d uploaded, %d skipped, %.1f MB%s",
        result.manifest_uri,
        len(result.uploaded),
        len(result.skipped),
        sent_total / 1e6,
        f" at {result.upload_mb_per_s} MB/s" if result.upload_mb_per_s else "",
    )
    return result
