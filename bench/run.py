"""``make bench``: every figure, then the table and the plots.

    python -m bench.run            # full: the numbers of docs/performance.md (under 20 min on 2 CPUs)
    python -m bench.run --smoke    # every code path, small sizes (a few minutes); not committed
    python -m bench.run --only overhead,memory

Each figure runs as a process of its own (``python -m bench.<module>``), so engines, worker
processes and memory do not carry over from one figure to the next; its log goes to
``.cache/bench/logs/<module>.log``. A figure that fails is reported and the others still run;
the exit status is non-zero when one failed (a missed target is a result, not a failure).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from bench._common import RESULTS, ROOT, SMOKE_RESULTS, WORK, Mode

# module -> the figures it writes
FIGURES = {"overhead": (1, 2), "cached_rerun": (3,), "validation": (4,), "publish": (5,), "memory": (6,),
           "reader": (7,), "planning": (8,), "train_proof": (9,)}
LOGS = WORK.parent / "logs"


def run_figure(module: str, mode: Mode, results: Path) -> tuple[float, str | None]:
    LOGS.mkdir(parents=True, exist_ok=True)
    log_path = LOGS / f"{module}.log"
    t = time.monotonic()
    with log_path.open("w") as logf:
        rc = subprocess.call([sys.executable, "-m", f"bench.{module}", "--mode", mode.value, "--results", str(results)],
                             cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    dt = time.monotonic() - t
    if rc != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        return dt, f"exit {rc}: {tail[0][:200]}; log {log_path.relative_to(ROOT)}"
    return dt, None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_const", const=Mode.SMOKE, default=Mode.FULL, dest="mode",
                    help="small sizes and 2 runs each: checks every code path in a few minutes")
    ap.add_argument("--only", help=f"comma-separated modules: {', '.join(FIGURES)}")
    ap.add_argument("--results", help="where the records, table and plots go (default: bench/results, "
                                      "or .cache/bench/results-smoke with --smoke)")
    args = ap.parse_args(argv)
    results = Path(args.results) if args.results else (RESULTS if args.mode is Mode.FULL else SMOKE_RESULTS)
    modules = args.only.split(",") if args.only else list(FIGURES)
    unknown = [m for m in modules if m not in FIGURES]
    if unknown:
        ap.error(f"unknown figure modules {unknown}; choose from {', '.join(FIGURES)}")
    if not args.only:  # a whole run replaces the previous one; --only updates its figures in place
        for old in [*results.glob("*.json"), *results.glob("*.png"), results / "table.md"]:
            old.unlink(missing_ok=True)
    t0 = time.monotonic()
    failed = {}
    for module in modules:
        figs = ", ".join(str(f) for f in FIGURES[module])
        print(f"bench: figure {figs} ({module}) ...", flush=True)
        dt, error = run_figure(module, args.mode, results)
        print(f"bench: figure {figs} ({module}) {'done' if error is None else 'FAILED'} in {dt:.0f} s"
              + (f": {error}" if error else ""), flush=True)
        if error:
            failed[module] = error
    from bench.report import build

    print()
    print(build(results, failed=failed), end="")
    print(f"\nbench: {args.mode.value} run in {time.monotonic() - t0:.0f} s; records, table.md and plots in "
          f"{results.relative_to(ROOT) if results.is_relative_to(ROOT) else results}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
