"""datagen.data.checksums: the checksum forms sources publish, checked against their producers."""

from __future__ import annotations

import hashlib
import subprocess

import pytest

from datagen.data.checksums import (
    ChecksumKind,
    Expected,
    git_blob_sha1,
    matches,
    multipart_etag,
    parse_checksum_manifest,
)
from datagen.errors import SpecError


def test_git_blob_sha1_equals_git_hash_object(tmp_path):
    p = tmp_path / "config.json"
    p.write_bytes(b'{"hidden_size": 64}\n')
    out = subprocess.run(["git", "hash-object", str(p)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("git not available")
    assert git_blob_sha1(p) == out.stdout.strip()


def test_multipart_etag_of_uneven_parts(tmp_path):
    data = bytes(range(256)) * 1000  # 256000 bytes: parts of 100000, 100000, 56000
    p = tmp_path / "f"
    p.write_bytes(data)
    parts = [hashlib.md5(data[i : i + 100000]).digest() for i in range(0, len(data), 100000)]
    assert multipart_etag(p, 100000) == hashlib.md5(b"".join(parts)).hexdigest() + "-3"
    ok, actual = matches(p, Expected(ChecksumKind.MULTIPART_ETAG, multipart_etag(p, 100000), "test", 100000))
    assert ok


def test_sha256sum_manifest_lines(tmp_path):
    text = "# made by sha256sum\n" + "ab" * 32 + "  config.json\n" + "CD" * 32 + " *./model.safetensors\n"
    assert parse_checksum_manifest(text) == {"config.json": "ab" * 32, "model.safetensors": "cd" * 32}
    with pytest.raises(SpecError, match=":1 is not a sha256sum line"):
        parse_checksum_manifest("nothex  config.json")
