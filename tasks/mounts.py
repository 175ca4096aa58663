"""The host paths a step's container sees (``tasks.runners.Mount``): ``mounts_for`` the paths a step
reads and writes, ``dataset_path``, what of a dataset's name is a path to mount, and
``extract_mounts``, what every step of an extraction spec mounts (plan, extract, assemble)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tasks.media import media_sources
from tasks.runners import Mount

if TYPE_CHECKING:
    from datagen.specs.extraction import ExtractSpec


def dataset_path(dataset: str | Path) -> Path:
    """Where the rows of ``dataset`` lie, to mount: its name without the options after ``#``
    (``datagen.data.dataset_files.parse_ref``). The step is passed the whole name, options and all."""
    from datagen.data.dataset_files import parse_ref

    return parse_ref(dataset).path


def mounts_for(*paths: str | Path, read_only: tuple[str | Path, ...] = ()) -> tuple[Mount, ...]:
    """Mounts of the given host paths (read-write) and ``read_only`` paths, absolute, deduplicated."""
    seen: dict[str, Mount] = {}
    for p, ro in [(p, False) for p in paths] + [(p, True) for p in read_only]:
        path = str(Path(p).absolute())
        if path not in seen:
            seen[path] = Mount(path=path, read_only=ro)
    return tuple(seen.values())


def extract_mounts(spec: ExtractSpec) -> tuple[Mount, ...]:
    """What a step of this extraction spec reads and writes: its output's parent, its model and
    rows (their path: the step gets the spec's dataset whole, ``#options`` and all), and the
    directories of the images its rows reference (``media_sources``)."""
    out = Path(spec.out).absolute()
    # extract's lock file lives next to the output directory, so the parent is mounted; on a first
    # run it may not exist yet (a bind mount needs its source): its nearest existing ancestor then.
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return mounts_for(parent, read_only=(spec.model, dataset_path(spec.dataset), *media_sources(spec.dataset).dirs))
