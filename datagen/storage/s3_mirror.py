"""Model download from an S3 mirror of a model directory (``s3://bucket/prefix``).

* Revision: S3 has no commits, so the mirror's revision is the sha256 of its listing (path,
  size and ETag of every engine file, the model's code included, and of ``checksums.sha256``
  when present). Any change to
  the mirror gives a new revision and a new cache directory.
* Transfer: every file is cut into ranges of ``DATAGEN_S3_CHUNK_MB``; ranges of all files are
  fetched in parallel (``DATAGEN_S3_MAX_CONCURRENCY``) straight into ``<dir>.partial/<file>``
  at their offsets. Each range read carries ``If-Match: <ETag>``, so an object replaced
  mid-download fails the read instead of producing a mixed file.
* Resume: each finished range is appended to ``<file>.ranges`` beside the partial file; a new
  run skips those ranges. (A range whose bytes were lost in a power cut is caught by the
  checksum below, which deletes the file.)
* Integrity: a finished file is checked before it is moved into the model directory, against,
  in order of preference: ``checksums.sha256`` beside the mirror (sha256sum format), the
  object's ``sha256`` metadata (what ``datagen publish`` and ``datagen.storage.s3.upload_file`` write),
  or its ETag (MD5, or the multipart ETag recomputed with the object's part size). A mismatch
  deletes the file and fails naming it. A file in the model directory has passed this check.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from datagen.data.checksums import CHECKSUM_MANIFEST, ChecksumKind, Expected, matches, parse_checksum_manifest
from datagen.specs.extraction import canonical_json, sha256_hex
from datagen.errors import ModelError, ModelNotFoundError, UnsafePathError
from datagen.storage import s3
from datagen.storage.model_cache import ModelCache, VerifiedFile, VerifiedRecord, cache_key
from datagen.specs.source import S3Source
from datagen.storage.model_files import file_set_name, needed_files

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MirrorFile:
    rel: str  # path relative to the mirror's prefix
    info: s3.ObjectInfo


@dataclass(frozen=True)
class Mirror:
    source: S3Source
    files: tuple[MirrorFile, ...]  # the engine's files, sorted by path
    checksums: dict[str, str]  # from checksums.sha256 (rel -> sha256); {} when absent
    revision: str  # sha256 of the listing

    @property
    def bytes(self) -> int:
        return sum(f.info.size for f in self.files)


def _rel(source: S3Source, key: str) -> str:
    return key[len(source.prefix) + 1 :] if source.prefix else key


def _escapes(rel: str) -> bool:
    """True when joining ``rel`` to a directory would leave it (S3 keys may hold '..' and '/')."""
    parts = rel.split("/")
    return not rel or rel.startswith("/") or "\\" in rel or any(p in ("..", ".", "") for p in parts)


def list_mirror(client, source: S3Source, *, trust_remote_code: bool) -> Mirror:
    """List the mirror and pick the engine's files. ModelNotFoundError when it is no model."""
    objects = {_rel(source, o.key): o for o in s3.list_objects(client, source)}
    wanted = needed_files(list(objects), trust_remote_code=trust_remote_code)
    # the revision covers the code files too, so that both selections share one directory
    versioned = needed_files(list(objects), trust_remote_code=True)
    if "config.json" not in wanted:
        raise ModelNotFoundError(
            f"{source.uri} holds no config.json ({len(objects)} objects)",
            hint="point the source at the prefix that holds the model directory's files",
        )
    unsafe = [rel for rel in versioned if _escapes(rel)]
    if unsafe:
        raise UnsafePathError(
            f"{source.uri} holds keys that lead out of the model directory: {unsafe[:3]}",
            hint="mirror the model with plain relative keys (no '..', no leading '/')",
        )
    checksums: dict[str, str] = {}
    manifest = objects.get(CHECKSUM_MANIFEST)
    if manifest is not None:
        text = s3.get_bytes(client, source.bucket, manifest.key).decode("utf-8", errors="replace")
        checksums = parse_checksum_manifest(text, origin=f"{source.uri}/{CHECKSUM_MANIFEST}")
    listing = [(rel, objects[rel].size, objects[rel].etag) for rel in versioned]
    if manifest is not None:
        listing.append((CHECKSUM_MANIFEST, manifest.size, manifest.etag))
    return Mirror(
        source=source,
        files=tuple(MirrorFile(rel, objects[rel]) for rel in wanted),
        checksums=checksums,
        revision=sha256_hex(canonical_json(listing)),
    )


def expected_checksum(client, mirror: Mirror, f: MirrorFile) -> Expected:
    """What ``f`` must hash to (see the module docstring for the order)."""
    if f.rel in mirror.checksums:
        return Expected(ChecksumKind.SHA256, mirror.checksums[f.rel], CHECKSUM_MANIFEST)
    head = s3.head_object(client, mirror.source.bucket, f.info.key)
    if head is not None and head.sha256:
        return Expected(ChecksumKind.SHA256, head.sha256, "the object's sha256 metadata")
    etag = f.info.etag
    if "-" not in etag:
        return Expected(ChecksumKind.MD5, etag, "the object's ETag (MD5)")
    part = s3.first_part_size(client, mirror.source.bucket, f.info.key)
    if part is None:
        raise ModelError(
            f"{mirror.source.uri}/{f.rel}: no checksum to verify it against (multipart ETag {etag}, part size unknown)",
            hint=f"put a {CHECKSUM_MANIFEST} (sha256sum format) beside the mirror's files",
        )
    return Expected(ChecksumKind.MULTIPART_ETAG, etag, f"the object's multipart ETag ({part}-byte parts)", part)


