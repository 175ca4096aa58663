"""The project's extraction on a CUDA GPU, against plain vLLM prefill and the roofline.

Runs on the GPU machine (bench/gpu/README.md says how vLLM gets there):

    python3 bench/gpu/run.py model  --dir /tmp/m8b             # random 8B Llama shape, built on the GPU
    python3 bench/gpu/run.py bench  --model /tmp/m8b --out $OUT  # plain prefill vs datagen extract, 3 runs each
    python3 bench/gpu/run.py parity --out $OUT                   # capture == transformers on CUDA
    python3 bench/gpu/run.py v2     --out $OUT                   # Model Runner V2 without the pin
    python3 bench/gpu/run.py disk   --out $OUT                   # plain sequential write speed

Each writes a JSON file under --out; bench/gpu/report.py turns them into the table and plots.
Extraction is timed around the shard loop of the real engine (``VllmEngine``: patches, capture,
shard writer), with the engine started once and the loop repeated into fresh output
directories; plain prefill is timed around ``LLM.generate`` of the same rows and settings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROWS = int(os.environ.get("BENCH_ROWS", "256"))
PER_SHARD = int(os.environ.get("BENCH_PER_SHARD", "64"))
ROW_LEN, LAYERS_8B = 1024, (2, 16, 29, 32)
ENGINE = dict(max_num_batched_tokens=16384, max_num_seqs=256)


def _rows(n: int, length: int, vocab: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab - 10, size=length).astype("int32") for _ in range(n)]


def make_model(args) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.time()
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16")
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
    model.save_pretrained(args.dir, safe_serialization=True)
    print(f"model written to {args.dir} in {time.time() - t0:.0f} s", flush=True)


def _spec(model: str, data: str, out: str, layers, dtype="bfloat16"):
    from datagen.data.spec import parse_spec

    return parse_spec({"model": model, "dataset": data, "out": out, "layer_ids": list(layers),
                       "max_seq_len": ROW_LEN + 8, "samples_per_shard": PER_SHARD,
                       "engine": {"dtype": dtype, **ENGINE}})


def _write_rows(path: Path, rows) -> None:
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps({"input_ids": r.tolist()}) + "\n")


def _matmul_tflops() -> float:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.time()
    n = 50
    for _ in range(n):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * n / (time.time() - t0) / 1e12


def bench(args) -> None:
    """Plain prefill, then datagen extraction, each 3 times on one started engine."""
    from datagen.engines.vllm_engine import VllmEngine
    from datagen.extraction.plan import plan

    out = Path(args.out)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = _rows(ROWS, ROW_LEN, 128256)
    data = work / "rows.jsonl"
    _write_rows(data, rows)
    tokens = ROWS * ROW_LEN
    result = {"rows": ROWS, "per_shard": PER_SHARD, "row_len": ROW_LEN, "layers": list(LAYERS_8B), "engine": ENGINE}
    result["matmul_tflops"] = _matmul_tflops()
    params = sum(p.numel() for p in _param_shapes(args.model))
    result["params"] = params
    result["compute_floor_tokens_per_s"] = result["matmul_tflops"] * 1e12 / (2 * params)

    # Plain prefill: the same engine settings, no capture.
    from vllm.inputs import TokensPrompt

    from bench.gpu.timing import extraction, plain_prefill

    p = plan(_spec(args.model, str(data), str(work / "ds0"), LAYERS_8B))
    eng = VllmEngine(p.info, layer_ids=p.layer_ids, dtype="bfloat16", storage_dtype="bfloat16",
                     max_seq_len=p.spec.max_seq_len, **ENGINE)
    prompts = [TokensPrompt(prompt_token_ids=r.tolist()) for r in rows]
    plain, _ = plain_prefill(eng, prompts, tokens=tokens, repeats=3, warmup=16)
    result["plain_tokens_per_s"] = plain

    # datagen extraction: the real engine and shard writer, shards to local disk.
    eng = VllmEngine(p.info, layer_ids=p.layer_ids, dtype="bfloat16", storage_dtype="bfloat16",
                     max_seq_len=p.spec.max_seq_len, **ENGINE)
    eng.start()

    def plans():
        for i in range(3):
            yield plan(_spec(args.model, str(data), str(work / f"ds{i}"), LAYERS_8B))
            shutil.rmtree(work / f"ds{i}")  # after the pass, before the next plan

    warm = plan(_spec(args.model, str(data), str(work / "warm"), LAYERS_8B))
    extract, written = extraction(eng, warm, plans(), tokens=tokens)
    eng.close()
    result["extract_tokens_per_s"] = extract
    result["extract_bytes_per_s"] = written
    med_plain, med_ex = statistics.median(plain), statistics.median(extract)
    result["overhead"] = med_plain / med_ex
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("plain_tokens_per_s", "extract_tokens_per_s", "overhead",
                                             "extract_bytes_per_s", "compute_floor_tokens_per_s")}, indent=1))


def _param_shapes(model_dir: str):
    import torch
    from safetensors import safe_open

    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                yield torch.empty(st.get_slice(k).get_shape(), device="meta")


def parity(args) -> None:
    """A random 6-layer Llama: the project's capture on CUDA against transformers on CUDA."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from datagen.engines.hf import HFReference
    from datagen.models.tiny import TinyArch, make_model as make_tiny
    from datagen.validation.compare import compare_states, states_match

    work = Path(args.work) / "parity"
    shutil.rmtree(work, ignore_errors=True)
    model = make_tiny(work / "model", arch=TinyArch(args.arch), num_layers=6, hidden=256 if args.arch == "llama" else None,
                      with_tokenizer=False)
    lengths = [5, 700, 33, 1500, 64]
    rows = [r[:n] for r, n in zip(_rows(len(lengths), 1500, 500, seed=3), lengths)]
    data = work / "rows.jsonl"
    _write_rows(data, rows)
    out = work / "ds"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    dtype = "float32" if args.arch == "deepseek_v3" else "bfloat16"
    cmd = [sys.executable, "-m", "datagen", "extract", "--model", str(model), "--dataset", str(data), "--out", str(out),
           "--max-num-batched-tokens", "512", "--samples-per-shard", "5", "--dtype", dtype,
           "--tensor-parallel-size", str(args.tp)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-6000:])
        raise SystemExit(proc.returncode)
    from safetensors.torch import load_file

    shard = load_file(str(out / "shards" / "shard-000000.safetensors"))
    layer_ids = [2, 3, 6]
    ref = HFReference(str(model), layer_ids=tuple(range(7)), num_hidden_layers=6, dtype=dtype, device="cuda")
    off = shard["sample_offsets"].tolist()
    report = {"arch": args.arch, "tp": args.tp, "dtype": dtype, "samples": []}
    for i in range(len(off) - 1):
        ids = shard["input_ids"][off[i]:off[i + 1]]
        got = shard["hidden_states"][off[i]:off[i + 1]]
        want = ref.states(ids)
        cmp = compare_states(got, want[:, layer_ids])
        wrong = states_match(got, want[:, [3, 4, 5]])
        report["samples"].append({"tokens": len(ids), "max_rel": [c.max_rel for c in cmp],
                                  "median_rel": [c.median_rel for c in cmp], "off_by_one_matches": wrong})
    report["ok"] = all(max(s["max_rel"]) < 0.06 and not s["off_by_one_matches"] for s in report["samples"])
    report["shard_sha256"] = json.loads((out / "manifest.json").read_text())["shards"][0]["sha256"]
    name = f"parity-{args.arch}-tp{args.tp}.json"
    (Path(args.out) / name).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    torch_save = Path(args.out) / f"states-{args.arch}-tp{args.tp}.safetensors"
    shutil.copy(out / "shards" / "shard-000000.safetensors", torch_save)


