"""Where a training process spends its time before its first step and after its last: `datagen train`
from the packed shards against speculators' own training script on `datagen export --format speculators`
(the export timed too), the same recipe (speculators' default: Muon and AdamW, both norms), on the CPU.

    python -m bench.train_startup                   # table + bench/results/train_startup.{json,md,png}
    python -m bench.train_startup --repeats 1 --out /tmp/ts

A verifier and a dataset of a small shape are made by ``bench.gpu.train`` (``make_verifier``,
``make_dataset``: the project's shard writer, random bf16 states). Each run is a process of its own
(``python -m bench.train_startup child``), so the interpreter's start and every import count. The child
times the calls that make up a run by wrapping them (``bench.train_spans.SPANS``: the recipe, the reader,
the hash of the shards, the draft, the loader, the trainer, the save, speculators' validation pass and
checkpoint) and records the time of each training step (speculators' ``speculators.metrics`` records, logged after each
optimizer step). The parent records when it started the process and when it ended. Phases are the
intervals between those marks; what no span covers is "other". Runs alternate between the two (datagen
first, then speculators), ``--repeats`` times; the table holds the medians.

On the CPU speculators' ``Trainer`` needs two shims that `datagen train` carries itself
(``datagen.training.draft``): the model is moved to "cpu", not to GPU 0, and
``torch.accelerator.synchronize`` (its step timer) does nothing. ``bench/gpu/train.py`` installs the same
spans in its training runs (``bench.train_spans.install``), so the GPU side by side records them too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# a shape large enough that loading, hashing and saving are not lost in the noise, small enough for the CPU
SHAPE = dict(hidden=512, layers=8, vocab=8192, heads=8, kv_heads=8, intermediate=1024,
             arch="LlamaForCausalLM", model_type="llama", layer_ids=(2, 4, 5, 8))
# imported before the clock's "imports" mark: what either entry imports on its way (lazily or not)
IMPORTS = ("datagen.cli", "datagen.steps.train", "datagen.training.draft", "datagen.reader.for_speculators",
           "speculators.train.cli", "speculators.train.trainer")
PIPELINES = ("datagen", "speculators")


# --- the child: one training run, its marks written as JSON ------------------------------------------

def child(entry: str, marks_path: Path, argv: list[str]) -> int:
    import importlib

    marks: list = [["started", time.time(), time.time()]]
    for m in IMPORTS:
        importlib.import_module(m)
    marks.append(["imports", marks[0][1], time.time()])
    from bench.train_spans import cpu_shims, install

    install(marks)
    rc = 0
    try:
        if entry == "speculators":
            from speculators.train.cli import main
            from speculators.train.config import TrainConfig

            cpu_shims()
            t = time.time()
            cfg = TrainConfig.resolve(argv)
            marks.append(["recipe", t, time.time()])
            main(cfg)
        else:
            from datagen.cli import main

            rc = main(argv)
    finally:
        marks.append(["returned", time.time(), time.time()])
        marks_path.write_text(json.dumps(marks))
    return rc


# --- the parent: the dataset, the runs, the phases --------------------------------------------------

def _run(entry: str, argv: list[str], work: Path, k: int) -> dict:
    marks_path = work / f"marks-{entry}-{k}.json"
    marks_path.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    spawned = time.time()
    p = subprocess.run([sys.executable, "-m", "bench.train_startup", "child", entry, str(marks_path), "--", *argv],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    ended = time.time()
    if p.returncode:
        raise SystemExit(f"{entry} run failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return phases(json.loads(marks_path.read_text()), spawned=spawned, ended=ended)


def phases(marks: list, *, spawned: float, ended: float) -> dict:
    """Seconds per phase before the first step, of the steps, and after the last step."""
    steps = sorted(m[1] for m in marks if m[0] == "step")
    profiles = [m[3] for m in marks if m[0] == "step" and len(m) > 3 and m[3]]
    first, last = steps[0], steps[-1]
    at = {m[0]: (m[1], m[2]) for m in marks if m[0] in ("started", "imports", "returned")}
    started, imports, returned = at["started"][0], at["imports"][1], at["returned"][0]
    before: dict = {"interpreter start": started - spawned, "imports": imports - started}
    after: dict = {}
    spans = _merged((m[1], m[2], m[0]) for m in marks if m[0] not in at and m[0] != "step")
    for s, e, name in spans:
        if e <= first:
            before[name] = before.get(name, 0.0) + (e - s)
        elif s >= last:
            after[name] = after.get(name, 0.0) + (e - s)
    # calls that ran at once (the shards' hash beside the draft's build) count once in "other"
    covered = {k: sum(e - s for s, e in _union((s, e) for s, e, _ in spans if where(s, e))) for k, where in
               (("before", lambda s, e: e <= first), ("after", lambda s, e: s >= last))}
    # the first step's own time: from the last span that ended before it (the trainer made) to its record
    made = max([e for s, e, _ in spans if e <= first] + [imports])
    before["first step (compile, first batch)"] = first - made
    before["other"] = (first - spawned) - (started - spawned) - (imports - started) \
        - covered["before"] - before["first step (compile, first batch)"]
    after["process exit"] = ended - returned
    after["other"] = (ended - last) - covered["after"] - after["process exit"]
    step_ms = {k: statistics.median(p[k] for p in profiles[1:] or profiles) for k in (profiles or [{}])[0]}
    return {"before_first_step": before, "to_first_step": first - spawned, "steps": len(steps), "step_ms": step_ms,
            "steps_s": last - first, "after_last_step": after, "after_last_s": ended - last, "wall_s": ended - spawned}


def _union(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _merged(spans) -> list[tuple[float, float, str]]:
    """Each phase's spans merged where they overlap (a call timed inside another of the same phase:
    speculators' build_draft_model inside datagen's build_draft)."""
    by: dict[str, list] = {}
    for s, e, name in spans:
        by.setdefault(name, []).append((s, e))
    return sorted((s, e, name) for name, iv in by.items() for s, e in _union(iv))


def run(work: Path, *, steps: int, repeats: int, tokens: int, total_seq_len: int) -> dict:
    from bench.gpu.train import _batches_per_epoch, cpu_flags, make_dataset, make_verifier

    verifier = make_verifier(work / "verifier", SHAPE, device="cpu")
    dataset = make_dataset(work / "dataset", verifier, SHAPE, tokens=tokens, per_shard=32, device="cpu",
                           lengths=(64, 512))
    epochs = max(1, -(-steps // max(1, _batches_per_epoch(dataset, total_seq_len))))
    layers = [str(x) for x in SHAPE["layer_ids"][:-1]]
    rec: dict = {"shape": SHAPE, "steps": steps, "total_seq_len": total_seq_len, "repeats": repeats,
                 "dataset": json.loads((dataset / "manifest.json").read_text())["totals"], "runs": {p: [] for p in PIPELINES},
                 "export_s": []}
    for k in range(repeats):
        draft = work / f"draft-{k}"
        subprocess.run(["rm", "-rf", str(draft)], check=True)
        rec["runs"]["datagen"].append(_run("datagen", [
            "train", str(dataset), "--out", str(draft), "--model", str(verifier), "--steps", str(steps),
            "--total-seq-len", str(total_seq_len), "--train-ratio", "0.75", "--mask-token-id", "0"], work, k))
        export = work / f"export-{k}"
        subprocess.run(["rm", "-rf", str(export), str(work / f"save-{k}")], check=True)
        t = time.time()
        subprocess.run([sys.executable, "-m", "datagen", "export", "--format", "speculators", str(dataset), str(export)],
                       cwd=ROOT, check=True, capture_output=True)
        rec["export_s"].append(time.time() - t)
        rec["runs"]["speculators"].append(_run("speculators", [
            "--verifier-name-or-path", str(verifier), "--data-path", str(export), "--save-path", str(work / f"save-{k}"),
            "--max-steps", str(steps), "--epochs", str(epochs), "--total-seq-len", str(total_seq_len),
            "--train-data-ratio", "0.75", "--num-workers", "0", "--logger", "", "--log-dir", str(work / "logs"),
            "--no-resume-from-checkpoint", "--mask-token-id", "0", *cpu_flags(), "--target-layer-ids", *layers], work, k))
        print(f"run {k}: datagen {rec['runs']['datagen'][-1]['wall_s']:.1f} s, export {rec['export_s'][-1]:.1f} s, "
              f"speculators {rec['runs']['speculators'][-1]['wall_s']:.1f} s", flush=True)
    return rec


def _median_phases(runs: list[dict], key: str) -> dict:
    names = list(dict.fromkeys(n for r in runs for n in r[key]))
    return {n: statistics.median(r[key].get(n, 0.0) for r in runs) for n in names}


def _s(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds:.2f}"


def table(rec: dict) -> str:
    m = {p: rec["runs"][p] for p in PIPELINES}
    med = lambda p, k: statistics.median(r[k] for r in m[p])  # noqa: E731
    export = statistics.median(rec["export_s"])
    lines = [f"CPU, hidden {rec['shape']['hidden']}, vocab {rec['shape']['vocab']}, {rec['dataset']['tokens']:,} tokens, "
             f"{rec['steps']} steps of {rec['total_seq_len']} tokens; medians of {rec['repeats']} runs (seconds)", "",
             "| | datagen train | speculators' script | + export |", "|---|---|---|---|"]
    for label, key in (("to the first step", "to_first_step"), ("the steps", "steps_s"),
                       ("after the last step", "after_last_s"), ("whole process", "wall_s")):
        extra = f"{med('speculators', key) + export:.1f}" if key in ("to_first_step", "wall_s") else ""
        lines.append(f"| {label} | {med('datagen', key):.1f} | {med('speculators', key):.1f} | {extra} |")
    lines.append(f"| `datagen export --format speculators` | | | {export:.1f} |")
    lines += ["", "| a step after the first (ms, speculators' profile) | datagen train | speculators' script |",
              "|---|---|---|"]
    for k in ("fetch_ms", "fwd_ms", "bwd_ms", "opt_ms", "step_ms"):
        a, b = (statistics.median(r["step_ms"].get(k, 0.0) for r in m[p]) for p in PIPELINES)
        lines.append(f"| {k.removesuffix('_ms')} | {a:.0f} | {b:.0f} |")
    for key, title in (("before_first_step", "before the first step"), ("after_last_step", "after the last step")):
        lines += ["", f"| {title} | datagen train | speculators' script |", "|---|---|---|"]
        a, b = _median_phases(m["datagen"], key), _median_phases(m["speculators"], key)
        for n in dict.fromkeys([*a, *b]):
            lines.append(f"| {n} | {_s(a.get(n))} | {_s(b.get(n))} |")
    return "\n".join(lines)


def plot(rec: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.6))
    rows = [("datagen train", "datagen", 0.0), ("speculators' script (after the export)", "speculators",
                                                 statistics.median(rec["export_s"]))]
    colors: dict = {}
    cmap = plt.get_cmap("tab20")
    for y, (label, p, offset) in enumerate(rows):
        runs = rec["runs"][p]
        x = 0.0
        if offset:
            ax.barh(y, offset, left=x, color="lightgray", edgecolor="white", label=None if y == 0 else "export")
            x += offset
        parts = [*_median_phases(runs, "before_first_step").items(),
                 ("steps", statistics.median(r["steps_s"] for r in runs)),
                 *_median_phases(runs, "after_last_step").items()]
        for name, s in parts:
            if name not in colors:
                colors[name] = cmap(len(colors) % 20)
            ax.barh(y, s, left=x, color=colors[name], edgecolor="white")
            if s > 0.04 * max(1.0, statistics.median(r["wall_s"] for r in runs)):
                ax.text(x + s / 2, y, name, ha="center", va="center", fontsize=7, rotation=90 if s < 2 else 0)
            x += s
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_xlabel("seconds from the process's start")
    ax.set_title(f"Before the first step and after the last: {rec['steps']} steps, CPU (medians of "
                 f"{rec['repeats']} runs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        _, _, entry, marks, *rest = sys.argv
        raise SystemExit(child(entry, Path(marks), rest[1:] if rest[:1] == ["--"] else rest))
    from bench._common import write_results  # the parent's only: the child's start is what it measures
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24_000)
    ap.add_argument("--total-seq-len", type=int, default=2048)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--work", default=str(ROOT / ".cache" / "bench" / "train_startup"))
    args = ap.parse_args()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    rec = run(work, steps=args.steps, repeats=args.repeats, tokens=args.tokens, total_seq_len=args.total_seq_len)
    write_results(out, "train_startup", rec, table(rec), plot)


if __name__ == "__main__":
    main()
