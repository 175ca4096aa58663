"""Durable file writes (datagen/data/files.py): a file is its old content or its new one."""

from __future__ import annotations

import errno
import hashlib
import json

import pytest

from datagen.data import files
from datagen.data.checksums import sha256_file
from datagen.data.files import atomic_write_bytes, atomic_write_json


def test_atomic_writes_replace_whole_files_and_leave_the_old_one_on_failure(tmp_path, monkeypatch):
    p = tmp_path / "sub" / "manifest.json"
    atomic_write_json(p, {"b": 1, "a": [1, 2]})
    assert p.read_text() == '{\n "a": [\n  1,\n  2\n ],\n "b": 1\n}\n'  # sorted keys, one trailing newline
    assert sha256_file(p) == hashlib.sha256(p.read_bytes()).hexdigest()

    def fail(fd):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(files.os, "fsync", fail)
    with pytest.raises(OSError, match="I/O error"):
        atomic_write_bytes(p, b"half")
    assert json.loads(p.read_text()) == {"a": [1, 2], "b": 1}
    assert [q.name for q in p.parent.iterdir()] == ["manifest.json"]
