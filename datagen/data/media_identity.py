"""A row's identity with its images: the row's bytes' sha256 and its images' bytes' sha256, so that
a changed image re-plans and re-extracts its shard (``datagen.data.planning_rows.row_identity``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from datagen.data.media import MediaProblem, has_media
from datagen.data.media_fetch import read


def row_identity(raw_digest: bytes, image_digests: list[str]) -> bytes:
    """A media row's identity: the row's bytes' sha256 and its images', hashed together."""
    h = hashlib.sha256(b"datagen-media-row-1\0")
    h.update(raw_digest)
    for d in image_digests:
        h.update(bytes.fromhex(d))
    return h.digest()


ABSENT = "0" * 64  # the digest of an image that cannot be read (its row is skipped)


def identity(raw_digest: bytes, obj: dict, base: Path) -> bytes:
    """One row's identity: ``raw_digest`` (its bytes' sha256) for a row without images, else
    ``row_identity`` of it and its images'. An image that cannot be read counts as ``ABSENT``: once
    it can, its row's identity changes and its shard is extracted again. A malformed row keeps its
    own hash (planning stops at it)."""
    if not has_media(obj):
        return raw_digest
    try:
        urls = [p["image_url"]["url"] for m in obj["messages"] if isinstance(m, dict) and isinstance(m.get("content"), list)
                for p in m["content"] if isinstance(p, dict) and p.get("type") == "image_url"]
    except (KeyError, TypeError):
        return raw_digest
    digests = []
    for u in urls:
        try:
            digests.append(hashlib.sha256(read(u, base)[0]).hexdigest() if isinstance(u, str) else ABSENT)
        except MediaProblem:
            digests.append(ABSENT)
    return row_identity(raw_digest, digests)
