"""Model download from the Hugging Face Hub (``hf://org/name@revision``), verified file by file.

The revision is resolved to a commit sha first (``HfApi.resolve_revision``: the Hub when it can
be reached, else the cache's ``refs/``), and everything after that is pinned to the sha.
``snapshot_download`` fetches only the engine's files (``model_files.engine_file_patterns``) into
huggingface_hub's own cache under ``<model cache>/hub`` (it resumes interrupted files itself and
locks each blob). Then every file is checked against the tree listing the Hub published for
that commit: size, and the LFS sha256 (weights) or the git blob sha1 (small files). A file that
does not match is deleted (blob and link) and the download fails naming it; the next run fetches
it again.

With ``HF_HUB_OFFLINE=1`` the same code runs from the cache alone (how the tests run it: no
network here). The networked path (``repo_info``, the transfers) is huggingface_hub's own and is
not exercised by this project's tests.
"""

from __future__ import annotations

import errno
import logging
import re
from pathlib import Path

from datagen.data.checksums import ChecksumKind, Expected, matches
from datagen.errors import CannotRunHereError, ModelError, ModelNotFoundError, SpecError, StorageError
from datagen.storage.model_cache import ModelCache, VerifiedFile, VerifiedRecord, cache_key
from datagen.specs.source import HubSource
from datagen.storage.model_files import engine_file_patterns, file_set_name, needed_files

