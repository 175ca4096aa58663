"""File checksums in the forms that model sources publish them.

* sha256 (hex): Hugging Face LFS files, ``checksums.sha256`` manifests, our own S3 metadata;
* git blob sha1: small (non-LFS) files of a Hub repo;
* MD5 and multipart ETags: what S3 reports for objects uploaded without a checksum
  (``md5(md5(part1) + md5(part2) + ...)-N``, for parts of one size).

``verify_file`` reads a file once and checks it against one ``Expected`` value.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from pathlib import Path

from datagen.errors import SpecError

BLOCK = 8 * 1024 * 1024
CHECKSUM_MANIFEST = "checksums.sha256"


class ChecksumKind(str, enum.Enum):
    SHA256 = "sha256"  # hex sha256 of the content
    GIT_SHA1 = "git-sha1"  # sha1 of b"blob <size>\0" + content (a git blob id)
    MD5 = "md5"  # hex md5 of the content (a single-part S3 ETag)
    MULTIPART_ETAG = "multipart-etag"  # "<hex>-<parts>" with parts of part_size bytes


@dataclass(frozen=True)
class Expected:
    """What a file must hash to, and where that claim came from (for error messages)."""

    kind: ChecksumKind
    value: str
    origin: str  # e.g. "hub LFS sha256", "checksums.sha256", "S3 ETag"
    part_size: int | None = None  # MULTIPART_ETAG only


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
    return h.hexdigest()


def git_blob_sha1(path: str | Path) -> str:
    p = Path(path)
    h = hashlib.sha1(f"blob {p.stat().st_size}\0".encode(), usedforsecurity=False)
    with p.open("rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
    return h.hexdigest()


def multipart_etag(path: str | Path, part_size: int) -> str:
    """The ETag S3 gives an object uploaded in parts of ``part_size`` bytes."""
    digests = []
    with open(path, "rb") as f:
        while True:
            part = hashlib.md5(usedforsecurity=False)
            remaining = part_size
            while remaining:
                block = f.read(min(BLOCK, remaining))
                if not block:
                    break
                part.update(block)
                remaining -= len(block)
            if remaining == part_size:  # nothing read: end of file
                break
            digests.append(part.digest())
            if remaining:
                break
    # a one-part multipart upload gets a "-1" ETag too
    return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"


def md5_file(path: str | Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
    return h.hexdigest()


def actual_checksum(path: str | Path, expected: Expected) -> str:
    """Hash ``path`` the way ``expected`` is written."""
    if expected.kind is ChecksumKind.SHA256:
        return sha256_file(path)
    if expected.kind is ChecksumKind.GIT_SHA1:
        return git_blob_sha1(path)
    if expected.kind is ChecksumKind.MD5:
        return md5_file(path)
    if expected.part_size is None:
        raise ValueError("a multipart ETag needs the part size")
    return multipart_etag(path, expected.part_size)


def matches(path: str | Path, expected: Expected) -> tuple[bool, str]:
    """(whether the file matches, the value it actually has)."""
    actual = actual_checksum(path, expected)
    return actual == expected.value.lower(), actual


def parse_checksum_manifest(text: str, *, origin: str = CHECKSUM_MANIFEST) -> dict[str, str]:
    """Parse ``sha256sum`` output (``<hex>  <path>`` or ``<hex> *<path>``): path -> sha256.

    Paths are relative to the manifest's directory; a leading ``./`` is dropped.
    """
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        digest, _, name = line.partition(" ")
        name = name.lstrip(" *")
        if len(digest) != 64 or not all(c in "0123456789abcdefABCDEF" for c in digest) or not name:
            raise SpecError(
                f"{origin}:{n} is not a sha256sum line: {line[:80]!r}",
                hint="write it with `sha256sum FILES > checksums.sha256` in the model directory",
            )
        out[name.removeprefix("./")] = digest.lower()
    return out
