"""What a refused input must look like, checked the same way for every step.

A refusal: the `datagen` command exits with the error's code (2 for bad input, 4 for a dataset
that fails validation), prints ``error: <what is wrong>`` and a ``  -> <what to do>`` line, shows no
traceback, and leaves nothing behind where it would have written.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import traceback
from dataclasses import dataclass
from pathlib import Path

from datagen.cli import main as datagen_main

LINE_RE = re.compile(r":(\d+): ")


@dataclass(frozen=True)
class Outcome:
    code: int
    err: str  # stderr: the error and its hint
    out: str  # stdout: the result line when it succeeded

    @property
    def hinted(self) -> bool:
        return "\n  -> " in self.err

    @property
    def line(self) -> int | None:
        """The line number an error names as ``path:LINE:``, if any."""
        m = LINE_RE.search(self.err)
        return int(m.group(1)) if m else None


def run_cli(*argv: str | Path) -> Outcome:
    """``datagen ARGV`` in this process, with its stdout and stderr captured.

    In-process so that hundreds of generated inputs take seconds; the steps that start vLLM are
    never reached by a refused input (they refuse before any engine starts).
    """
    err, out = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handler = logging.StreamHandler(err)
    root.addHandler(handler)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = datagen_main([str(a) for a in argv])
            except SystemExit as e:  # argparse
                code = e.code if isinstance(e.code, int) else 2
            except Exception:  # what the user would see: a traceback and exit 1
                traceback.print_exc(file=err)
                code = 1
    finally:
        root.removeHandler(handler)
    return Outcome(code, err.getvalue(), out.getvalue())


def assert_refused(o: Outcome, *, code: int, message: str | None = None) -> None:
    """A clear refusal: the exit code, the message, a `->` hint, no traceback."""
    assert o.code == code, f"exit {o.code}, expected {code}:\n{o.err[-3000:]}"
    assert "Traceback" not in o.err, o.err[-3000:]
    assert o.err.count("error: ") >= 1, o.err[-3000:]
    assert o.hinted, f"the error must say what to do (a '  -> ' line):\n{o.err[-2000:]}"
    if message is not None:
        assert message in o.err, f"{message!r} not in:\n{o.err[-2000:]}"


def tree(path: Path) -> list[str]:
    """Every path under ``path`` (relative), to compare before and after a refusal."""
    return sorted(str(p.relative_to(path)) for p in Path(path).rglob("*")) if Path(path).exists() else []
