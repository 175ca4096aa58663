"""Files a task hands a step program: its spec as a JSON file (``spec_file``), and a directory of the
task's own for what the step writes (``scratch_dir``); both removed afterwards."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    """A directory of this task's own for files a step reads or writes, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="datagen-step-") as d:
        yield Path(d)


@contextlib.contextmanager
def spec_file(content: dict[str, Any] | BaseModel, *, name: str = "spec.json") -> Iterator[Path]:
    """A JSON file holding ``content``, in a directory of its own, removed afterwards."""
    data = content.model_dump(mode="json") if isinstance(content, BaseModel) else content
    with tempfile.TemporaryDirectory(prefix="datagen-step-") as d:
        path = Path(d) / name
        path.write_text(json.dumps(data, indent=1, sort_keys=True))
        yield path