log = logging.getLogger(__name__)

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_SHA1_RE = re.compile(r"^[0-9a-f]{40}$")


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _translate_hub_error(e: Exception, source: HubSource) -> Exception:
    """A huggingface_hub error -> the datagen error that says what to do."""
    from huggingface_hub import errors as hf

    name = source.uri
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return CannotRunHereError(f"{name}: the model cache's disk is full", hint="free space or set DATAGEN_MODEL_CACHE to a larger disk")
    if isinstance(e, hf.RevisionNotFoundError):
        return SpecError(f"{name}: revision {source.revision!r} does not exist", hint="fix the revision in the spec")
    if isinstance(e, hf.GatedRepoError):
        return CannotRunHereError(
            f"{name} is gated and this machine's Hub token has no access",
            hint="accept the model's terms on the Hub with the account of HF_TOKEN, and set HF_TOKEN",
        )
    if isinstance(e, hf.RepositoryNotFoundError):
        return ModelNotFoundError(
            f"{name}: repository {source.repo_id} not found (or private)",
            hint="fix the repo id, or set HF_TOKEN to a token that can read it",
        )
    if isinstance(e, (hf.RevisionResolutionError, hf.LocalEntryNotFoundError, hf.IncompleteSnapshotError)):
        if _offline():
            return ModelNotFoundError(
                f"{name} is not (completely) in the model cache and HF_HUB_OFFLINE=1 forbids fetching it: {e}",
                hint="unset HF_HUB_OFFLINE, or fill the cache on a machine with Hub access",
            )
        return StorageError(f"{name}: the Hub could not be reached: {e}", hint="retry")
    if isinstance(e, hf.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            return CannotRunHereError(f"{name}: the Hub refused access ({status})", hint="set HF_TOKEN")
        return StorageError(f"{name}: Hub error {status}: {e}", hint="retry")
    return StorageError(f"{name}: download failed: {type(e).__name__}: {e}", hint="retry")


def resolve_revision(source: HubSource, cache: ModelCache) -> str:
    """The commit sha ``source.revision`` names (no network when it already is one)."""
    from huggingface_hub import HfApi
    from huggingface_hub import errors as hf

    if source.pinned:
        return source.revision
    try:
        return HfApi().resolve_revision(source.repo_id, revision=source.revision, cache_dir=cache.hub_dir).resolved
    except (hf.HfHubHTTPError, hf.RevisionResolutionError, OSError) as e:
        raise _translate_hub_error(e, source) from e


def _tree_sizes(source: HubSource, sha: str, cache: ModelCache) -> dict[str, int]:
    """path -> size from the tree listing the Hub published for ``sha`` (cached by
    snapshot_download); {} when no listing is cached."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return {f.path: f.size for f in get_cached_repo_tree(source.repo_id, revision=sha, cache_dir=cache.hub_dir)}
    except CachedRepoTreeNotFoundError:
        return {}


def _expected_from_blob(path: Path) -> Expected | None:
    """The cache names each blob by the ETag the Hub sent for it: the LFS sha256 for weights,
    the git blob sha1 for small files. The name comes from the Hub's metadata, not from the
    bytes received, so it is what the bytes must hash to."""
    name = path.resolve().name
    if _SHA256_RE.match(name):
        return Expected(ChecksumKind.SHA256, name, "the Hub's LFS sha256")
    if _SHA1_RE.match(name):
        return Expected(ChecksumKind.GIT_SHA1, name, "the Hub's git blob id")
    return None


def _discard(path: Path) -> None:
    """Delete a cached file: its blob and the snapshot's link to it."""
    blob = path.resolve()
    blob.unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def verify_snapshot(source: HubSource, sha: str, snapshot: Path, cache: ModelCache, *, trust_remote_code: bool) -> tuple[VerifiedFile, ...]:
    """Check every engine file of the snapshot; delete and name the first one that is wrong."""
    sizes = _tree_sizes(source, sha, cache)
    present = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
    wanted = needed_files(sorted(set(sizes) | set(present)), trust_remote_code=trust_remote_code)
    out = []
    for rel in wanted:
        path = snapshot / rel
        if not path.is_file():
            raise ModelNotFoundError(
                f"{source.uri}: {rel} is missing from the downloaded snapshot {sha[:12]}",
                hint="run the download again" + (" without HF_HUB_OFFLINE" if _offline() else ""),
            )
        check = _expected_from_blob(path)
        if check is None:
            raise ModelError(
                f"{source.uri}: {rel} is not a blob of the Hub cache (no checksum to verify it against)",
                hint=f"delete {snapshot} and download again",
            )
        size = sizes.get(rel)
        actual_size = path.stat().st_size
        ok, actual = (False, f"{actual_size} bytes") if size is not None and size != actual_size else matches(path, check)
        if not ok:
            _discard(path)
            raise ModelError(
                f"{source.uri}: {rel} is corrupt: {check.origin} is {check.value}"
                + (f" ({size} bytes)" if size is not None else "")
                + f", the downloaded file has {actual}; the bad file was deleted",
                hint="run the download again to fetch it anew",
            )
        out.append(VerifiedFile(path=rel, size=actual_size, checksum=f"{check.kind.value}:{check.value}"))
    if not any(f.path.endswith(".safetensors") for f in out):
        raise ModelNotFoundError(
            f"{source.uri}@{sha[:12]} has no safetensors weights", hint="use a repo that publishes safetensors"
        )
    return tuple(out)


def download_hub(source: HubSource, cache: ModelCache, *, trust_remote_code: bool, max_workers: int = 8) -> tuple[VerifiedRecord, bool]:
    """Fetch and verify ``source`` into the cache. Returns (record, whether it was already there)."""
    from huggingface_hub import errors as hf
    from huggingface_hub import snapshot_download

    sha = resolve_revision(source, cache)
    key = cache_key(f"hf://{source.repo_id}", sha, file_set_name(trust_remote_code=trust_remote_code))
    with cache.lock(key):
        record = cache.read_verified(key)
        if record is not None:
            log.info("%s@%s already in the cache: %s", source.repo_id, sha[:12], record.model_dir)
            return record, True
        log.info("downloading %s@%s into %s", source.repo_id, sha[:12], cache.hub_dir)
        try:
            snapshot = Path(
                snapshot_download(
                    source.repo_id,
                    revision=sha,
                    cache_dir=cache.hub_dir,
                    allow_patterns=list(engine_file_patterns(trust_remote_code=trust_remote_code)),
                    max_workers=max_workers,
                )
            )
        except (hf.HfHubHTTPError, hf.LocalEntryNotFoundError, hf.IncompleteSnapshotError, OSError) as e:
            raise _translate_hub_error(e, source) from e
        files = verify_snapshot(source, sha, snapshot, cache, trust_remote_code=trust_remote_code)
        record = VerifiedRecord(source=f"hf://{source.repo_id}", revision=sha, model_dir=str(snapshot), files=files)
        cache.write_verified(key, record)
        return record, False
