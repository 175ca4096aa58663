"""The `download` step: bring a model into the shared model cache, verified, once per host.

``datagen download --spec SPEC`` (the spec's ``model``: ``hf://org/name@revision``,
``s3://bucket/prefix`` or a local directory). The work is ``datagen.storage.download.download`` (the
sources, the cache, the verification and the fingerprint: its module docstring); this module is its
command line and result.
"""

from __future__ import annotations

from dataclasses import asdict

from pydantic import BaseModel, ConfigDict, Field

from datagen.steps._args import StepSpec
from datagen.specs.source import SourceKind, load_sources_spec

HELP = "Download the spec's model (hf://, s3:// or a local dir) into the shared model cache, verified."


class DownloadResult(BaseModel):
    """What `datagen download` returns (the last stdout line, and the task's result)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(description="The model source as the spec gave it.")
    kind: SourceKind = Field(description="hf, s3 or local.")
    model_dir: str = Field(description="Local model directory to give the engine (absolute path).")
    model_revision: str = Field(
        description="The revision resolved: hub, the commit sha; S3, sha256 of the mirror's listing; local, the "
        "content fingerprint. What the extraction and regeneration specs take as their model_revision."
    )
    fingerprint: str = Field(description="Content fingerprint of the model directory (source-independent).")
    files: list[str] = Field(description="The model files, relative to model_dir.")
    bytes: int = Field(description="Total size of those files in bytes.")
    cached: bool = Field(description="True when the model was already in the cache (nothing fetched).")
    fetched_bytes: int = Field(description="Bytes transferred by this run (S3; 0 when cached or local).")
    seconds: float = Field(description="Wall time of the step.")


class Spec(StepSpec):
    """``datagen download``'s command line."""

    spec: str = Field(description="spec JSON (datagen.specs.source.SourcesSpec): model, out, engine")


Result = DownloadResult


def run(spec: Spec) -> DownloadResult:
    """``datagen download --spec SPEC``: the spec file's model, downloaded
    (``datagen.storage.download.download``)."""
    from datagen.storage.download import download

    return DownloadResult(**asdict(download(load_sources_spec(spec.spec))))
