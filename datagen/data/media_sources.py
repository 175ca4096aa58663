"""Where a dataset's images are, for the step containers: the directories to mount read-only, and
whether a row reads from a remote store."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from datagen.data.media_fetch import resolve


@dataclass(frozen=True)
class MediaSources:
    """Where the images a dataset's rows reference live, as the step containers must see them.

    ``dirs``: local directories, absolute, none inside another (a step mounts each read-only):
    the dataset's own directory when a row references an image under it (a relative path, or
    an absolute one that lies there), else the image's directory; only directories that exist
    (a missing image's row is skipped by planning, with ``media_missing``). ``remote``: a row
    references an image in a remote store (``s3://``), so the steps need its settings.
    """

    dirs: tuple[str, ...] = ()
    remote: bool = False


def _under(p: str, d: str) -> bool:
    return p == d or p.startswith(d.rstrip(os.sep) + os.sep)


def sources(dataset: str | Path) -> MediaSources:
    """The ``MediaSources`` of a JSONL chat dataset: a scan that parses only the lines naming an
    ``image_url`` (a text-only dataset costs one read). Malformed rows are left to planning, which
    stops at them with the line. Memoized on the file's size and mtime. A dataset that is not a
    single file (a folder, a Hugging Face dataset) has none: image rows are read from JSONL files."""
    from datagen.data.dataset_files import parse_ref

    path = parse_ref(dataset).path
    try:
        st = os.stat(path)
    except OSError:
        return MediaSources()
    if not path.is_file():
        return MediaSources()
    return _sources(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _sources(dataset: str, size: int, mtime_ns: int) -> MediaSources:
    base = os.path.dirname(dataset)
    found: set[str] = set()
    remote = False
    with open(dataset, "rb") as f:
        for line in f:
            if b"image_url" not in line:
                continue
            try:
                obj = json.loads(line)
                urls = [p["image_url"]["url"] for m in obj["messages"] if isinstance(m.get("content"), list)
                        for p in m["content"] if isinstance(p, dict) and p.get("type") == "image_url"]
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            for url in urls:
                if not isinstance(url, str) or not url:
                    continue
                where = resolve(url, Path(base))
                if not isinstance(where, Path):
                    remote = True
                    continue
                path = os.path.normpath(str(where))
                real = os.path.realpath(path)  # a symlinked image: its target must be seen too
                for p in {path, real}:
                    # never the root: mounted over a container's own root it would hide its system
                    d = base if _under(p, base) and base != os.sep else os.path.dirname(p)
                    if d != os.sep and os.path.isdir(d):
                        found.add(d)
    dirs: list[str] = []
    for d in sorted(found, key=len):
        if not any(_under(d, kept) for kept in dirs):
            dirs.append(d)
    return MediaSources(tuple(sorted(dirs)), remote)
