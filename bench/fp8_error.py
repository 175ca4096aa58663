"""The error fp8 storage adds, on the parity models: per layer, per token vector.

    python -m bench.fp8_error            # table + bench/results/fp8_error.{json,md}

The parity models of the test suite (tests/builders.py: the 6-layer random Llama in bf16 and the
6-layer random DeepSeek-V3 with Kimi's rope, in bf16 and float32) run in the reference engine
(transformers) over random rows; every layer's states are stored as datagen stores them
(``--storage-dtype`` bfloat16 for the baseline; fp8_e4m3: ``datagen.data.shards.kernels.quantize_fp8``, the
function the capture runs on the GPU), and each token's fp8 vector is compared with its bf16
vector: relative L2 error ||fp8 - bf16|| / ||bf16||, median, p99 and max over tokens. The
vLLM engine's own fp8 shards show the same figures (tests/test_extract_vllm.py compares them).
A synthetic row with one channel 1000x the others shows what an outlier channel does.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from datagen.data.shards.kernels import dequantize_fp8, quantize_fp8
from datagen.engines.hf import HFReference


def rel_errors(x: torch.Tensor) -> torch.Tensor:
    """[T, L] relative L2 error of each fp8 vector against the bf16 one."""
    ref = x.to(torch.bfloat16).float()
    q, s = quantize_fp8(ref)
    back = dequantize_fp8(q, s)
    return (back - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)


def measure(model: Path, n_layers: int, dtype: str, rows: int, length: int) -> dict:
    ref = HFReference(str(model), layer_ids=tuple(range(n_layers + 1)), num_hidden_layers=n_layers, dtype=dtype,
                      device="cpu")
    rng = np.random.default_rng(0)
    errs = torch.cat([rel_errors(ref.states(rng.integers(10, 390, length))) for _ in range(rows)])
    out = {}
    for j in range(n_layers + 1):
        e = errs[:, j]
        out[str(j)] = {"median": float(e.median()), "p99": float(e.quantile(0.99)), "max": float(e.max()),
                       "tokens": int(e.numel())}
    return out


def outlier_case() -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 1, 7168, generator=g)
    x[:, :, 17] *= 1000.0  # a "massive activation" channel
    e = rel_errors(x)[:, 0]
    rest = x.clone()
    rest[:, :, 17] = 0
    q, s = quantize_fp8(x.to(torch.bfloat16).float())
    back = dequantize_fp8(q, s)
    others = (back - x.to(torch.bfloat16).float())[:, :, [i for i in range(7168) if i != 17]]
    rel_others = others.norm(dim=-1) / rest.to(torch.bfloat16).float().norm(dim=-1)
    return {"vector": {"median": float(e.median()), "max": float(e.max())},
            "other_channels": {"median": float(rel_others.median()), "max": float(rel_others.max())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    from tests.builders import make_model_dir

    rec: dict = {"rows": args.rows, "length": args.length, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for arch, dtype in (("llama", "bfloat16"), ("deepseek_v3", "bfloat16"), ("deepseek_v3", "float32")):
            model = make_model_dir(Path(tmp) / arch, arch=arch, num_layers=6)
            rec["models"][f"{arch} {dtype}"] = measure(model, 6, dtype, args.rows, args.length)
    rec["outlier_channel"] = outlier_case()
    lines = ["| model | layer | median | p99 | max |", "|---|---|---|---|---|"]
    for name, layers in rec["models"].items():
        for lid, v in layers.items():
            lines.append(f"| {name} | {lid} | {v['median']:.2%} | {v['p99']:.2%} | {v['max']:.2%} |")
    o = rec["outlier_channel"]
    lines.append(f"\none channel 1000x the rest (H=7168): vector error median {o['vector']['median']:.2%}, the other "
                 f"channels' error median {o['other_channels']['median']:.2%} (max {o['other_channels']['max']:.2%})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_error.json").write_text(json.dumps(rec, indent=1))
    (out / "fp8_error.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
