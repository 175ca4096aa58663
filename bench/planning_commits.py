"""Planning speed of an earlier commit and of this tree, on the same rows with Kimi's real tokenizer.

    python -m bench.planning_commits --before a3cbcf0^ [--mode smoke|full] [--workers N] [--results DIR]

``datagen.data.planning.prepare_dataset`` of each side plans one chat dataset
(``datagen.testmodels.tiny.make_chat_dataset``, 5,000 rows; smoke 600) with the slow and the fast Kimi
tokenizer over Moonshot's real files (``DATAGEN_REAL_KIMI``), both written once by ``bench.planning``.
The earlier commit is checked out as a detached git worktree under the work directory (removed at
the end); every run is a process of its own (the same interpreter, the tree first on its import
path), the two sides alternating and the order swapped each round, 3 plans per tokenizer in each
process. The machine is shared, so the rate is tokens per CPU second of the plan (this process and
its workers), medians over every plan of a side; the tokenizer is loaded before the clock starts.
Both sides must plan the same tokens and loss masks for every row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench._common import ROOT, Mode, Record, Row, log, median, setup_logging, work_dir

ROWS = {Mode.FULL: 5000, Mode.SMOKE: 600}
ROUNDS = {Mode.FULL: 4, Mode.SMOKE: 1}
TOKENIZERS = ("slow", "fast")


def _run_side(tree: Path, data: Path, work: Path, workers: int) -> list[dict]:
    # -P: the script's folder (bench/) stays off the import path; the tree alone provides datagen
    cmd = [sys.executable, "-P", str(Path(__file__).with_name("_planning_child.py")), str(data), str(work),
           str(workers)]
    done = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"planning in {tree} failed: {done.stderr.strip().splitlines()[-1:]}")
    runs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if not all(Path(r["datagen"]).resolve().is_relative_to(tree.resolve()) for r in runs):
        raise SystemExit(f"a run in {tree} imported another tree's datagen")
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.planning_commits", description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the earlier commit (any git revision)")
    ap.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.SMOKE.value)
    ap.add_argument("--workers", type=int, default=1, help="planning processes (default 1: this process)")
    ap.add_argument("--results", help="directory of the JSON record (default: none written)")
    args = ap.parse_args(argv)
    setup_logging()
    mode = Mode(args.mode)
    from bench.planning import _tokenizers
    from datagen.testmodels.tiny import make_chat_dataset

    work = work_dir("planning_commits")
    _tokenizers(work)  # writes work/kimi-slow and work/kimi-fast once
    data = make_chat_dataset(work / f"chat-{ROWS[mode]}.jsonl", rows=ROWS[mode], seed=0)
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{args.before}^{{commit}}"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    before = work / f"tree-{sha[:12]}"
    subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, capture_output=True)  # a stale one
    subprocess.run(["git", "worktree", "add", "--detach", str(before), sha], cwd=ROOT, check=True,
                   capture_output=True)
    runs: list[dict] = []
    try:
        for i in range(ROUNDS[mode]):
            sides = [("before", before), ("after", ROOT)]
            for side, tree in sides if i % 2 == 0 else sides[::-1]:
                runs += [r | {"side": side} for r in _run_side(tree, data, work, args.workers)]
            log.info("round %d of %d done", i + 1, ROUNDS[mode])
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, check=False)
    if len({(r["samples"], r["tokens"]) for r in runs}) != 1:
        raise SystemExit("the two commits planned different tokens or loss masks")
    tokens = runs[0]["tokens"]
    procs = f"{args.workers} process{'es' if args.workers > 1 else ''}"
    rec = Record(8, "planning_commits", f"Planning speed, {args.before} ({sha[:7]}) and this tree", mode)
    for name in TOKENIZERS:
        rate, bare = {}, {}
        for side in ("before", "after"):
            mine = [r for r in runs if r["side"] == side and r["tokenizer"] == name]
            rate[side] = median([tokens / r["cpu_s"] for r in mine])
            bare[side] = median([tokens / (r["cpu_s"] - r["fingerprint_cpu_s"]) for r in mine])
            rec.rows.append(Row(f"{side}, {name} tokenizer, {procs}", round(rate[side]),
                                "tok/CPU s", None, None, f"{len(mine)} plans of {tokens:,} tokens; without the "
                                f"tokenizer's fingerprint {bare[side]:,.0f} tok/CPU s"))
        ratio = rate["after"] / rate["before"]
        rec.rows.append(Row(f"after / before, {name} tokenizer", round(ratio, 3), "x", ">= 0.9", ratio >= 0.9,
                            f"without the fingerprint {bare['after'] / bare['before']:.3f}"))
    rec.data = {"before": sha, "rows": ROWS[mode], "tokens": tokens, "workers": args.workers,
                "runs": [{k: v for k, v in r.items() if k != "datagen"} for r in runs]}
    if args.results:
        rec.write(Path(args.results))
    for r in rec.rows:
        print(f"| {r.case} | {r.value:,} {r.unit} | {r.detail} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
