"""Kimi-K2.5 (tiny, INT4 experts) through ``datagen extract`` on CUDA, against its bf16 twin.

Runs on the GPU machine (bench/gpu/README.md: how vLLM gets there; docs/gpu.md: the results):

    python3 bench/gpu/kimi.py make    --work /tmp/kimi                       # tiny INT4 Kimi + bf16 twin + rows
    python3 bench/gpu/kimi.py extract --work /tmp/kimi --out $OUT --tp 1 --mode compiled [--gpus 0]
    python3 bench/gpu/kimi.py compare --work /tmp/kimi --out $OUT             # every finished run vs the twin
    python3 bench/gpu/kimi.py wide    --work /tmp/kimiw --out $OUT --tp 2     # Kimi's real width (see wide())

``extract`` runs the project's CLI (``python -m datagen extract``) in a subprocess, the way a
user would, with ``DATAGEN_ENFORCE_EAGER=1`` for ``--mode eager``; ``--gpus`` pins it to some GPUs
so that two runs can share the machine. ``compare`` loads the twin with transformers on the GPU
(the project's reference engine, ``HFReference``) and, per captured layer, gives the per-token
relative L2 error's median, 99th percentile and fraction of tokens over 5%, plus the nearest wrong
layer (the reference layer, other than the right one, with the smallest median error: MoE routing
flips in bf16 make a single worst token meaningless). Runs at TP2 are compared with TP1 of the
same mode by the same statistics. Everything lands under --out as JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Rows: unequal lengths, several longer than the step budget (chunked prefill), one cut to max_seq_len.
LENGTHS = [1, 7, 33, 300, 700, 1500, 64, 12, 250, 90, 41, 3, 1024, 512, 128, 2200, 17, 600, 333, 999]
MAX_SEQ_LEN = 2048
BUDGET = 512  # max_num_batched_tokens: rows above it are prefilled in chunks
PER_SHARD = 8
OVER = 0.05  # "tokens over 5%"


def _layers(n: int) -> list[int]:
    return sorted({1, 2, n // 2, n - 1, n} - {0})


def make(args) -> None:
    import numpy as np

    sys.path.insert(0, str(REPO))
    from datagen.tiny_kimi import make_tiny_kimi

    work = Path(args.work)
    t0 = time.time()
    paths = make_tiny_kimi(work / "kimi", quantization="int4", vocab_size=args.vocab, num_layers=args.layers,
                           device="cuda" if args.cuda else "cpu")
    rng = np.random.default_rng(0)
    with (work / "rows.jsonl").open("w") as f:
        for n in LENGTHS:
            f.write(json.dumps({"input_ids": rng.integers(3, args.vocab - 300, size=n).tolist()}) + "\n")
    print(f"made {paths.model} and {paths.twin} in {time.time() - t0:.1f} s", flush=True)


def _run_dir(work: Path, tp: int, mode: str) -> Path:
    return work / "runs" / f"tp{tp}-{mode}"


def extract(args) -> None:
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = json.loads((work / "kimi" / "config.json").read_text())
    n = info["text_config"]["num_hidden_layers"]
    layers = args.layers or ",".join(map(str, _layers(n)))
    run = _run_dir(work, args.tp, args.mode)
    env = dict(os.environ)
    env["DATAGEN_ENFORCE_EAGER"] = "1" if args.mode == "eager" else "0"
    if args.gpus:
        env["CUDA_VISIBLE_DEVICES"] = args.gpus
    if args.mem:
        env["DATAGEN_GPU_MEMORY_UTILIZATION"] = str(args.mem)
    cmd = [sys.executable, "-m", "datagen", "extract", "--model", str(work / "kimi"), "--dataset",
           str(work / "rows.jsonl"), "--out", str(run), "--layers", layers, "--tensor-parallel-size", str(args.tp),
           "--max-seq-len", str(MAX_SEQ_LEN), "--samples-per-shard", str(PER_SHARD),
           "--max-num-batched-tokens", str(BUDGET)]
    tag = f"tp{args.tp}-{args.mode}"
    print(f"[{tag}] {' '.join(cmd)}", flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.time() - t0
    (out / f"kimi-{tag}.log").write_text(proc.stderr[-60000:] + "\n--- stdout ---\n" + proc.stdout[-20000:])
    result = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("datagen-result: "):
            result = json.loads(line[len("datagen-result: "):])
            break
    rec = {"tag": tag, "command": "datagen extract " + " ".join(cmd[4:]), "rc": proc.returncode,
           "wall_s": round(wall, 1), "result": result, "env": {"DATAGEN_ENFORCE_EAGER": env["DATAGEN_ENFORCE_EAGER"]}}
    manifest = run / "manifest.json"
    if manifest.exists():
        m = json.loads(manifest.read_text())
        rec["engine"] = m.get("spec", {}).get("engine") or m.get("engine")
    (out / f"kimi-{tag}.json").write_text(json.dumps(rec, indent=1))
    print(f"[{tag}] rc={proc.returncode} wall {wall:.0f} s; " + (proc.stderr[-1500:] if proc.returncode else
          f"result: {json.dumps(result)[:600]}"), flush=True)


def _samples(run: Path):
    from safetensors.torch import load_file

    m = json.loads((run / "manifest.json").read_text())
    for s in m["shards"]:
        t = load_file(str(run / s["path"]))
        off = t["sample_offsets"].tolist()
        for i in range(len(off) - 1):
            yield int(t["sample_index"][i]), t["input_ids"][off[i]:off[i + 1]], t["hidden_states"][off[i]:off[i + 1]]


def _stats(errs) -> dict:
    import torch

    e = torch.cat(errs).float()
    return {"tokens": int(e.numel()), "median": float(e.median()), "p99": float(torch.quantile(e, 0.99)),
            "frac_over_5pct": float((e > OVER).float().mean()), "max": float(e.max())}


def compare(args) -> None:
    import torch

    sys.path.insert(0, str(REPO))
    from datagen.compare import token_rel_err
    from datagen.engines.hf import HFReference
    from datagen.engines.patches import installed_vllm_version, run_self_tests

    work, out = Path(args.work), Path(args.out)
    twin = work / "kimi-bf16"
    n = json.loads((twin / "config.json").read_text())["num_hidden_layers"]
    runs = sorted(p for p in (work / "runs").glob("tp*") if (p / "manifest.json").exists())
    t0 = time.time()
    ref = HFReference(str(twin), layer_ids=tuple(range(n + 1)), num_hidden_layers=n, dtype="bfloat16",
                      device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ref_states: dict[int, torch.Tensor] = {}
    report = {"vllm": installed_vllm_version(), "self_tests": run_self_tests(), "num_hidden_layers": n,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "runs": {}, "pairs": {}}
    captured: dict[str, dict[int, torch.Tensor]] = {}
    for run in runs:
        m = json.loads((run / "manifest.json").read_text())
        layer_ids = m["spec"]["layer_ids"]
        errs = {k: [] for k in layer_ids}
        wrong = {k: {j: [] for j in range(n + 1) if j != k} for k in layer_ids}
        captured[run.name] = {}
        for row, ids, got in _samples(run):
            if row not in ref_states:
                ref_states[row] = ref.states(ids.tolist())
            want = ref_states[row]
            captured[run.name][row] = got
            for c, k in enumerate(layer_ids):
                errs[k].append(token_rel_err(got[:, c], want[:, k]))
                for j in wrong[k]:
                    wrong[k][j].append(token_rel_err(got[:, c], want[:, j]))
        layers = {}
        for k in layer_ids:
            s = _stats(errs[k])
            med = {j: float(torch.cat(v).median()) for j, v in wrong[k].items()}
            j = min(med, key=med.get)
            s["nearest_wrong_layer"] = j
            s["nearest_wrong_median"] = med[j]
            layers[str(k)] = s
        report["runs"][run.name] = {"layer_ids": layer_ids, "layers": layers,
                                    "engine": m["spec"].get("engine"), "tokens": m["totals"]["tokens"]}
    # TP2 against TP1 of the same mode; eager against compiled at the same TP
    for a, b in [("tp2-compiled", "tp1-compiled"), ("tp2-eager", "tp1-eager"), ("tp1-eager", "tp1-compiled"),
                 ("tp2-eager", "tp2-compiled")]:
        if a in captured and b in captured:
            la = report["runs"][a]["layer_ids"]
            per = {}
            for c, k in enumerate(la):
                per[str(k)] = _stats([token_rel_err(captured[a][r][:, c], captured[b][r][:, c]) for r in captured[a]])
                per[str(k)]["bitwise_equal_rows"] = sum(
                    bool(torch.equal(captured[a][r][:, c], captured[b][r][:, c])) for r in captured[a])
                per[str(k)]["rows"] = len(captured[a])
            report["pairs"][f"{a} vs {b}"] = per
    report["compare_s"] = round(time.time() - t0, 1)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or "kimi-compare"
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    table = markdown(report)
    (out / f"{name}.md").write_text(table)
    print(table, flush=True)


def markdown(report: dict) -> str:
    lines = [f"vLLM {report['vllm']} on {report.get('gpu', '?')}; self-tests: "
             + ", ".join(f"{k} {v}" for k, v in report["self_tests"].items()), "",
             "| run | layer | tokens | median | p99 | tokens > 5% | max | nearest wrong layer (median) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    n = report["num_hidden_layers"]
    for run, r in report["runs"].items():
        for k, s in r["layers"].items():
            lab = f"{k} (= N)" if int(k) == n else k
            lines.append(f"| {run} | {lab} | {s['tokens']} | {s['median']:.2%} | {s['p99']:.2%} | "
                         f"{s['frac_over_5pct']:.2%} | {s['max']:.1%} | {s['nearest_wrong_layer']} "
                         f"({s['nearest_wrong_median']:.0%}) |")
    if report["pairs"]:
        lines += ["", "| pair | layer | median | p99 | tokens > 5% | max | rows bitwise equal |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for pair, per in report["pairs"].items():
            for k, s in per.items():
                lines.append(f"| {pair} | {k} | {s['median']:.2%} | {s['p99']:.2%} | {s['frac_over_5pct']:.2%} | "
                             f"{s['max']:.1%} | {s['bitwise_equal_rows']}/{s['rows']} |")
    return "\n".join(lines) + "\n"


# --- Kimi's real width, few layers and experts (tensor-parallel throughput and rank-0 agreement) ----

def wide(args) -> None:
    """Make a Kimi-width checkpoint (hidden 7168, 64 heads, MLA 1536/512/64/128/128, vocab 163840,
    INT4 group-32 experts) with ``--layers`` layers and ``--experts`` routed experts on the GPU, run
    ``datagen extract`` at ``--tp`` (compiled) with layers [2, N/2, N-3, N], time plain vLLM prefill of
    the same rows with the same engine settings, and (``--ref-tp``) extract again at that TP to
    compare rank-0 states. Writes kimi-wide-*.json under --out."""
    import numpy as np
    import torch

    sys.path.insert(0, str(REPO))
    from datagen.tiny_kimi import kimi_width, make_tiny_kimi

    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rec: dict = {"layers": args.layers, "experts": args.experts, "tp": args.tp, "rows": args.rows,
                 "row_len": args.row_len}
    t0 = time.time()
    if not (work / "kimi" / "config.json").exists():
        make_tiny_kimi(work / "kimi", quantization="int4", num_layers=args.layers, n_routed_experts=args.experts,
                       num_experts_per_tok=min(8, args.experts), write_twin=False, device="cuda", **kimi_width())
        torch.cuda.empty_cache()
    rec["make_s"] = round(time.time() - t0, 1)
    rec["checkpoint_bytes"] = sum(p.stat().st_size for p in (work / "kimi").glob("*.safetensors"))
    rng = np.random.default_rng(0)
    with (work / "rows.jsonl").open("w") as f:
        for _ in range(args.rows):
            f.write(json.dumps({"input_ids": rng.integers(3, 163000, size=args.row_len).tolist()}) + "\n")
    n = args.layers
    layers = sorted({2, n // 2, n - 3, n})
    rec["layer_ids"] = layers
    runs = {}
    for tp in [args.tp] + ([args.ref_tp] if args.ref_tp else []):
        run = work / "runs" / f"tp{tp}"
        cmd = [sys.executable, "-m", "datagen", "extract", "--model", str(work / "kimi"), "--dataset",
               str(work / "rows.jsonl"), "--out", str(run), "--layers", ",".join(map(str, layers)),
               "--tensor-parallel-size", str(tp), "--max-seq-len", str(args.row_len + 8),
               "--samples-per-shard", str(args.per_shard), "--max-num-batched-tokens", str(args.budget)]
        t1 = time.time()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
        (out / f"kimi-wide-tp{tp}.log").write_text(proc.stderr[-60000:] + "\n--- stdout ---\n" + proc.stdout[-20000:])
        result = next((json.loads(ln[len("datagen-result: "):]) for ln in reversed(proc.stdout.splitlines())
                       if ln.startswith("datagen-result: ")), None)
        runs[tp] = {"rc": proc.returncode, "wall_s": round(time.time() - t1, 1), "result": result,
                    "command": "datagen extract " + " ".join(cmd[4:])}
        print(f"[wide tp{tp}] rc={proc.returncode} {runs[tp]['wall_s']} s {json.dumps(result)[:400] if result else proc.stderr[-1500:]}",
              flush=True)
    rec["extract"] = runs
    if args.plain and runs[args.tp]["rc"] == 0:
        rec["plain"] = _plain_prefill(work, args)
    if args.ref_tp and all(r["rc"] == 0 for r in runs.values()):
        from datagen.compare import token_rel_err

        a = {row: hs for row, _, hs in _samples(work / "runs" / f"tp{args.tp}")}
        b = {row: hs for row, _, hs in _samples(work / "runs" / f"tp{args.ref_tp}")}
        rec["rank0_vs_ref"] = {str(k): _stats([token_rel_err(a[r][:, c], b[r][:, c]) for r in a])
                               for c, k in enumerate(layers)}
    res = runs[args.tp].get("result") or {}
    if res.get("tokens_per_s"):
        per_token = len(layers) * 7168 * 2
        rec["tokens_per_s"] = res["tokens_per_s"]
        rec["gb_per_s"] = res["tokens_per_s"] * per_token / 1e9
    (out / f"kimi-wide-tp{args.tp}.json").write_text(json.dumps(rec, indent=1))
    print(json.dumps({k: v for k, v in rec.items() if k != "extract"}, indent=1), flush=True)


def _plain_prefill(work: Path, args) -> dict:
    """Plain vLLM prefill of the same rows with the extraction's engine settings (no capture)."""
    code = f"""
import json, time, sys
sys.path.insert(0, {str(REPO)!r})
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from datagen.engines.vllm_engine import VllmEngine
from datagen.modelinfo import inspect_model
info = inspect_model({str(work / 'kimi')!r})
eng = VllmEngine(info, layer_ids=(2,), dtype="bfloat16", max_seq_len={args.row_len + 8}, tensor_parallel_size={args.tp},
                 max_num_batched_tokens={args.budget})
kw = eng.engine_kwargs(); kw.pop("worker_extension_cls"); kw.pop("additional_config")
llm = LLM(**kw)
rows = [json.loads(l)["input_ids"] for l in open({str(work / 'rows.jsonl')!r})]
sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows[:4]], sp, use_tqdm=False)
out = []
for _ in range(2):
    t0 = time.time(); llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], sp, use_tqdm=False)
    out.append(sum(map(len, rows)) / (time.time() - t0))
print("plain-result: " + json.dumps(out))
"""
    env = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=args.timeout)
    vals = next((json.loads(ln[len("plain-result: "):]) for ln in reversed(proc.stdout.splitlines())
                 if ln.startswith("plain-result: ")), None)
    return {"rc": proc.returncode, "wall_s": round(time.time() - t0, 1), "tokens_per_s": vals,
            "stderr_tail": None if vals else proc.stderr[-3000:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("make")
    p.add_argument("--work", required=True)
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--cuda", action="store_true")
    p = sub.add_parser("extract")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--mode", choices=["compiled", "eager"], default="compiled")
    p.add_argument("--layers", help="default: 1, 2, N/2, N-1, N")
    p.add_argument("--gpus", help="CUDA_VISIBLE_DEVICES for this run")
    p.add_argument("--mem", type=float, help="DATAGEN_GPU_MEMORY_UTILIZATION")
    p.add_argument("--timeout", type=float, default=540)
    p = sub.add_parser("compare")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--name")
    p.add_argument("--device", help="reference device (default: cuda when present)")
    p = sub.add_parser("wide")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--ref-tp", type=int, default=0)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--row-len", type=int, default=1024)
    p.add_argument("--per-shard", type=int, default=32)
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--plain", action="store_true")
    p.add_argument("--timeout", type=float, default=540)
    args = ap.parse_args()
    {"make": make, "extract": extract, "compare": compare, "wide": wide}[args.cmd](args)


if __name__ == "__main__":
    main()
