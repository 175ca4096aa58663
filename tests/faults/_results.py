"""Recording each fault case's outcome, for ``tests/faults/report.py`` and docs/reliability.md.

Every case writes one JSON file into the results directory (``out/faults`` under the project,
or ``$DATAGEN_FAULTS_RESULTS``)::

    {"case": "...", "category": "crash", "attempts": 20, "outcome": "...", "data_lost": "0 samples",
     "passed": true, "command": "...", "details": {...}}

A case records itself even when it fails (``passed: false``), so the table shows failures too.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS_ENV = "DATAGEN_FAULTS_RESULTS"
CATEGORIES = ("crash", "infrastructure", "bad-input", "hostile", "secrets")


def results_dir() -> Path:
    return Path(os.environ.get(RESULTS_ENV) or REPO / "out" / "faults")


@dataclass
class CaseRecord:
    """One row of the reliability table."""

    case: str  # what was done, in words
    category: str  # one of CATEGORIES
    command: str  # what reproduces it (a pytest node id under `make faults`)
    attempts: int = 0  # faults injected / inputs tried
    outcome: str = ""  # what happened, in words
    data_lost: str = "n/a"  # samples lost or corrupted; "0" where data was at stake
    passed: bool = False
    details: dict = field(default_factory=dict)

    def write(self) -> Path:
        assert self.category in CATEGORIES, self.category
        d = results_dir()
        d.mkdir(parents=True, exist_ok=True)
        slug = re.sub(r"[^a-z0-9]+", "-", f"{self.category} {self.case}".lower()).strip("-")[:120]
        path = d / f"{slug}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.__dict__, indent=1, sort_keys=True, default=str) + "\n")
        tmp.replace(path)
        return path
