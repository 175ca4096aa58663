"""What a task's cache key is made of: ``cache_key`` (a kind and the canonical JSON of its parts,
hashed) and ``runner_identity`` (the code that runs a step, one of those parts). Each task module's
``*_cache_key`` says which parts its key holds (docs/orchestration.md)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tasks.pipeline_spec import Runner
from tasks.runner_choice import extract_image


def runner_identity(kind: Runner, *, gpu: bool = False) -> str:
    """What besides the spec decides a step's output: the code that runs it.

    docker: the extract image's tag (it hashes everything that goes into the image).
    local: the datagen package's version. The engine's name, version and patches are in every
    shard key already; the local tree's other edits do not invalidate the cache (bump the
    version to force re-extraction).
    """
    if kind is Runner.DOCKER:
        from images.tags import plan_image

        return "docker:" + plan_image(extract_image(gpu)).tag
    return f"local:datagen-{_package_version()}"


def _package_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("datagen")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def cache_key(kind: str, *parts: Any) -> str:
    """A cache key: ``<kind>-<sha256 of the parts as canonical JSON>`` (a valid file name)."""
    payload = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return f"{kind}-{hashlib.sha256(payload.encode()).hexdigest()}"
