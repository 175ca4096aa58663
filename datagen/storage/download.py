"""Bringing a model into the shared model cache, verified, once per host (the library under the
`download` step, ``datagen/steps/download.py``: ``datagen download --spec SPEC``).

The spec's ``model`` source (``datagen.specs.source``):

* ``hf://org/name@revision``: ``datagen.storage.hub`` (revision resolved to a commit sha);
* ``s3://bucket/prefix``: ``datagen.storage.s3_mirror`` (parallel ranged reads, resumable);
* a local directory: used in place, nothing copied; its revision is its content fingerprint.

The cache (``datagen.storage.model_cache``) is keyed by source and resolved revision; a second download
of the same revision only checks that the files are still there; concurrent downloads of one
model on one host serialize on a file lock. Every file is verified against the source's
checksum before the step succeeds.

The ``fingerprint`` identifies the model's content the same way whatever the source
(``files_fingerprint``: the engine's files only; files up to ``modelinfo.FULL_HASH_LIMIT`` hashed
whole, larger weight files by size and their first and last MiB, the documented cheaper rule
that keeps a 600 GB checkpoint from being re-read on every run), so one model fetched from the
Hub, from its S3 mirror or used from a local copy has one fingerprint. Downloads are verified
in full (every byte against the source's checksum) whatever this rule skips.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from datagen.errors import ModelNotFoundError
from datagen.models.modelinfo import hash_file_sampled, inspect_model
from datagen.storage.model_cache import ModelCache, VerifiedFile, VerifiedRecord, cache_root
from datagen.specs.source import (
    HubSource,
    LocalSource,
    S3Source,
    SourceKind,
    SourcesSpec,
)
from datagen.storage.model_files import needed_files

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DownloadedModel:
    """What one ``download`` did; the step's ``DownloadResult`` holds the same fields (described there)."""

    source: str  # the model source as the spec gave it
    kind: SourceKind  # hf, s3 or local
    model_dir: str  # the local model directory to give the engine (absolute path)
    model_revision: str  # the revision resolved: the commit sha, the S3 listing's sha256, a local fingerprint
    fingerprint: str  # the content fingerprint of the model directory (source-independent)
    files: list[str]  # the model files, relative to model_dir
    bytes: int  # total size of those files in bytes
    cached: bool  # True when the model was already in the cache (nothing fetched)
    fetched_bytes: int  # bytes transferred by this run (S3; 0 when cached or local)
    seconds: float  # wall time


def files_fingerprint(model_dir: str | Path, files: list[str]) -> str:
    """Content fingerprint of ``files`` (relative paths) of a model directory (module docstring)."""
    import hashlib

    d = Path(model_dir)
    h = hashlib.sha256()
    for rel in sorted(files):
        hash_file_sampled(h, d / rel, rel)
    return h.hexdigest()


def _local(source: LocalSource, *, trust_remote_code: bool) -> VerifiedRecord:
    d = source.path
    if not d.is_dir():
        raise ModelNotFoundError(f"model directory {d} does not exist", hint="fix the spec's model path")
    inspect_model(d, trust_remote_code=trust_remote_code)  # a model directory, readable, of a known kind
    rels = needed_files(
        [p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()], trust_remote_code=trust_remote_code
    )
    files = tuple(VerifiedFile(path=r, size=(d / r).stat().st_size, checksum="") for r in rels)
    return VerifiedRecord(source=str(d), revision=files_fingerprint(d, rels), model_dir=str(d), files=files)


def download(spec: SourcesSpec) -> DownloadedModel:
    """Download (or find) the spec's model. See the module docstring."""
    start = time.monotonic()
    source = spec.source
    cache = ModelCache(cache_root(spec.model_cache))
    trust = spec.engine.trust_remote_code
    fetched = 0
    if isinstance(source, LocalSource):
        record = _local(source, trust_remote_code=trust)
        cached = True
    else:
        if isinstance(source, HubSource):
            from datagen.storage.hub import download_hub

            record, cached = download_hub(source, cache, trust_remote_code=trust)
        elif isinstance(source, S3Source):
            from datagen.storage.s3_mirror import download_mirror

            record, cached, fetched = download_mirror(source, cache, trust_remote_code=trust)
        else:  # pragma: no cover - parse_model_source returns one of the three
            raise AssertionError(source)
        inspect_model(record.model_dir, trust_remote_code=trust)
    fingerprint = files_fingerprint(record.model_dir, [f.path for f in record.files])
    result = DownloadedModel(
        source=spec.model,
        kind=source.kind,
        model_dir=str(Path(record.model_dir).absolute()),
        model_revision=record.revision,
        fingerprint=fingerprint,
        files=[f.path for f in record.files],
        bytes=record.bytes,
        cached=cached,
        fetched_bytes=fetched,
        seconds=round(time.monotonic() - start, 3),
    )
    log.info(
        "model %s at %s: %d files, %d bytes%s",
        spec.model,
        result.model_dir,
        len(result.files),
        result.bytes,
        " (cached)" if cached else "",
    )
    return result
