"""Build a Hugging Face Hub cache by hand, as ``snapshot_download`` would have left it.

There is no network here, so Hub downloads are tested against a pre-populated cache with
``HF_HUB_OFFLINE=1``: the real huggingface_hub client resolves the revision through ``refs/``
and serves the snapshot, and datagen verifies it against the cached tree listing. Layout::

    <cache>/models--<org>--<name>/
        blobs/<etag>                       sha256 for LFS files (weights), git blob sha1 otherwise
        snapshots/<commit>/<path> -> ../../blobs/<etag>
        refs/<branch>                      the commit sha
        trees/<commit>.json                the tree listing (size, blob id, LFS sha256)
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors",)


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def populate_hub_cache(
    cache_dir: str | Path,
    repo_id: str,
    model_dir: str | Path,
    *,
    refs: tuple[str, ...] = ("main",),
    commit: str | None = None,
) -> str:
    """Put the files of ``model_dir`` into ``cache_dir`` as commit ``commit`` of ``repo_id``
    (a sha derived from the content when None), with ``refs`` pointing at it. Returns the sha."""
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache

    model_dir = Path(model_dir)
    files = sorted(p for p in model_dir.rglob("*") if p.is_file())
    contents = {p.relative_to(model_dir).as_posix(): p.read_bytes() for p in files}
    commit = commit or hashlib.sha1(b"".join(hashlib.sha256(c).digest() for c in contents.values())).hexdigest()
    storage = Path(cache_dir) / f"models--{repo_id.replace('/', '--')}"
    entries = {}
    for rel, data in contents.items():
        lfs = rel.endswith(LFS_SUFFIXES)
        sha256 = hashlib.sha256(data).hexdigest()
        etag = sha256 if lfs else _git_sha1(data)
        blob = storage / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = storage / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
        # the /tree endpoint reports an LFS file's blob id as the git sha1 of its pointer file
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(data)}\n".encode()
        entries[rel] = TreeCacheEntry(
            size=len(data),
            blob_id=_git_sha1(pointer) if lfs else etag,
            lfs_sha256=sha256 if lfs else None,
            lfs_size=len(data) if lfs else None,
        )
    for ref in refs:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    write_tree_cache(str(storage), commit, entries)
    return commit


def snapshot_file(cache_dir: str | Path, repo_id: str, commit: str, rel: str) -> Path:
    """The snapshot's link to ``rel`` (its target is the blob)."""
    return Path(cache_dir) / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit / rel