def v2(args) -> None:
    """What happens when Model Runner V2 is asked for (the pin left out, or V2 forced)."""
    work = Path(args.work) / "v2"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    from datagen.models.tiny import TinyArch, make_model as make_tiny

    model = make_tiny(work / "model", arch=TinyArch.LLAMA, num_layers=6, with_tokenizer=False)
    data = work / "rows.jsonl"
    _write_rows(data, _rows(4, 64, 500))
    report = {}
    for label, value in (("unset", None), ("forced_v2", "1")):
        env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
        if value is not None:
            env["VLLM_USE_V2_MODEL_RUNNER"] = value
        proc = subprocess.run([sys.executable, "-m", "datagen", "extract", "--model", str(model), "--dataset",
                               str(data), "--out", str(work / label)], env=env, capture_output=True, text=True)
        report[label] = {"exit": proc.returncode,
                         "error": [l for l in proc.stderr.splitlines() if l.startswith(("error", "  ->"))][-3:],
                         "runner": [l[-160:] for l in proc.stderr.splitlines() if "Model Runner" in l or "model runner" in l][:3]}
    (Path(args.out) / "v2.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def disk(args) -> None:
    target = Path(args.work) / "ddtest"
    proc = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M", "count=512", "oflag=direct"],
                          capture_output=True, text=True)
    target.unlink(missing_ok=True)
    line = proc.stderr.strip().splitlines()[-1]
    (Path(args.out) / "disk.json").write_text(json.dumps({"dd": line}))
    print(line)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["model", "bench", "parity", "v2", "disk"])
    ap.add_argument("--dir", default="/tmp/m8b")
    ap.add_argument("--model", default="/tmp/m8b")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", default="/tmp/gpuwork")
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    {"model": make_model, "bench": bench, "parity": parity, "v2": v2, "disk": disk}[args.what](args)


if __name__ == "__main__":
    main()
