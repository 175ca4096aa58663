"""Durable file writes: a file is either its old content or its new one, after a crash too.

The one place that fsyncs a directory (``fsync_dir``): after a rename, the directory entry must
reach the disk before the file counts as written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Write to a temporary name in the same directory, fsync, rename, fsync the directory (a
    caller that writes many files into one directory may leave that to one ``fsync_dir`` after
    them: ``sync_dir=False``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk must not keep the half-written file
        raise
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)


def atomic_write_json(path: Path, obj, *, sync_dir: bool = True) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode(), sync_dir=sync_dir)