class _Ranges:
    """The ranges of one partial file already fetched (``<partial>.ranges``, one index a line,
    after a header naming the object's ETag, size and range size)."""

    def __init__(self, path: Path, header: str) -> None:
        self.path = path
        self.header = header
        self._lock = threading.Lock()
        self.done: set[int] = set()
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            lines = []
        if lines and lines[0] == header:
            self.done = {int(x) for x in lines[1:] if x.strip().isdigit()}
        else:
            path.write_text(header + "\n")

    def mark(self, index: int) -> None:
        with self._lock, self.path.open("a") as f:
            f.write(f"{index}\n")
            self.done.add(index)


@dataclass
class _FileJob:
    file: MirrorFile
    partial: Path
    ranges: _Ranges
    futures: list[Future]


def _start_file(client, pool: ThreadPoolExecutor, bucket: str, f: MirrorFile, partial: Path, chunk: int, counter: list[int]) -> _FileJob:
    partial.parent.mkdir(parents=True, exist_ok=True)
    size = f.info.size
    ranges = _Ranges(partial.with_name(partial.name + ".ranges"), f"{f.info.etag} {size} {chunk}")
    if not ranges.done and partial.exists():
        partial.unlink()  # bytes from an unknown state: start over
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    lock = threading.Lock()

    def fetch(i: int) -> None:
        start, end = i * chunk, min(size, (i + 1) * chunk)
        fd = os.open(partial, os.O_WRONLY)
        try:
            s3.read_range_into(client, bucket, f.info.key, fd, start=start, end=end, etag=f.info.etag)
        finally:
            os.close(fd)
        ranges.mark(i)
        with lock:
            counter[0] += end - start

    todo = [i for i in range(math.ceil(size / chunk)) if i not in ranges.done]
    return _FileJob(f, partial, ranges, [pool.submit(fetch, i) for i in todo])


def _finish_file(client, mirror: Mirror, job: _FileJob, dest: Path) -> VerifiedFile:
    """Wait for a file's ranges, verify it, move it into the model directory."""
    for fut in job.futures:
        fut.result()
    fd = os.open(job.partial, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    expected = expected_checksum(client, mirror, job.file)
    ok, actual = matches(job.partial, expected)
    if not ok:
        job.partial.unlink(missing_ok=True)
        job.ranges.path.unlink(missing_ok=True)
        raise ModelError(
            f"{mirror.source.uri}/{job.file.rel} is corrupt: {expected.origin} says {expected.value}, "
            f"the downloaded file has {actual}; the bad file was deleted",
            hint="repair the object in the mirror (or its checksums.sha256 line), then download again",
        )
    target = dest / job.file.rel
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(job.partial, target)
    job.ranges.path.unlink(missing_ok=True)
    return VerifiedFile(path=job.file.rel, size=job.file.info.size, checksum=f"{expected.kind.value}:{expected.value}")


def download_mirror(source: S3Source, cache: ModelCache, *, trust_remote_code: bool, transfer: s3.TransferSettings | None = None) -> tuple[VerifiedRecord, bool, int]:
    """Fetch and verify a mirror into the cache.

    Returns (record, whether it was already complete, bytes fetched by this call).
    """
    transfer = transfer or s3.TransferSettings.from_settings()
    client = s3.make_client(transfer)
    mirror = list_mirror(client, source, trust_remote_code=trust_remote_code)
    key = cache_key(source.uri, mirror.revision, file_set_name(trust_remote_code=trust_remote_code))
    with cache.lock(key):
        record = cache.read_verified(key)
        if record is not None:
            log.info("%s (revision %s) already in the cache: %s", source.uri, mirror.revision[:12], record.model_dir)
            return record, True, 0
        dest = cache.s3_dir(source.bucket, source.prefix, mirror.revision)
        partial_dir = cache.s3_partial_dir(source.bucket, source.prefix, mirror.revision)
        dest.mkdir(parents=True, exist_ok=True)
        log.info("downloading %s (%d files, %d bytes) into %s", source.uri, len(mirror.files), mirror.bytes, dest)
        counter = [0]
        verified: list[VerifiedFile] = []
        pending: list[_FileJob] = []
        with ThreadPoolExecutor(max_workers=transfer.max_concurrency, thread_name_prefix="s3-get") as pool:
            try:
                for f in mirror.files:
                    target = dest / f.rel
                    if target.is_file() and target.stat().st_size == f.info.size:
                        # moved here only after its checksum passed (by an earlier, interrupted run)
                        verified.append(_reverify_cheaply(client, mirror, f))
                        continue
                    pending.append(_start_file(client, pool, source.bucket, f, partial_dir / f.rel, transfer.chunk_bytes, counter))
                for job in pending:
                    verified.append(_finish_file(client, mirror, job, dest))
            except BaseException:
                for job in pending:
                    for fut in job.futures:
                        fut.cancel()
                raise
        shutil.rmtree(partial_dir, ignore_errors=True)
        record = VerifiedRecord(
            source=source.uri,
            revision=mirror.revision,
            model_dir=str(dest),
            files=tuple(sorted(verified, key=lambda v: v.path)),
        )
        cache.write_verified(key, record)
        return record, False, counter[0]


def _reverify_cheaply(client, mirror: Mirror, f: MirrorFile) -> VerifiedFile:
    expected = expected_checksum(client, mirror, f)
    return VerifiedFile(path=f.rel, size=f.info.size, checksum=f"{expected.kind.value}:{expected.value}")
