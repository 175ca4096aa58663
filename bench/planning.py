"""Figure 8: planning chat rows with Kimi's real tokenizer -- tokens/s per core, before and after.

    python -m bench.planning --mode smoke|full [--results DIR]

Moonshot's real files (``DATAGEN_REAL_KIMI``, default ``shared/real-kimi`` beside the repository):
the real ``tiktoken.model`` and Kimi-K2-Instruct's ``tokenizer_config.json`` and chat template. Two
tokenizers over them: the project's slow tokenizer code (``tokenization_kimi.py``, as a model
directory ships it) and the fast ``tokenizer.json`` converted from the same ranks
(``datagen.models.kimi_tokenizer``, checked id for id against the slow one). One chat dataset
(``datagen.testmodels.tiny.make_chat_dataset``: 5,000 rows, a system prompt in 30%, 1-3 user/assistant
turns).

- before: the former code path (``tests/support/planning_reference``): one process, the file read and
  parsed whole, every prefix rendered one call at a time, the whole render tokenized a second time;
- after: ``datagen.data.planning.prepare_dataset`` with 1 process and with every core (the workers
  read, parse and identify their own byte ranges; the calling process hashes the file, cuts it at
  line ends and assembles).

Each case plans the whole dataset (read, hash, check, render, tokenize, mask), with the tokenizer
already loaded (loading it is counted on neither side); every "after" output is checked equal, byte
for byte, to the "before" output of the same tokenizer. The machine is shared, so the rates are read
from CPU time: tokens per CPU second of the calling process and its workers (medians of the runs),
without the once-per-plan part that does not grow with the rows (the tokenizer's fingerprint, a
serialization of it, measured apart; both sides compute it). The projection to n cores is Amdahl's
law on the per-token CPU of the calling process (serial) and of the workers (parallel), plus the
once-per-plan parts (the fingerprint, and starting n workers).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from bench._common import RESULTS, SMOKE_RESULTS, Mode, Record, Row, log, median, setup_logging, work_dir

ROWS = {Mode.FULL: 5000, Mode.SMOKE: 600}
REPEATS = {Mode.FULL: 3, Mode.SMOKE: 1}
VOCAB = 163840
TODAY_TOKENS_PER_S = 24_000  # the figure for today's code on this machine (one core)


def _tokenizers(work: Path):
    from transformers import AutoTokenizer

    from datagen import settings
    from datagen.models import kimi_tokenizer

    real = settings.real_kimi_dir()
    if not (real / "tiktoken.model").is_file():
        raise SystemExit(f"Moonshot's real Kimi tokenizer files are not at {real}: set DATAGEN_REAL_KIMI")
    slow = AutoTokenizer.from_pretrained(kimi_tokenizer.write_slow_tokenizer(real, work / "kimi-slow"),
                                         trust_remote_code=True)
    fast_dir = work / "kimi-fast"
    if not (fast_dir / "tokenizer.json").is_file():
        kimi_tokenizer.convert_and_check(real, fast_dir, slow=slow)
    return slow, AutoTokenizer.from_pretrained(fast_dir)


def _same(a, b) -> bool:
    import numpy as np

    return (a.fingerprint == b.fingerprint and a.line_hashes == b.line_hashes and a.skipped == b.skipped
            and a.truncated == b.truncated and a.tokenizer_hash == b.tokenizer_hash
            and a.chat_template_hash == b.chat_template_hash and sorted(a.samples) == sorted(b.samples)
            and all(np.array_equal(a.samples[r].input_ids, s.input_ids)
                    and np.array_equal(a.samples[r].loss_mask, s.loss_mask) for r, s in b.samples.items()))


def _cpu() -> tuple[float, float]:
    """CPU seconds of this process and of its finished child processes (the planning workers)."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def _fork_cpu_s(workers: int) -> float:
    """CPU seconds of this process to start ``workers`` planning processes (forked, as planning
    forks them, with the tokenizers loaded) and wait for them: a once-per-plan part that grows with
    the workers."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    c = _cpu()[0]
    procs = [ctx.Process(target=int) for _ in range(workers)]
    for q in procs:
        q.start()
    for q in procs:
        q.join()
    return _cpu()[0] - c


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.planning", description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.SMOKE.value)
    ap.add_argument("--results", help="directory of the JSON records")
    ap.add_argument("--rows", type=int, help=f"chat rows (default {ROWS[Mode.FULL]}, smoke {ROWS[Mode.SMOKE]})")
    ap.add_argument("--repeats", type=int, help=f"runs of each case (default {REPEATS[Mode.FULL]}, smoke 1)")
    args = ap.parse_args(argv)
    setup_logging()
    mode = Mode(args.mode)
    from datagen.data.dataset import tokenizer_hashes
    from datagen.data.planning import default_workers, prepare_dataset
    from datagen.testmodels.tiny import make_chat_dataset
    from tests.support.planning_reference import reference_prepare_dataset

    rec = Record(8, "planning", "Planning chat rows with Kimi's real tokenizer (K2-Instruct template)", mode)
    work = work_dir("planning")
    slow, fast = _tokenizers(work)
    rows = args.rows or ROWS[mode]
    data = make_chat_dataset(work / f"chat-{rows}.jsonl", rows=rows, seed=0)
    cores = default_workers()
    load_before = os.getloadavg()
    # 1 process, every core, and the powers of two between (the scaling the projection reads)
    counts = sorted({1, cores, *(2 ** k for k in range(1, 8) if 2 ** k < cores)})
    kw = dict(vocab_size=VOCAB, max_seq_len=8192)
    cases = {}
    for name, tok in (("slow", slow), ("fast", fast)):
        load = (lambda t: (lambda: t))(tok)
        cases[f"before, {name} tokenizer, 1 process"] = (name, 1, lambda load=load: reference_prepare_dataset(
            data, load_tokenizer=load, **kw))
        for w in counts if name == "fast" else sorted({1, cores}):
            cases[f"after, {name} tokenizer, {w} process{'es' if w > 1 else ''}"] = (
                name, w, lambda load=load, w=w: prepare_dataset(data, load_tokenizer=load, workers=w, **kw))
    runs: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}  # (this process, its workers) CPU s
    fixed_runs: dict[str, list[float]] = {"slow": [], "fast": []}
    fork_runs: list[float] = []
    outputs, tokens = {}, None
    from datagen.data import planning

    hashes_at = planning._hashes
    in_situ: list[float] = []  # CPU s of the tokenizer's fingerprint within the last plan (its own thread)

    def timed_hashes(tokenizer):
        t = time.thread_time()
        try:
            return hashes_at(tokenizer)
        finally:
            in_situ.append(time.thread_time() - t)

    planning._hashes = timed_hashes
    hashes_cpu: dict[str, list[float]] = {k: [] for k in cases}
    for i in range(args.repeats or REPEATS[mode]):
        for case, (name, _, fn) in cases.items():
            in_situ.clear()
            t, c = time.perf_counter(), _cpu()
            out = fn()
            runs[case].append(time.perf_counter() - t)
            cpu[case].append(tuple(b - a for a, b in zip(c, _cpu())))
            hashes_cpu[case].append(sum(in_situ))
            tokens = out.tokens
            if case.startswith("before"):
                outputs[name] = out
            elif not _same(out, outputs[name]):
                raise SystemExit(f"{case}: the plan differs from the former code path's")
        for name, tok in (("slow", slow), ("fast", fast)):  # once per plan, whatever the rows
            c = _cpu()[0]
            tokenizer_hashes(tok)
            fixed_runs[name].append(_cpu()[0] - c)
        fork_runs.append(_fork_cpu_s(cores) / cores)
        log.info("round %d: %s", i + 1, {k: round(v[-1], 2) for k, v in runs.items()})
    load_after = os.getloadavg()
    planning._hashes = hashes_at
    fixed = {k: median(v) for k, v in fixed_runs.items()}
    fork = median(fork_runs)  # CPU s here per worker started
    wall = {k: tokens / median(v) for k, v in runs.items()}
    serial = {k: median([a for a, _ in v]) for k, v in cpu.items()}
    parallel = {k: median([b for _, b in v]) for k, v in cpu.items()}
    # per token: what this process did (less the once-per-plan parts) and what the workers did
    starts = {k: (w if w > 1 else 0) for k, (_, w, _) in cases.items()}
    # the fingerprint as it ran within the plan (the former code: measured apart, it runs alone there)
    own = {k: median(hashes_cpu[k]) if k.startswith("after") else fixed[cases[k][0]] for k in cases}
    here = {k: max(serial[k] - own[k] - starts[k] * fork, 0.0) / tokens for k in cases}
    there = {k: parallel[k] / tokens for k in cases}
    per_core = {k: 1 / (here[k] + there[k]) for k in cases}

    base = per_core["before, slow tokenizer, 1 process"]
    for case, (name, w, _) in cases.items():
        rec.rows.append(Row(case, round(per_core[case]), "tok/s per core", None, None,
                            f"{per_core[case] / base:.1f}x before (slow); per token {here[case] * 1e6:.2f} us here + "
                            f"{there[case] * 1e6:.2f} us in workers (CPU); wall {median(runs[case]):.2f} s for "
                            f"{tokens:,} tokens ({wall[case]:,.0f} tok/s on the shared machine)"))
    billion = 1e9
    curves = {}
    for name in ("slow", "fast"):
        best = f"after, {name} tokenizer, {cores} process{'es' if cores > 1 else ''}"

        def on(n: int, total: float, best=best, name=name) -> float:  # tokens/s for ``total`` tokens, n idle cores
            return total / (fixed[name] + n * fork + total * (here[best] + there[best] / n))

        two = 1 / (here[best] + there[best] / 2)
        rec.rows.append(Row(f"2 cores, {name} tokenizer, vs before (slow tokenizer, 1 core), per token",
                            round(two / base, 1), "x", ">= 10", two / base >= 10,
                            f"{two:,.0f} vs {base:,.0f} tok/s (CPU time of {best}); with this dataset's "
                            f"once-per-plan parts ({fixed[name]:.2f} s fingerprint, {fork * 1e3:.0f} ms per worker "
                            f"started) {on(2, tokens):,.0f} tok/s; wall on the shared machine {wall[best]:,.0f} tok/s"))
        projected = on(64, billion)
        rec.rows.append(Row(f"64-core host, 1B tokens, {name} tokenizer, projected from CPU time (Amdahl)",
                            round(projected), "tok/s", ">= 1,000,000", projected >= 1e6,
                            f"per token {here[best] * 1e6:.3f} us serial (hash and cut the file, assemble) + "
                            f"{there[best] * 1e6:.2f} us in workers (read, parse, identify, check, render, "
                            f"tokenize); once per plan {fixed[name]:.2f} s + 64 x {fork * 1e3:.0f} ms; the serial "
                            f"part alone bounds it at {1 / here[best] if here[best] else float('inf'):,.0f} tok/s; "
                            f"1B tokens in {billion / projected / 60:.1f} min"))
        curves[name] = {n: on(n, billion) for n in (1, 2, 4, 8, 16, 32, 64, 128)}
    rec.data = {"rows": rows, "tokens": tokens, "cores": cores, "runs_s": runs, "cpu_s": cpu, "per_core": per_core,
                "per_token_here_s": here, "per_token_workers_s": there, "wall_rate": wall,
                "today_reported_tok_s": TODAY_TOKENS_PER_S, "dataset_bytes": os.path.getsize(data),
                "load_average_before": load_before, "load_average_after": load_after, "fixed_cpu_s": fixed,
                "fork_cpu_s_per_worker": fork, "projected_1b_tok_s": curves,
                "measured_processes": {name: {str(w): per_core[f"after, {name} tokenizer, {w} process{'es' if w > 1 else ''}"]
                                              for w in (counts if name == "fast" else sorted({1, cores}))}
                                       for name in ("slow", "fast")}}
    rec.notes.append("tokens/s per core = 1 / (per-token CPU of this process + of its workers), medians, without the "
                     "once-per-plan tokenizer fingerprint and worker starts (measured apart); n cores = tokens / "
                     "(fingerprint + n x worker start + tokens x (serial + parallel / n)); the tokenizer is loaded "
                     "before the clock starts; every 'after' plan equals the 'before' plan of its tokenizer byte for "
                     f"byte; load average (1, 5, 15 min) {load_before} before, {load_after} after on {cores} cores")
    path = rec.write(Path(args.results) if args.results else (RESULTS if mode is Mode.FULL else SMOKE_RESULTS))
    plot(rec.__dict__ | {"rows": [r.__dict__ for r in rec.rows]}, path.parent)
    for r in rec.rows:
        print(f"| {r.case} | {r.value:,} {r.unit} | {r.detail} |")
    return 0


def plot(rec: dict, out: Path) -> None:
    """fig8_planning.png: tokens/s per core of each case, and the projection to n cores."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rec["rows"] if r["unit"] == "tok/s per core"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    colors = ["gray" if r["case"].startswith("before") else "C0" if "slow" in r["case"] else "C1" for r in rows]
    ax.barh([r["case"] for r in rows], [r["value"] for r in rows], color=colors)
    for j, r in enumerate(rows):
        ax.text(r["value"], j, f" {r['value']:,.0f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s per core (CPU time, median; gray: the former code path)")
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title(rec["title"], fontsize=10)
    data = rec.get("data") or {}
    curves = data.get("projected_1b_tok_s") or {}
    for name, color in (("slow", "C0"), ("fast", "C1")):
        curve = {int(k): v for k, v in (curves.get(name) or {}).items()}
        if not curve:
            continue
        n = sorted(curve)
        bx.plot(n, [curve[k] for k in n], "o-", color=color, label=f"after, {name} tokenizer: projected (1B tokens)")
        measured = {int(k): v * int(k) for k, v in ((data.get("measured_processes") or {}).get(name) or {}).items()}
        bx.plot(sorted(measured), [measured[k] for k in sorted(measured)], "s", color=color, mec="k", ms=7,
                label=f"{name}: measured here, per-core rate x processes")
    if curves:
        n = [1, 2, 4, 8, 16, 32, 64, 128]
        before = next((r["value"] for r in rows if r["case"].startswith("before, slow")), None)
        if before:
            bx.plot(n, [before * k for k in n], ":", color="gray", label="before x cores (ideal)")
        bx.axhline(1e6, color="C3", ls="--", lw=1, label="goal: 1M tok/s on 64 cores")
        bx.set_xscale("log", base=2)
        bx.set_yscale("log")
        bx.set_xlabel("cores")
        bx.set_ylabel("tokens/s")
        bx.set_title("scaling: Amdahl on the per-token CPU here and in the workers", fontsize=10)
        bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "fig8_planning.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
