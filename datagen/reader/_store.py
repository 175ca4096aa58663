"""Where a dataset's bytes come from: a local directory or an S3 prefix, read by byte range.

A ``Store`` answers three questions about a file of the dataset: how large it is, the bytes of
a range, and the sha256 of the whole file. Nothing is downloaded whole unless the caller asks
for the sha256 of a shard (then the bytes are streamed through the hash and dropped).

S3 objects are pinned: the first look at a shard records its ETag, and every later ranged read
carries ``If-Match`` with it, so an object replaced while a job trains is refused, never mixed.
The boto3 client is made lazily in each process (DataLoader workers are new processes, and a
client must not cross a fork).
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from datagen.errors import DatasetError, UnsafePathError

HASH_BLOCK = 8 << 20


@dataclass(frozen=True)
class FileInfo:
    """What the store says about one file before its bytes are read."""

    size: int  # bytes
    etag: str | None = None  # S3: the object's ETag (reads are pinned to it); local: None
    sha256: str | None = None  # S3: the sha256 the object's metadata records (datagen publish)


class Store(Protocol):
    """Read access to the files of one dataset (paths relative to its root)."""

    uri: str  # the dataset's location, for messages

    def read_text(self, rel: str) -> bytes: ...

    def info(self, rel: str) -> FileInfo: ...

    def read(self, rel: str, start: int, end: int, *, etag: str | None = None) -> bytes | bytearray: ...

    def sha256(self, rel: str, *, etag: str | None = None) -> str: ...


def _inside(rel: str) -> str:
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(f"shard path {rel!r} leads outside the dataset",
                              hint="the manifest is corrupt or hostile; run `datagen validate`")
    return rel


class LocalStore:
    """A dataset directory on a local or network filesystem, read with ``pread``."""

    def __init__(self, root: str | Path, placed: dict[str, Path] | None = None) -> None:
        self.root = Path(root).resolve()
        self.uri = str(self.root)
        self.placed: dict[str, Path] = dict(placed or {})  # shard path -> the volume it lies on (not the root)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def place(self, placed: dict[str, Path]) -> None:
        """Shard paths that are relative to another output volume than the dataset directory."""
        self.placed.update({rel: Path(root).resolve() for rel, root in placed.items()})

    def _path(self, rel: str) -> Path:
        return self.placed.get(rel, self.root) / _inside(rel)

    def read_text(self, rel: str) -> bytes:
        try:
            return self._path(rel).read_bytes()
        except FileNotFoundError:
            raise DatasetError(f"no {rel}: the dataset is incomplete or not a datagen dataset", path=self.uri,
                               hint="finish `datagen extract` (it writes the manifest last)") from None

    def info(self, rel: str) -> FileInfo:
        try:
            return FileInfo(size=self._path(rel).stat().st_size)
        except FileNotFoundError:
            raise DatasetError(f"{rel} is listed in the manifest but does not exist", path=self.uri,
                               hint="the dataset is incomplete: run `datagen validate`, re-extract") from None

    def _fd(self, rel: str) -> int:
        with self._lock:
            if self._pid != os.getpid():  # a forked worker: the parent's descriptors are shared, reopen
                self._fds, self._pid = {}, os.getpid()
            fd = self._fds.get(rel)
            if fd is None:
                fd = self._fds[rel] = os.open(self._path(rel), os.O_RDONLY)
            return fd

    def read(self, rel: str, start: int, end: int, *, etag: str | None = None) -> bytearray:
        fd, out, pos = self._fd(rel), bytearray(end - start), start
        view = memoryview(out)
        while pos < end:
            n = os.preadv(fd, [view[pos - start:]], pos)
            if n <= 0:
                raise DatasetError(f"{rel} ended at byte {pos}, before {end}", path=self.uri,
                                   hint="the shard is truncated: run `datagen validate`, re-extract")
            pos += n
        return out  # writable: torch.frombuffer views it without a copy

    def sha256(self, rel: str, *, etag: str | None = None) -> str:
        h = hashlib.sha256()
        with self._path(rel).open("rb", buffering=0) as f:
            while block := f.read(HASH_BLOCK):
                h.update(block)
        return h.hexdigest()

    def __getstate__(self) -> dict:
        return {"root": self.root, "placed": self.placed}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["root"], state.get("placed"))


class S3Store:
    """A dataset under an S3 prefix, read with ranged GETs through ``datagen.storage.s3``."""

    def __init__(self, uri: str) -> None:
        from datagen.specs.source import parse_s3_uri

        self.location = parse_s3_uri(uri)
        self.uri = self.location.uri
        self._client = None
        self._pid = None
        self._lock = threading.Lock()

    def _key(self, rel: str) -> str:
        rel = _inside(rel)
        return f"{self.location.prefix}/{rel}" if self.location.prefix else rel

    def client(self):
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                from datagen.storage import s3

                self._client, self._pid = s3.make_client(), os.getpid()
            return self._client

    def read_text(self, rel: str) -> bytes:
        from datagen.storage import s3

        if s3.head_object(self.client(), self.location.bucket, self._key(rel)) is None:
            raise DatasetError(f"no {rel}: the dataset is incomplete or not a datagen dataset", path=self.uri,
                               hint="publish it with `datagen publish` (the manifest is written last)")
        return s3.get_bytes(self.client(), self.location.bucket, self._key(rel))

    def info(self, rel: str) -> FileInfo:
        from datagen.storage import s3

        got = s3.head_object(self.client(), self.location.bucket, self._key(rel))
        if got is None:
            raise DatasetError(f"{rel} is listed in the manifest but does not exist", path=self.uri,
                               hint="the upload is incomplete: run `datagen publish` again")
        return FileInfo(size=got.size, etag=got.etag, sha256=got.sha256)

    def read(self, rel: str, start: int, end: int, *, etag: str | None = None) -> bytes:
        from datagen.storage import s3

        return s3.get_range(self.client(), self.location.bucket, self._key(rel), start=start, end=end, etag=etag)

    def sha256(self, rel: str, *, etag: str | None = None) -> str:
        from datagen.storage import s3

        return s3.sha256_object(self.client(), self.location.bucket, self._key(rel), etag=etag)

    def __getstate__(self) -> dict:
        return {"uri": self.uri}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["uri"])


def open_store(location: str | Path) -> LocalStore | S3Store:
    """The store of ``location``: ``s3://bucket/prefix`` or a directory."""
    text = str(location)
    return S3Store(text) if text.startswith("s3://") else LocalStore(text)
