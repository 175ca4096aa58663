"""Figure 3: wall time of a fully cached re-run of the ``tiny`` flow.

    python -m bench.cached_rerun --mode smoke|full [--results DIR]

Runs what ``make demo`` runs (``python -m flows.extract --deployment tiny`` in Prefect's
ephemeral mode, ``flows.demo.ephemeral_env``), but in a project root of its own under the
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
    from flows import demo

    root = work_dir("flow-root")
    shutil.copy(ROOT / "prefect.yaml", root / "prefect.yaml")
    demo.prepare(root)
    return root


def run_flow(root: Path) -> tuple[float, dict, list[tuple[float, str]]]:
    """One ``python -m flows.extract --deployment tiny``: (wall seconds, summary, output lines
    with the seconds since start at which each arrived)."""
    from flows import demo

    t = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "flows.extract", "--deployment", demo.DEPLOYMENT], cwd=root,
                            env=demo.ephemeral_env(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [(time.monotonic() - t, line.rstrip()) for line in proc.stdout]
    rc = proc.wait()
    dt = time.monotonic() - t
    summary = None
    for _, line in lines:
        if line.startswith(demo.RESULT_LINE_PREFIX):
            summary = json.loads(line[len(demo.RESULT_LINE_PREFIX):])
    if rc != 0 or summary is None:
        tail = "\n".join(line for _, line in lines[-60:])
        raise RuntimeError(f"the tiny flow failed (exit {rc}):\n{tail}")
    return dt, summary, lines


# Where the time of a cached re-run goes: the first output line matching each marker.
PHASES = {
    "prefect_temporary_server_starting": "Starting temporary server",
    "flow_run_begins": "Beginning flow run",
    "download_step_done": "Task run 'download-",
    "plan_step_done": "Task run 'plan-",
    "env_check_step_done": "Task run 'env-check-",
    "cached_ranges_done": "Task run 'extract-range-",
    "flow_run_done": "Flow run '",
}


def phases(lines: list[tuple[float, str]]) -> dict[str, float]:
    out = {}
    for name, marker in PHASES.items():
        hits = [t for t, line in lines if marker in line and ("Finished in state" in line or "Task run" not in marker)]
        if name == "flow_run_done":
            hits = [t for t, line in lines if marker in line and "Finished in state" in line]
        if hits:
            out[name] = round(hits[0], 2)
    return out


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
    first_s, first, lines = run_flow(root)
    log.info("first run: %.1fs, %d of %d ranges cached", first_s, first["ranges_cached"], first["ranges"])
    reruns, timelines = [], []
    for i in range(RERUNS[mode]):
        dt, s, lines = run_flow(root)
        if s["ranges_cached"] != s["ranges"] or s["shards_extracted"]:
            raise RuntimeError(f"re-run {i + 1} was not fully cached: {s['ranges_cached']}/{s['ranges']} ranges, "
                               f"shards extracted {s['shards_extracted']}")
        reruns.append(dt)
        timelines.append(phases(lines))
        log.info("cached re-run %d: %.1fs", i + 1, dt)
    imports = [import_time(root) for _ in range(2)]
    med = median(reruns)
    when = {k: median([p[k] for p in timelines if k in p]) for k in PHASES if any(k in p for p in timelines)}
    rec.rows.append(Row("python -m flows.extract --deployment tiny, everything cached", round(med, 1), "s",
                        f"< {TARGET_S:g}", med < TARGET_S,
                        f"runs {', '.join(f'{x:.1f}' for x in reruns)} s; `import flows.extract` alone "
                        f"{median(imports):.1f} s; first run {first_s:.1f} s "
                        f"({first['ranges_cached']}/{first['ranges']} ranges cached); median seconds since start: "
                        + ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in when.items())))
    rec.data = {"first_run_s": first_s, "first_run_ranges_cached": first["ranges_cached"], "ranges": first["ranges"],
                "reruns_s": reruns, "import_s": imports, "totals": first["totals"], "phases_median_s": when,
                "phases_s": timelines, "last_rerun_log": [f"{t:6.2f} {_strip_paths(line, root)[:200]}" for t, line in lines]}
    rec.write(Path(args.results) if args.results else (RESULTS if mode is Mode.FULL else SMOKE_RESULTS))
    return 0


def _strip_paths(text: str, root: Path) -> str:
    return text.replace(str(root), "<root>").replace(str(ROOT), "<project>")


if __name__ == "__main__":
    raise SystemExit(main())
