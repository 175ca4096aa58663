"""``datagen regenerate`` slowed down: a pause after each chunk it writes, a window for the resume
test to kill a run between chunks (the product has no such switch).

    python -m tests.support.slow_regenerate SECONDS <datagen arguments...>
"""

from __future__ import annotations

import functools
import sys
import time


def slow_regenerate_cmd(seconds: float, *args: str) -> list[str]:
    """The command line of ``datagen ARGS`` pausing ``seconds`` after each chunk (run from the repository)."""
    return [sys.executable, "-m", "tests.support.slow_regenerate", str(seconds), *args]


def main(argv: list[str]) -> int:
    seconds, *args = argv
    from datagen.regeneration.output import OutputDir

    write_chunk = OutputDir.write_chunk

    @functools.wraps(write_chunk)
    def write_then_pause(self, rec):
        write_chunk(self, rec)
        time.sleep(float(seconds))

    OutputDir.write_chunk = write_then_pause
    from datagen.cli import main as datagen_main

    return datagen_main(args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
