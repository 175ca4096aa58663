"""A CPU draft's training step by optimizer and hidden-state dtype: `datagen train --device cpu` at
SmolLM2-135M's shape, speculators' default optimizer (Muon for the 2D weights, AdamW for the rest) against
AdamW alone, the states read and computed in bf16 (autocast) against float32.

    python -m bench.train_cpu                    # table + bench/results/train_cpu.{json,md,png}
    python -m bench.train_cpu --steps 3 --out /tmp/tc

Why: on a CPU without bf16 kernels (no AVX-512 or AMX) a bf16 matmul runs several times slower than
float32, and torch's Muon orthogonalizes each update in bf16 whatever the run's dtype
(``torch.optim._muon._zeropower_via_newtonschulz``). ``datagen.training.recipe.cpu_defaults`` takes
float32 and AdamW there; this bench measures what each costs on the CPU it runs on.

Each case is one `datagen train` process (``bench.train_startup``'s child: speculators' per-step profile);
the table holds the median of the steps after the first. A verifier and a dataset of SmolLM2-135M's
shape (random bf16 states, ``bench.gpu.train``'s makers) stand in for the real model: the step's cost
depends on the shapes, not on the weights.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# SmolLM2-135M-Instruct (tests/test_train_smollm2.py's target): its draft layer is 576 wide, its MLP 1536
SHAPE = dict(hidden=576, layers=30, vocab=49152, heads=9, kv_heads=3, intermediate=1536,
             arch="LlamaForCausalLM", model_type="llama", layer_ids=(2, 15, 27, 30))
CASES = {  # label -> the options given (the rest: speculators' defaults, the CPU's attention and loss)
    "Muon + AdamW, bf16": ["--optimizer", "muon", "--hidden-states-dtype", "bfloat16"],
    "Muon + AdamW, float32": ["--optimizer", "muon", "--hidden-states-dtype", "float32"],
    "AdamW, bf16": ["--optimizer", "adamw", "--hidden-states-dtype", "bfloat16"],
    "AdamW, float32": ["--optimizer", "adamw", "--hidden-states-dtype", "float32"],
}
PHASES = ("fetch_ms", "fwd_ms", "bwd_ms", "opt_ms", "step_ms")


def run(work: Path, *, steps: int, tokens: int, total_seq_len: int) -> dict:
    from bench.gpu.train import make_dataset, make_verifier
    from bench.train_startup import _run
    from datagen.training.recipe import cpu_defaults, cpu_has_bf16

    verifier = make_verifier(work / "verifier", SHAPE, device="cpu")
    dataset = make_dataset(work / "dataset", verifier, SHAPE, tokens=tokens, per_shard=32, device="cpu",
                           lengths=(64, 512))
    rec: dict = {"shape": SHAPE, "steps": steps, "total_seq_len": total_seq_len,
                 "cpu_has_bf16": cpu_has_bf16(), "cpu_defaults": dict(cpu_defaults()), "cases": {}}
    for k, (label, options) in enumerate(CASES.items()):
        draft = work / f"draft-{k}"
        shutil.rmtree(draft, ignore_errors=True)
        r = _run("datagen", ["train", str(dataset), "--out", str(draft), "--model", str(verifier), "--steps",
                             str(steps), "--total-seq-len", str(total_seq_len), "--draft-vocab-size", "1024",
                             "--mask-token-id", "0", *options], work, k)
        rec["cases"][label] = {"options": options, "step_ms": r["step_ms"], "wall_s": r["wall_s"]}
        print(f"{label}: step {r['step_ms'].get('step_ms', 0):.0f} ms (opt {r['step_ms'].get('opt_ms', 0):.0f})",
              flush=True)
    return rec


def table(rec: dict) -> str:
    s = rec["shape"]
    lines = [f"CPU ({os.cpu_count()} cores; bf16 kernels: {'yes' if rec['cpu_has_bf16'] else 'no'}), hidden "
             f"{s['hidden']}, MLP {s['intermediate']}, draft vocabulary 1,024, {rec['total_seq_len']} tokens a step; "
             f"median of steps 2-{rec['steps']} (ms, speculators' profile). `datagen train`'s CPU defaults here: "
             + ", ".join(f"{k}={v}" for k, v in rec["cpu_defaults"].items()), "",
             "| optimizer, states | " + " | ".join(p.removesuffix("_ms") for p in PHASES) + " | x the fastest |",
             "|---|" + "---|" * (len(PHASES) + 1)]
    fastest = min(c["step_ms"]["step_ms"] for c in rec["cases"].values())
    for label, c in rec["cases"].items():
        lines.append(f"| {label} | " + " | ".join(f"{c['step_ms'].get(p, 0):.0f}" for p in PHASES)
                     + f" | {c['step_ms']['step_ms'] / fastest:.1f} |")
    return "\n".join(lines)


def plot(rec: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(rec["cases"])
    fig, ax = plt.subplots(figsize=(8, 3.2))
    left = [0.0] * len(labels)
    for phase in ("fetch_ms", "fwd_ms", "bwd_ms", "opt_ms"):
        ms = [rec["cases"][x]["step_ms"].get(phase, 0.0) for x in labels]
        ax.barh(labels, ms, left=left, label=phase.removesuffix("_ms"))
        left = [a + b for a, b in zip(left, ms)]
    ax.set_xscale("log")
    ax.set_xlabel("ms a step (log scale)")
    ax.set_title(f"A CPU draft's step (bf16 kernels: {'yes' if rec['cpu_has_bf16'] else 'no'})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    from bench._common import write_results

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=12_000)
    ap.add_argument("--total-seq-len", type=int, default=1024)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--work", default=str(ROOT / ".cache" / "bench" / "train_cpu"))
    args = ap.parse_args()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    rec = run(work, steps=args.steps, tokens=args.tokens, total_seq_len=args.total_seq_len)
    write_results(out, "train_cpu", rec, table(rec), plot)


if __name__ == "__main__":
    main()
