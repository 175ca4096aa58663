"""Figure 3: wall time of a fully cached re-run of the ``tiny`` flow.

    python -m bench.cached_rerun --mode smoke|full [--results DIR]

Runs what ``make demo`` runs (``python -m flows.extract --deployment tiny`` in Prefect's
ephemeral mode, ``datagen.demo.ephemeral_env``), but in a project root of its own under the
bench's work directory (its own model, dataset, output and Prefect home), so that a demo or a
test running at the same time is neither disturbed nor a disturbance. The first run fills the
cache (or finds it filled by an earlier bench); every timed re-run must then report every range
served from the cache and no shard extracted, or the figure fails.

The time is the whole command, as a user waits for it: interpreter start, imports, Prefect's
ephemeral API server, the env check, the download check, the plan and the cached tasks. The
import time of ``flows.extract`` alone is measured too, to say what bounds it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench._common import RESULTS, ROOT, SMOKE_RESULTS, Mode, Record, Row, log, median, setup_logging, work_dir

TARGET_S = 30.0
RERUNS = {Mode.FULL: 3, Mode.SMOKE: 1}


def _root() -> Path:
    """A project root for the flow: prefect.yaml (copied), the tiny model and dataset."""
    from datagen import demo

    root = work_dir("flow-root")
    shutil.copy(ROOT / "prefect.yaml", root / "prefect.yaml")
    demo.prepare(root)
    return root


def run_flow(root: Path) -> tuple[float, dict, str]:
    """One ``python -m flows.extract --deployment tiny``: (wall seconds, summary, output)."""
    from datagen import demo

    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "flows.extract", "--deployment", demo.DEPLOYMENT], cwd=root,
                          env=demo.ephemeral_env(root), capture_output=True, text=True)
    dt = time.monotonic() - t
    output = proc.stdout + proc.stderr
    summary = None
    for line in proc.stdout.splitlines():
        if line.startswith(demo.RESULT_LINE_PREFIX):
            summary = json.loads(line[len(demo.RESULT_LINE_PREFIX):])
    if proc.returncode != 0 or summary is None:
        raise RuntimeError(f"the tiny flow failed (exit {proc.returncode}):\n{output[-4000:]}")
    return dt, summary, output


def import_time(root: Path) -> float:
    t = time.monotonic()
    subprocess.run([sys.executable, "-c", "import flows.extract"], cwd=root, check=True, capture_output=True)
    return time.monotonic() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cached_rerun", description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.SMOKE.value)
    ap.add_argument("--results", help="directory of the JSON records")
    args = ap.parse_args(argv)
    setup_logging()
    mode = Mode(args.mode)
    rec = Record(3, "cached_rerun", "Fully cached re-run of the tiny flow (wall time)", mode)
    root = _root()
    first_s, first, _ = run_flow(root)
    log.info("first run: %.1fs, %d of %d ranges cached", first_s, first["ranges_cached"], first["ranges"])
    reruns, logs = [], []
    for i in range(RERUNS[mode]):
        dt, s, output = run_flow(root)
        if s["ranges_cached"] != s["ranges"] or s["shards_extracted"]:
            raise RuntimeError(f"re-run {i + 1} was not fully cached: {s['ranges_cached']}/{s['ranges']} ranges, "
                               f"shards extracted {s['shards_extracted']}")
        reruns.append(dt)
        logs.append(output)
        log.info("cached re-run %d: %.1fs", i + 1, dt)
    imports = [import_time(root) for _ in range(2)]
    med = median(reruns)
    rec.rows.append(Row("python -m flows.extract --deployment tiny, everything cached", round(med, 1), "s",
                        f"< {TARGET_S:g}", med < TARGET_S,
                        f"runs {', '.join(f'{x:.1f}' for x in reruns)} s; `import flows.extract` alone "
                        f"{median(imports):.1f} s; first run {first_s:.1f} s "
                        f"({first['ranges_cached']}/{first['ranges']} ranges cached)"))
    rec.data = {"first_run_s": first_s, "first_run_ranges_cached": first["ranges_cached"], "ranges": first["ranges"],
                "reruns_s": reruns, "import_s": imports, "totals": first["totals"],
                "last_rerun_log_tail": _strip_paths(logs[-1][-3000:], root)}
    rec.write(Path(args.results) if args.results else (RESULTS if mode is Mode.FULL else SMOKE_RESULTS))
    return 0


def _strip_paths(text: str, root: Path) -> str:
    return text.replace(str(root), "<root>").replace(str(ROOT), "<project>")


if __name__ == "__main__":
    raise SystemExit(main())
