"""Recording each fault case's outcome, for ``tests/faults/report.py`` and docs/reliability.md.

Every case writes one JSON file into the results directory (``out/faults/full`` for the full
campaign, ``out/faults/short`` for the short one, under the project or ``$DATAGEN_FAULTS_RESULTS``)::

    {"case": "...", "category": "crash", "attempts": 20, "outcome": "...", "data_lost": "0 samples",
     "passed": true, "command": "...", "details": {...}}

A case records itself even when it fails (``passed: false``), so the table shows failures too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS_ENV = "DATAGEN_FAULTS_RESULTS"
FULL_ENV = "DATAGEN_FAULTS_FULL"
CATEGORIES = ("crash", "infrastructure", "bad-input", "hostile", "secrets")


EXAMPLES_ENV = "DATAGEN_FAULTS_EXAMPLES_SCALE"


def examples_scale() -> int:
    """``DATAGEN_FAULTS_EXAMPLES_SCALE=10``: the generated-input cases draw 10 times their examples
    (a campaign that looks for what the default count misses); 1 by default."""
    value = os.environ.get(EXAMPLES_ENV, "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{EXAMPLES_ENV}={value!r}: give a whole number of times, 1 or more")
    return int(value)


SEED_ENV = "DATAGEN_FAULTS_SEED"


def faults_seed() -> int | None:
    """``DATAGEN_FAULTS_SEED=S``: another draw (the crash campaign's kill moments, the generated
    inputs' examples); None: the default draw (generated inputs derandomized)."""
    value = os.environ.get(SEED_ENV)
    return int(value) if value else None


def full_campaign() -> bool:
    """``make faults`` sets DATAGEN_FAULTS_FULL=1: the full campaign; otherwise the short one."""
    return os.environ.get(FULL_ENV, "0") == "1"


def results_dir(*, full: bool | None = None) -> Path:
    """Where the records go: ``out/faults/full`` (make faults) or ``out/faults/short`` (make test)."""
    base = Path(os.environ.get(RESULTS_ENV) or REPO / "out" / "faults")
    return base / ("full" if (full_campaign() if full is None else full) else "short")


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
        self.details.setdefault("campaign", "full" if full_campaign() else "short")
        if faults_seed() is not None:
            self.details.setdefault("seed", faults_seed())
        if examples_scale() != 1:
            self.details.setdefault("examples_scale", examples_scale())
        d = results_dir()
        d.mkdir(parents=True, exist_ok=True)
        # one file per test (node id): a test run again replaces its record
        slug = re.sub(r"[^a-z0-9]+", "-", f"{self.category} {self.command}".lower()).strip("-")
        path = d / f"{slug[:150]}-{hashlib.sha256(slug.encode()).hexdigest()[:8]}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.__dict__, indent=1, sort_keys=True, default=str) + "\n")
        tmp.replace(path)
        return path
