"""An image's bytes: read from a local path, a ``file://`` URL or a remote store (``s3://``, through
the reader the storage layer registers), kept by sha256 for the engine, and decoded with PIL.

An image that cannot be used raises ``MediaProblem`` (``media_missing``, ``media_unreadable``):
its row is skipped with that reason.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from datagen.data.media import MISSING, UNREADABLE, MediaProblem
from datagen.errors import DatasetError


def media_cache_dir() -> Path:
    """Where images read from S3 are kept for the engine (by sha256): DATAGEN_MEDIA_CACHE, else
    ``~/.cache/datagen/media``."""
    return Path(os.environ.get("DATAGEN_MEDIA_CACHE") or Path.home() / ".cache" / "datagen" / "media")


# Readers of images in remote stores, by URL scheme: url -> bytes, raising StorageError. The
# storage layer registers them (``datagen.storage.s3`` registers s3://): it sits above this floor,
# so this module never imports it (docs/architecture.md).
_REMOTE_READERS: dict = {}


def register_remote_reader(scheme: str, read_url) -> None:
    """Let image urls of ``scheme`` be read by ``read_url(url) -> bytes`` (raises StorageError)."""
    _REMOTE_READERS[scheme.lower()] = read_url


def resolve(url: str, base: Path) -> Path | str:
    """A local path for a local or file:// url (relative to ``base``), or the url of a remote store."""
    parsed = urlparse(url)
    if parsed.scheme.lower() == "s3":
        return url
    if parsed.scheme.lower() == "file":
        return Path(unquote(parsed.path))
    p = Path(url).expanduser()
    return p if p.is_absolute() else base / p


def read(url: str, base: Path) -> tuple[bytes, str]:
    """The image's bytes and the local file the engine reads. Raises MediaProblem(media_missing)."""
    where = resolve(url, base)
    if isinstance(where, Path):
        try:
            return where.read_bytes(), str(where.resolve())
        except OSError as e:
            raise MediaProblem(MISSING, f"image {url!r}: {e.strerror or e} ({where})") from None
    from datagen.errors import StorageError

    scheme = urlparse(where).scheme.lower()
    if scheme not in _REMOTE_READERS:
        raise RuntimeError(f"no reader for {scheme}:// images is registered: import datagen.storage.s3 first")
    try:
        data = _REMOTE_READERS[scheme](where)
    except StorageError as e:
        raise MediaProblem(MISSING, f"image {url!r}: {e}") from None
    digest = hashlib.sha256(data).hexdigest()
    local = media_cache_dir() / digest[:2] / f"{digest}{Path(urlparse(where).path).suffix}"
    if not local.exists():
        from datagen.data.files import atomic_write_bytes

        local.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(local, data)
    return data, str(local)


def decode(data: bytes, url: str):
    """The image as RGB (PIL). Raises MediaProblem(media_unreadable)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise MediaProblem(UNREADABLE, f"image {url!r} cannot be decoded: {e}") from None


def load_image(path: str, sha256: str):
    """The image the engine hands vLLM, checked to be the one planned (its bytes' sha256)."""
    data = Path(path).read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise DatasetError(f"the image changed since the plan (sha256 {got[:12]}, planned {sha256[:12]})", path=path,
                           hint="run the extraction again: the changed rows are planned and extracted anew")
    return decode(data, path)
