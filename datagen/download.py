"""The `download` step: bring a model into the shared model cache, verified, once per host.

``datagen download --spec SPEC`` reads the spec's ``model`` source (``datagen.sources``):

* ``hf://org/name@revision``: ``datagen.hub`` (revision resolved to a commit sha);
* ``s3://bucket/prefix``: ``datagen.s3_mirror`` (parallel ranged reads, resumable);
* a local directory: used in place, nothing copied; its revision is its content fingerprint.

The cache (``datagen.model_cache``) is keyed by source and resolved revision; a second download
of the same revision only checks that the files are still there; concurrent downloads of one
model on one host serialize on a file lock. Every file is verified against the source's
checksum before the step succeeds.

The result's ``fingerprint`` identifies the model's content the same way whatever the source
(``datagen.modelinfo.model_content_hash``: small files hashed whole, large weight files by
size and their first and last MiB), so one model fetched from the Hub or from its S3 mirror
has one fingerprint.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from datagen.errors import ModelNotFoundError
from datagen.model_cache import ModelCache, VerifiedRecord, cache_root
from datagen.modelinfo import inspect_model, model_content_hash
from datagen.sources import HubSource, LocalSource, S3Source, SourceKind, SourcesSpec, load_sources_spec, needed_files

HELP = "Download the spec's model (hf://, s3:// or a local dir) into the shared model cache, verified."

log = logging.getLogger(__name__)


class DownloadResult(BaseModel):
    """What `datagen download` returns (the last stdout line, and the task's result)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(description="The model source as the spec gave it.")
    kind: SourceKind = Field(description="hf, s3 or local.")
    model_dir: str = Field(description="Local model directory to give the engine (absolute path).")
    resolved_revision: str = Field(
        description="Hub: the commit sha. S3: sha256 of the mirror's listing. Local: the content fingerprint."
    )
    fingerprint: str = Field(description="Content fingerprint of the model directory (source-independent).")
    files: list[str] = Field(description="The model files, relative to model_dir.")
    bytes: int = Field(description="Total size of those files in bytes.")
    cached: bool = Field(description="True when the model was already in the cache (nothing fetched).")
    fetched_bytes: int = Field(description="Bytes transferred by this run (S3; 0 when cached or local).")
    seconds: float = Field(description="Wall time of the step.")


def _local(source: LocalSource, *, trust_remote_code: bool) -> tuple[VerifiedRecord, str]:
    d = source.path
    if not d.is_dir():
        raise ModelNotFoundError(f"model directory {d} does not exist", hint="fix the spec's model path")
    info = inspect_model(d, trust_remote_code=trust_remote_code)
    fingerprint = model_content_hash(info)
    rels = needed_files(
        [p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()], trust_remote_code=trust_remote_code
    )
    from datagen.model_cache import VerifiedFile

    files = tuple(VerifiedFile(path=r, size=(d / r).stat().st_size, checksum="") for r in rels)
    return VerifiedRecord(source=str(d), revision=fingerprint, model_dir=str(d), files=files), fingerprint


def run(spec: SourcesSpec) -> DownloadResult:
    """Download (or find) the spec's model. See the module docstring."""
    start = time.monotonic()
    source = spec.source
    cache = ModelCache(cache_root(spec.model_cache))
    trust = spec.engine.trust_remote_code
    fetched = 0
    if isinstance(source, LocalSource):
        record, fingerprint = _local(source, trust_remote_code=trust)
        cached = True
    else:
        if isinstance(source, HubSource):
            from datagen.hub import download_hub

            record, cached = download_hub(source, cache, trust_remote_code=trust)
        elif isinstance(source, S3Source):
            from datagen.s3_mirror import download_mirror

            record, cached, fetched = download_mirror(source, cache, trust_remote_code=trust)
        else:  # pragma: no cover - parse_model_source returns one of the three
            raise AssertionError(source)
        fingerprint = model_content_hash(inspect_model(record.model_dir, trust_remote_code=trust))
    result = DownloadResult(
        source=spec.model,
        kind=source.kind,
        model_dir=str(Path(record.model_dir).absolute()),
        resolved_revision=record.revision,
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


def add_arguments(parser) -> None:
    parser.add_argument("--spec", required=True, help="spec JSON (datagen.sources.SourcesSpec): model, out, engine")


def main(args) -> dict:
    return run(load_sources_spec(args.spec)).model_dump(mode="json")
