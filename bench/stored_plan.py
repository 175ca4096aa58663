"""Planning time of a dataset split in shard ranges: every range tokenizing the whole dataset
(before) against ranges reading their rows from the stored plan (now).

    python -m bench.stored_plan                        # table + bench/results/stored_plan.{json,md,png}
    python -m bench.stored_plan --rows 400 --ranges 4 --out /tmp/sp

The tiny Llama (its tokenizer and chat template) and a chat dataset of ``--rows`` rows, one shard per
range. Each range plans as ``datagen extract --shards k:k+1`` does, in this process:

- before: ``datagen.extraction.plan.plan`` (every row read, rendered with the chat template,
  tokenized and truncated), as every range did;
- now: ``datagen.extraction.stored.plan_shards``: the first range finds no stored plan, plans and
  stores it (what the run does once it has claimed its output); every later range reads its own
  shard's samples from it (the dataset file hashed, the tokenizer loaded, nothing tokenized).

Every range's samples from the stored plan are checked equal to the computed ones. The time is
the wall time of the calls (model config, tokenizer load, dataset), not of the engine.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _spec(model: Path, data: Path, out: Path, per_shard: int):
    from datagen.specs.extraction import parse_spec

    return parse_spec({"model": str(model), "dataset": str(data), "out": str(out), "samples_per_shard": per_shard,
                       "engine": {"name": "hf"}})


def _same_samples(a, b, rows: range) -> bool:
    for r in rows:
        if (r in a.data.samples) != (r in b.data.samples):
            return False
        if r in a.data.samples:
            x, y = a.data.samples[r], b.data.samples[r]
            if not (np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.loss_mask, y.loss_mask)):
                return False
    return a.fingerprint == b.fingerprint and [a.shard_key(k) for k in range(a.num_shards)] == \
        [b.shard_key(k) for k in range(b.num_shards)]


def run(rows: int, ranges: int, work: Path) -> dict:
    from datagen.extraction import stored
    from datagen.extraction.plan import plan
    from datagen.testmodels.tiny import TinyArch, make_chat_dataset, make_model

    model = work / "tiny-llama"
    if not (model / "config.json").exists():
        make_model(model, arch=TinyArch.LLAMA, num_layers=6)
    data = make_chat_dataset(work / f"chat-{rows}.jsonl", rows=rows, seed=0)
    per_shard = -(-rows // ranges)
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    (out / ".datagen").mkdir()  # as after the run's claim
    spec = _spec(model, data, out, per_shard)

    plan(spec)  # imports and first-call costs, counted on neither side
    before = []
    computed = None
    for k in range(ranges):
        t = time.monotonic()
        computed = plan(spec)
        before.append(time.monotonic() - t)
    now, sources, same = [], [], True
    for k in range(ranges):
        t = time.monotonic()
        p, from_store = stored.plan_shards(spec, (k, k + 1))
        if not from_store:
            stored.store_plan(p)
        now.append(time.monotonic() - t)
        sources.append("stored" if from_store else "computed + stored")
        same = same and _same_samples(p, computed, range(k * per_shard, min((k + 1) * per_shard, rows)))
    size = sum(f.stat().st_size for f in (out / ".datagen" / "plan").rglob("*") if f.is_file())
    return {"rows": rows, "ranges": ranges, "samples_per_shard": per_shard, "tokens": computed.data.tokens,
            "dataset_bytes": data.stat().st_size, "stored_plan_bytes": size,
            "before_s": before, "now_s": now, "now_source": sources, "same_samples": same}


def table(rec: dict) -> str:
    b, n = rec["before_s"], rec["now_s"]
    later = n[1:] or n
    lines = [
        f"{rec['rows']} chat rows ({rec['tokens']} tokens, {rec['dataset_bytes'] / 1e6:.1f} MB), "
        f"{rec['ranges']} ranges of {rec['samples_per_shard']} rows; stored plan "
        f"{rec['stored_plan_bytes'] / 1e6:.2f} MB",
        "",
        "| planning | before (every range tokenizes) | now (stored plan) | before / now |",
        "|---|---|---|---|",
        f"| first range | {b[0]:.2f} s | {n[0]:.2f} s ({rec['now_source'][0]}) | {b[0] / n[0]:.2f}x |",
        f"| a later range (median) | {statistics.median(b[1:] or b):.2f} s | {statistics.median(later):.3f} s | "
        f"{statistics.median(b[1:] or b) / statistics.median(later):.0f}x |",
        f"| all {rec['ranges']} ranges | {sum(b):.1f} s | {sum(n):.1f} s | {sum(b) / sum(n):.1f}x |",
        f"| same samples, fingerprint and shard keys | | {rec['same_samples']} | |",
    ]
    return "\n".join(lines)


def plot(rec: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = np.arange(rec["ranges"])
    ax.plot(x, np.cumsum(rec["before_s"]), marker="o", label="before: every range tokenizes the dataset")
    ax.plot(x, np.cumsum(rec["now_s"]), marker="o", label="now: ranges read the stored plan")
    ax.set_xlabel("range")
    ax.set_ylabel("planning time, cumulative (s)")
    ax.set_title(f"Planning {rec['ranges']} ranges of {rec['rows']} chat rows (tiny Llama tokenizer)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--ranges", type=int, default=20)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--work", default=str(ROOT / ".cache" / "bench" / "stored_plan"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rec = run(args.rows, args.ranges, work)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stored_plan.json").write_text(json.dumps(rec, indent=1) + "\n")
    t = table(rec)
    (out / "stored_plan.md").write_text(t + "\n")
    print(t)
    if not rec["same_samples"]:
        raise SystemExit("the stored plan gave other samples than the computed plan")
    plot(rec, out / "stored_plan.png")
    shutil.rmtree(work / "out", ignore_errors=True)


if __name__ == "__main__":
    main()
