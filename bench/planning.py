"""Figure 8: planning chat rows with Kimi's real tokenizer -- tokens/s per core, before and after.

    python -m bench.planning --mode smoke|full [--results DIR]

Moonshot's real files (``DATAGEN_REAL_KIMI``, default ``shared/real-kimi`` beside the repository):
the real ``tiktoken.model`` and Kimi-K2-Instruct's ``tokenizer_config.json`` and chat template. Two
tokenizers over them: the project's slow tokenizer code (``tokenization_kimi.py``, as a model
directory ships it) and the fast ``tokenizer.json`` converted from the same ranks
(``datagen.models.kimi_tokenizer``, checked id for id against the slow one). One chat dataset
(``datagen.models.tiny.make_chat_dataset``: 5,000 rows, a system prompt in 30%, 1-3 user/assistant
turns).

- before: the former code path (``tests/support/planning_reference``): one process, every prefix
  rendered one call at a time, the whole render tokenized a second time;
- after: ``datagen.data.planning.prepare_dataset`` with 1 worker and with every core.

Each case plans the whole dataset (read, hash, check, render, tokenize, mask), with the tokenizer
already loaded (loading it is counted on neither side); every "after" output is checked equal, byte
for byte, to the "before" output of the same tokenizer. Medians of the runs; tokens/s per core is
the rate divided by the processes that planned.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.planning", description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.SMOKE.value)
    ap.add_argument("--results", help="directory of the JSON records")
    ap.add_argument("--rows", type=int, help=f"chat rows (default {ROWS[Mode.FULL]}, smoke {ROWS[Mode.SMOKE]})")
    ap.add_argument("--repeats", type=int, help=f"runs of each case (default {REPEATS[Mode.FULL]}, smoke 1)")
    args = ap.parse_args(argv)
    setup_logging()
    mode = Mode(args.mode)
    from datagen.data.planning import prepare_dataset
    from datagen.data.planning import default_workers
    from datagen.models.tiny import make_chat_dataset
    from tests.support.planning_reference import reference_prepare_dataset

    rec = Record(8, "planning", "Planning chat rows with Kimi's real tokenizer (K2-Instruct template)", mode)
    work = work_dir("planning")
    slow, fast = _tokenizers(work)
    rows = args.rows or ROWS[mode]
    data = make_chat_dataset(work / f"chat-{rows}.jsonl", rows=rows, seed=0)
    cores = default_workers()
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
    outputs, tokens = {}, None
    for i in range(args.repeats or REPEATS[mode]):
        for case, (name, _, fn) in cases.items():
            t, c = time.perf_counter(), _cpu()
            out = fn()
            runs[case].append(time.perf_counter() - t)
            cpu[case].append(tuple(b - a for a, b in zip(c, _cpu())))
            tokens = out.tokens
            if case.startswith("before"):
                outputs[name] = out
            elif not _same(out, outputs[name]):
                raise SystemExit(f"{case}: the plan differs from the former code path's")
        log.info("round %d: %s", i + 1, {k: round(v[-1], 2) for k, v in runs.items()})
    # The machine is shared: its cores were busy with other work while this ran, so wall time says
    # how much of a core this got as much as how fast planning is. Per core is therefore read from
    # CPU time (this process and its workers), and n cores from Amdahl's law on the two parts:
    # what this process did alone (read, hash, assemble) and what the workers did.
    wall = {k: tokens / median(v) for k, v in runs.items()}
    serial = {k: median([a for a, _ in v]) for k, v in cpu.items()}
    parallel = {k: median([b for _, b in v]) for k, v in cpu.items()}
    per_core = {k: tokens / (serial[k] + parallel[k]) for k in cases}

    def on(k: str, n: int) -> float:  # tokens/s on n idle cores
        return tokens / (serial[k] + parallel[k] / n) if parallel[k] else per_core[k]

    # once per plan, whatever the rows: the tokenizer's fingerprint (a serialization of it)
    from datagen.data.dataset import tokenizer_hashes

    c = _cpu()
    tokenizer_hashes(fast)
    fixed = _cpu()[0] - c[0]

    base = per_core["before, slow tokenizer, 1 process"]
    for case, (name, w, _) in cases.items():
        rec.rows.append(Row(case, round(per_core[case]), "tok/s per core", None, None,
                            f"{per_core[case] / base:.1f}x before (slow); CPU {serial[case]:.2f} s here + "
                            f"{parallel[case]:.2f} s in workers for {tokens:,} tokens; wall {median(runs[case]):.2f} s "
                            f"({wall[case]:,.0f} tok/s on the shared machine)"))
    best = f"after, fast tokenizer, {cores} process{'es' if cores > 1 else ''}"
    two = on(best, 2)
    rec.rows.append(Row("2 cores, fast tokenizer, vs before (slow tokenizer, 1 core)", round(two / base, 1), "x",
                        ">= 10", two / base >= 10, f"{two:,.0f} vs {base:,.0f} tok/s (from CPU time)"))
    # a nightly of 1B tokens: the once-per-plan part is nothing next to the per-token parts
    per_token_serial = max(serial[best] - fixed, 0.0) / tokens
    per_token_parallel = parallel[best] / tokens
    billion = 1e9
    projected = billion / (fixed + billion * (per_token_serial + per_token_parallel / 64))
    rec.rows.append(Row("64-core host, 1B tokens, projected from CPU time (Amdahl)", round(projected), "tok/s",
                        ">= 1,000,000", projected >= 1e6,
                        f"per token {per_token_serial * 1e6:.2f} us serial (read, hash, assemble) + "
                        f"{per_token_parallel * 1e6:.2f} us in workers; {fixed:.2f} s once per plan; "
                        f"1B tokens in {billion / projected / 60:.0f} min"))
    rec.data = {"rows": rows, "tokens": tokens, "cores": cores, "runs_s": runs, "cpu_s": cpu, "per_core": per_core,
                "wall_rate": wall, "today_reported_tok_s": TODAY_TOKENS_PER_S, "dataset_bytes": os.path.getsize(data),
                "load_average_1m": os.getloadavg()[0], "fixed_cpu_s": fixed}
    rec.notes.append("tokens/s per core = tokens / CPU seconds (this process and its workers, medians); n cores = "
                     "tokens / (serial CPU + parallel CPU / n); the tokenizer is loaded before the clock starts; every "
                     "'after' plan equals the 'before' plan of its tokenizer byte for byte")
    path = rec.write(Path(args.results) if args.results else (RESULTS if mode is Mode.FULL else SMOKE_RESULTS))
    plot(rec.__dict__ | {"rows": [r.__dict__ for r in rec.rows]}, path.parent)
    for r in rec.rows:
        print(f"| {r.case} | {r.value:,} {r.unit} | {r.detail} |")
    return 0


def plot(rec: dict, out: Path) -> None:
    """fig8_planning.png: tokens/s per core of each case (and the projection in the title)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rec["rows"] if r["unit"] == "tok/s per core"]
    fig, ax = plt.subplots(figsize=(9, 4))
    colors = ["gray" if r["case"].startswith("before") else "C0" if "slow" in r["case"] else "C1" for r in rows]
    ax.barh([r["case"] for r in rows], [r["value"] for r in rows], color=colors)
    for j, r in enumerate(rows):
        ax.text(r["value"], j, f" {r['value']:,.0f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s per core (median; gray: the former code path)")
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title(rec["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "fig8_planning.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
