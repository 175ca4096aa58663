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
import shutil
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
    from datagen.testmodels.tiny_kimi import make_tiny_kimi

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
    sys.path.insert(0, str(REPO))
    from bench.gpu.timing import run_group

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
    proc = run_group(cmd, cwd=REPO, env=env, timeout=args.timeout)
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
    from datagen.engines.hf import HFReference
    from datagen.engines.patches import installed_vllm_version, run_self_tests
    from datagen.validation.compare import token_rel_err

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
    """A checkpoint at Kimi-K2.5's real width (hidden 7168, 64 heads, MLA 1536/512/64/128/128, vocab
    163840, INT4 group-32 routed experts, the wrapper) with ``--layers`` layers and ``--experts`` routed
    experts, made on the GPU. Then, each in its own process: (1) at ``--tp``, compiled, plain vLLM
    prefill of the rows and the project's extraction (``datagen.extraction``'s plan, engine and shard
    writer, layers [2, N/2, N-3, N]) timed around the shard loop, each on a started engine
    (``wide-bench``); (2) ``datagen extract`` of the same rows at ``--ref-tp`` (eager) through the
    CLI; (3) rank-0 states of (1) against (2). Writes kimi-wide-tp<tp>.json under --out."""
    import numpy as np

    sys.path.insert(0, str(REPO))
    from bench.gpu.timing import run_group
    from datagen.models.kimi_config import kimi_width
    from datagen.testmodels.tiny_kimi import make_tiny_kimi

    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    rec: dict = {"layers": args.layers, "experts": args.experts, "tp": args.tp, "ref_tp": args.ref_tp,
                 "rows": args.rows, "row_len": args.row_len, "budget": args.budget,
                 "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    t0 = time.time()
    if not (work / "kimi" / "config.json").exists():
        width = kimi_width() if args.width == "kimi" else {"vocab_size": 163840}
        make_tiny_kimi(work / "kimi", quantization=args.quantization, num_layers=args.layers,
                       n_routed_experts=args.experts, num_experts_per_tok=min(8, args.experts), write_twin=False,
                       device="cuda" if args.cuda else "cpu", **width)
    rec["make_s"] = round(time.time() - t0, 1)
    rec["checkpoint_bytes"] = sum(p.stat().st_size for p in (work / "kimi").glob("*.safetensors"))
    cfg = json.loads((work / "kimi" / "config.json").read_text())["text_config"]
    rec["hidden_size"] = cfg["hidden_size"]
    rng = np.random.default_rng(0)
    with (work / "rows.jsonl").open("w") as f:
        for _ in range(args.rows):
            f.write(json.dumps({"input_ids": rng.integers(3, 163000, size=args.row_len).tolist()}) + "\n")
    n = args.layers
    layers = sorted({2, n // 2, n - 3, n})
    rec["layer_ids"] = layers
    if not args.make_only:
        env = dict(os.environ)
        t1 = time.time()
        proc = run_group([sys.executable, __file__, "wide-bench", "--work", str(work), "--tp", str(args.tp),
                          "--layers", ",".join(map(str, layers)), "--row-len", str(args.row_len),
                          "--budget", str(args.budget), "--per-shard", str(args.per_shard)],
                         cwd=REPO, env=env, timeout=args.timeout)
        (out / f"kimi-wide-tp{args.tp}-bench.log").write_text(proc.stderr[-60000:] + "\n--- stdout ---\n" + proc.stdout[-20000:])
        bench = next((json.loads(ln[len("wide-bench: "):]) for ln in reversed(proc.stdout.splitlines())
                      if ln.startswith("wide-bench: ")), None)
        rec["bench"] = bench or {"rc": proc.returncode, "stderr_tail": proc.stderr[-3000:]}
        rec["bench_wall_s"] = round(time.time() - t1, 1)
        print(f"[wide-bench tp{args.tp}] rc={proc.returncode} {json.dumps(bench)[:800] if bench else proc.stderr[-2500:]}",
              flush=True)
        if args.ref_tp and bench:
            run = work / "runs" / f"tp{args.ref_tp}"
            cmd = [sys.executable, "-m", "datagen", "extract", "--model", str(work / "kimi"), "--dataset",
                   str(work / "rows.jsonl"), "--out", str(run), "--layers", ",".join(map(str, layers)),
                   "--tensor-parallel-size", str(args.ref_tp), "--max-seq-len", str(args.row_len + 8),
                   "--samples-per-shard", str(args.per_shard), "--max-num-batched-tokens", str(args.budget)]
            t1 = time.time()
            proc = run_group(cmd, cwd=REPO, env={**env, "DATAGEN_ENFORCE_EAGER": "1"}, timeout=args.timeout)
            (out / f"kimi-wide-tp{args.ref_tp}.log").write_text(proc.stderr[-60000:] + "\n--- stdout ---\n" + proc.stdout[-20000:])
            rec["reference"] = {"rc": proc.returncode, "wall_s": round(time.time() - t1, 1), "eager": True,
                                "command": "DATAGEN_ENFORCE_EAGER=1 datagen extract " + " ".join(cmd[4:])}
            print(f"[reference tp{args.ref_tp}] rc={proc.returncode} {rec['reference']['wall_s']} s "
                  + ("" if proc.returncode == 0 else proc.stderr[-2500:]), flush=True)
            if proc.returncode == 0:
                from datagen.validation.compare import token_rel_err

                a = {row: hs for row, _, hs in _samples(work / "runs" / f"tp{args.tp}")}
                b = {row: hs for row, _, hs in _samples(run)}
                rec["rank0_vs_reference"] = {str(k): _stats([token_rel_err(a[r][:, c], b[r][:, c]) for r in a])
                                             for c, k in enumerate(layers)}
    (out / f"kimi-wide-tp{args.tp}.json").write_text(json.dumps(rec, indent=1))
    print(json.dumps(rec, indent=1), flush=True)


def wide_bench(args) -> None:
    """In one process: plain prefill, then the project's extraction, each timed on a started engine."""
    import statistics

    sys.path.insert(0, str(REPO))
    from datagen.specs.extraction import parse_spec
    from datagen.extraction.plan import plan
    from datagen.extraction.run import make_engine

    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    work = Path(args.work)
    layers = [int(x) for x in args.layers.split(",")]
    rows = [json.loads(ln)["input_ids"] for ln in (work / "rows.jsonl").open()]
    tokens = sum(map(len, rows))

    def spec(out, storage="bfloat16"):
        return parse_spec({"model": str(work / "kimi"), "dataset": str(work / "rows.jsonl"), "out": str(out),
                           "layer_ids": layers, "max_seq_len": args.row_len + 8, "samples_per_shard": args.per_shard,
                           "engine": {"tensor_parallel_size": args.tp, "max_num_batched_tokens": args.budget,
                                      "storage_dtype": storage}})

    storages = args.storages.split(",")
    res: dict = {"tokens": tokens, "storages": storages}
    p = plan(spec(work / "runs" / "warm"))
    from vllm.inputs import TokensPrompt

    from bench.gpu.timing import extraction, plain_prefill

    prompts = [TokensPrompt(prompt_token_ids=r) for r in rows]
    plain = None
    if not args.no_plain:  # --no-plain: the plain figure is another call's (an engine start less)
        plain, start_s = plain_prefill(make_engine(p), prompts, tokens=tokens, repeats=args.repeats, warmup=4)
        res["plain_start_s"] = round(start_s, 1)
        print(f"plain: {plain}", flush=True)
    res["plain_tokens_per_s"] = plain
    res["by_storage"] = {}
    for i_st, st in enumerate(storages):
        warm = plan(spec(work / "runs" / f"warm-{st}", st))
        eng = make_engine(warm)
        t0 = time.time()
        eng.start()
        r: dict = {"extract_start_s": round(time.time() - t0, 1), "engine": eng.describe()}

        def plans(st=st, first=(i_st == 0)):
            for i in range(args.repeats):
                if args.clean:  # the passes before (and the warm-up's shard) off the disk
                    for old in (work / "runs").glob("*"):
                        if old.name != f"warm-{st}" or i > 0:
                            shutil.rmtree(old, ignore_errors=True)
                name = f"tp{args.tp}" if first and i == 0 and not args.clean else f"{st}-rep{i}"
                yield plan(spec(work / "runs" / name, st))

        extract, written = extraction(eng, warm, plans(), tokens=tokens)  # warm: shard 0 untimed
        eng.close()
        r["extract_tokens_per_s"] = extract
        r["extract_bytes_per_s"] = written
        r["overhead"] = statistics.median(plain) / statistics.median(extract) if plain else None
        r["bytes_per_token"] = statistics.median(written) / statistics.median(extract)
        res["by_storage"][st] = r
        print(f"datagen {st}: {extract}", flush=True)
        if args.clean:
            shutil.rmtree(work / "runs", ignore_errors=True)
    # the disk bound: the volume's direct-write rate over the bytes a token costs in each storage dtype
    from bench.gpu.timing import dd_direct

    res["disk"] = dd_direct(work, 4096)
    rate = res["disk"].get("dd_bytes_per_s")
    for r in res["by_storage"].values() if rate else ():
        r["disk_bound_tokens_per_s"] = rate / r["bytes_per_token"]
        bound = min(([statistics.median(plain)] if plain else []) + [r["disk_bound_tokens_per_s"]])
        r["extract_over_bound"] = statistics.median(r["extract_tokens_per_s"]) / bound
    first = res["by_storage"][storages[0]]  # the keys of the runs before storages were selectable
    res.update({"extract_start_s": first["extract_start_s"], "engine": first["engine"],
                "extract_tokens_per_s": first["extract_tokens_per_s"],
                "extract_bytes_per_s": first["extract_bytes_per_s"], "overhead": first["overhead"]})
    print("wide-bench: " + json.dumps(res), flush=True)


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
    p.add_argument("--ref-tp", type=int, default=0, help="TP of the reference run (0: none)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--row-len", type=int, default=1024)
    p.add_argument("--per-shard", type=int, default=16)
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--width", choices=["kimi", "tiny"], default="kimi", help="tiny: a CPU dry run of the script")
    p.add_argument("--quantization", choices=["int4", "none"], default="int4")
    p.add_argument("--cuda", action="store_true", help="generate the weights on the GPU")
    p.add_argument("--make-only", action="store_true")
    p.add_argument("--timeout", type=float, default=400)
    p = sub.add_parser("wide-bench")
    p.add_argument("--work", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", required=True)
    p.add_argument("--row-len", type=int, default=1024)
    p.add_argument("--per-shard", type=int, default=16)
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--storages", default="bfloat16", help="comma-separated storage dtypes, one engine each "
                   "(bfloat16, fp8_e4m3)")
    p.add_argument("--clean", action="store_true", help="remove each pass's output before the next (disk)")
    p.add_argument("--no-plain", action="store_true", help="no plain prefill (an engine start less: the plain "
                   "figure comes from another run of the same checkpoint)")
    args = ap.parse_args()
    {"make": make, "extract": extract, "compare": compare, "wide": wide,
     "wide-bench": wide_bench}[args.cmd](args)


if __name__ == "__main__":
    main()
