"""The shared model cache: where downloads go, how they are keyed, locked and remembered.

Layout under the cache root (``DATAGEN_MODEL_CACHE``, or the spec's ``model_cache``)::

    hub/                                   huggingface_hub's own cache layout
                                           (models--org--name/{blobs,snapshots,refs,trees})
    s3/<bucket>/<prefix>/<revision>/       an S3 mirror's files, as in the mirror
    s3/<bucket>/<prefix>/<revision>.partial/   chunks of files still in flight (resume state)
    verified/<key>.json                    a verified download: its files, sizes, checksums
    locks/<key>.lock                       one host-level lock per model download

``key`` is derived from the source URI, its resolved revision and the file selection (with or
without the model's own code), so the same revision of the same source is downloaded once per
host, and a changed source (new commit, changed mirror) gets a new directory (shared by both
selections: allowing the code adds its files beside the weights). Nothing in a model directory is ours: markers and locks live beside it, so a
model directory holds exactly the model's files.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from datagen import settings
from datagen.specs.extraction import sha256_hex

LOCK_TIMEOUT_S = 6 * 3600  # a download of a 600 GB model can hold the lock for hours


@dataclass(frozen=True)
class VerifiedFile:
    path: str  # relative to the model directory, "/"-separated
    size: int  # bytes
    checksum: str  # "<kind>:<value>" as verified, e.g. "sha256:ab12..."


@dataclass(frozen=True)
class VerifiedRecord:
    """What a completed, verified download holds. Written last; its presence means 'done'."""

    source: str  # source URI as given, e.g. hf://org/name@main
    revision: str  # resolved revision: commit sha, S3 listing hash, or content hash
    model_dir: str  # absolute path of the model directory
    files: tuple[VerifiedFile, ...]

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


def cache_root(explicit: str | None = None) -> Path:
    return Path(explicit).expanduser() if explicit else settings.model_cache()


def cache_key(source_uri: str, revision: str, file_set: str) -> str:
    """A file-name-safe key: the same for the same source at the same resolved revision and the
    same selection of files (``model_files.file_set_name``: with or without the model's code)."""
    return sha256_hex(f"{source_uri}\0{revision}\0{file_set}")[:32]


class ModelCache:
    """The cache at one root directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def hub_dir(self) -> Path:
        return self.root / "hub"

    def s3_dir(self, bucket: str, prefix: str, revision: str) -> Path:
        return self.root / "s3" / bucket / (prefix or "_root") / revision[:16]

    def s3_partial_dir(self, bucket: str, prefix: str, revision: str) -> Path:
        d = self.s3_dir(bucket, prefix, revision)
        return d.with_name(d.name + ".partial")

    def lock(self, key: str):
        """A host-level lock (``filelock``) held while one model is downloaded and verified."""
        from filelock import FileLock

        path = self.root / "locks" / f"{key}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        return FileLock(str(path), timeout=LOCK_TIMEOUT_S)

    def _record_path(self, key: str) -> Path:
        return self.root / "verified" / f"{key}.json"

    def read_verified(self, key: str) -> VerifiedRecord | None:
        """The record of a completed download, if its files are all still there at their sizes."""
        path = self._record_path(key)
        try:
            raw = json.loads(path.read_text())
            record = VerifiedRecord(
                source=raw["source"],
                revision=raw["revision"],
                model_dir=raw["model_dir"],
                files=tuple(VerifiedFile(**f) for f in raw["files"]),
            )
        except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
            return None
        d = Path(record.model_dir)
        for f in record.files:
            p = d / f.path
            if not p.is_file() or p.stat().st_size != f.size:
                return None  # someone removed or truncated a file: download again
        return record

    def write_verified(self, key: str, record: VerifiedRecord) -> None:
        path = self._record_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps(asdict(record), indent=1, sort_keys=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def forget(self, key: str) -> None:
        self._record_path(key).unlink(missing_ok=True)
