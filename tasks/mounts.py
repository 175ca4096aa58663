"""The host paths a step's container sees (``tasks.runners.Mount``): ``mounts_for`` the paths a step
reads and writes, and ``dataset_path``, what of a dataset's name is a path to mount."""

from __future__ import annotations

from pathlib import Path

from tasks.runners import Mount


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
