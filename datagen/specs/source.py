"""Where a model comes from: the typed model source, and the spec of `env-check` and `download`.

A model source is one string:

    hf://org/name@revision    a Hugging Face Hub repo; revision is a branch, tag or commit sha
                              (default ``main``); it is resolved to a commit sha before anything
                              is fetched, and that sha goes into the cache key and the manifest
    s3://bucket/prefix        a mirror of a model directory in S3 (any S3-compatible endpoint)
    /abs/or/relative/dir      a local model directory, used in place

``SourcesSpec`` is the pydantic model both steps read from ``--spec SPEC`` (a JSON file): the model
(``ModelChoice``, which the flow's pipeline spec derives from too), the captured layers and the engine
(``CaptureChoices``), the output and its expected size: what decides whether a run can start here.

This module parses and describes; it does no I/O.
"""

from __future__ import annotations

import enum
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from datagen.specs.extraction import CaptureChoices, read_spec_file
from datagen.errors import SpecError, spec_error

DEFAULT_HUB_REVISION = "main"
_HUB_RE = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.\-]*/[\w.\-]+)(?:@(?P<rev>[^\s@]+))?$")
# DNS-compatible bucket names (what every S3 implementation accepts).
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


class SourceKind(str, enum.Enum):
    """Where a model comes from."""

    HUB = "hf"  # Hugging Face Hub
    S3 = "s3"  # an S3 mirror of a model directory
    LOCAL = "local"  # a local directory, used in place


@dataclass(frozen=True)
class HubSource:
    repo_id: str  # "org/name"
    revision: str  # as written: branch, tag or commit sha (resolved later)

    kind = SourceKind.HUB

    @property
    def uri(self) -> str:
        return f"hf://{self.repo_id}@{self.revision}"

    @property
    def pinned(self) -> bool:
        """True when the revision is already a commit sha (nothing to resolve)."""
        return bool(_COMMIT_RE.match(self.revision))


@dataclass(frozen=True)
class S3Source:
    bucket: str
    prefix: str  # without leading or trailing "/"; "" for the bucket root

    kind = SourceKind.S3

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def key(self, rel: str) -> str:
        """The object key of ``rel`` (a path inside this prefix)."""
        return f"{self.prefix}/{rel}" if self.prefix else rel


@dataclass(frozen=True)
class LocalSource:
    path: Path  # absolute

    kind = SourceKind.LOCAL

    @property
    def uri(self) -> str:
        return str(self.path)


ModelSource = HubSource | S3Source | LocalSource


def parse_s3_uri(text: str) -> S3Source:
    """``s3://bucket/prefix`` -> S3Source. SpecError when it is not one."""
    if not text.startswith("s3://"):
        raise SpecError(f"{text!r} is not an S3 URI", hint="write it as s3://bucket/prefix")
    bucket, _, prefix = text[len("s3://") :].partition("/")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise SpecError(
            f"{text!r}: bucket name {bucket!r} is not a valid S3 bucket name",
            hint="bucket names are 3-63 characters of lower-case letters, digits, '.' and '-'",
        )
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise SpecError(f"{text!r}: the prefix has an empty, '.' or '..' part", hint="write s3://bucket/a/b")
    return S3Source(bucket=bucket, prefix=prefix)


def parse_model_source(text: str) -> ModelSource:
    """Parse a model source string (see the module docstring). Does not touch the source.

    The one parser of a model source: every spec that names one reads it through its ``source``
    (``SourcesSpec.source``, the flow's ``PipelineSpec.source``). A text is parsed once per process
    (a relative directory once per working directory, which it is made absolute against).
    """
    text = text.strip()
    return _parse_model_source(text, "" if "://" in text else os.getcwd())


@functools.lru_cache(maxsize=64)
def _parse_model_source(text: str, cwd: str) -> ModelSource:
    if text.startswith("hf://"):
        m = _HUB_RE.match(text)
        if m is None:
            raise SpecError(
                f"model source {text!r} is not a Hub reference",
                hint="write it as hf://org/name or hf://org/name@revision (branch, tag or commit sha)",
            )
        return HubSource(repo_id=m["repo"], revision=m["rev"] or DEFAULT_HUB_REVISION)
    if text.startswith("s3://"):
        src = parse_s3_uri(text)
        return src
    if "://" in text:
        raise SpecError(
            f"model source {text!r} has an unknown scheme",
            hint="use hf://org/name@revision, s3://bucket/prefix or a local directory",
        )
    if not text:
        raise SpecError("model source is empty", hint="name a model: hf://org/name@revision, s3://..., or a directory")
    path = Path(text).expanduser()
    return LocalSource(path=path if path.is_absolute() else Path(cwd) / path)


def is_s3_uri(text: str) -> bool:
    return text.startswith("s3://")


class ModelChoice(BaseModel):
    """The model a run extracts from, as the user names it, and where downloads of it are kept: declared here
    once for env-check's and download's spec and the flow's pipeline spec."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(
        description="Model source: hf://org/name@revision (a commit sha pins it), "
        "s3://bucket/prefix (a mirror of a model directory), or a local model directory."
    )
    model_cache: str | None = Field(
        None, description="Model cache directory for downloads; None: the DATAGEN_MODEL_CACHE setting."
    )

    @field_validator("model")
    @classmethod
    def _model_parses(cls, v: str) -> str:
        parse_model_source(v)  # raises SpecError (a ValueError) with what to write
        return v.strip()

    @property
    def source(self) -> ModelSource:
        """``model``, parsed (``parse_model_source``: once per process)."""
        return parse_model_source(self.model)


class SourcesSpec(ModelChoice, CaptureChoices):
    """What `datagen env-check` and `datagen download` need to know about a run.

    Crosses the container boundary as JSON (``--spec SPEC``). The model, its cache, the layers and the
    engine are declared once (``ModelChoice``, ``CaptureChoices``), for this spec and the flow's pipeline
    spec, which writes this one from its own fields (``PipelineSpec.sources_spec``).
    """

    out: str = Field(description="Output dataset location: a local directory or s3://bucket/prefix.")
    expected_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens the extraction will store (rows x mean tokens per row); sizes the "
        "output estimate tokens x len(layer_ids) x hidden_size x bytes per value. None: the "
        "output size is not checked.",
    )

    @field_validator("out")
    @classmethod
    def _out_parses(cls, v: str) -> str:
        if is_s3_uri(v):
            parse_s3_uri(v)
        elif "://" in v:
            raise ValueError(f"output {v!r} has an unknown scheme: use a directory or s3://bucket/prefix")
        return v


def parse_sources_spec(raw: dict[str, Any], *, origin: str = "spec") -> SourcesSpec:
    """Validate a dict into a SourcesSpec; every problem becomes one SpecError."""
    try:
        return SourcesSpec.model_validate(raw)
    except ValidationError as e:
        raise spec_error(e, source=origin, hint="fix the fields named above (see docs/sources.md)") from None


def load_sources_spec(path: str | Path) -> SourcesSpec:
    """Read ``--spec SPEC``: a JSON object with SourcesSpec's fields."""
    return parse_sources_spec(read_spec_file(path, docs="docs/sources.md"), origin=str(path))
