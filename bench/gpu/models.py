"""The random-weight checkpoints the GPU bench runs (torch, transformers and safetensors only: they
are built before vLLM is installed on the device machine).

  kimi   the tiny Kimi-K2.5 generator at its real width (hidden 7168, 64 heads, MLA 1536/512/64/128/128,
         the multimodal wrapper, INT4 group-32 routed experts): 8 layers, 16 routed experts (top 8)
         + 1 shared; about 10 GB, built on the GPU in about 30 s
  8b     a Llama 3.1 8B shape (hidden 4096, 32 layers, vocab 128256, 131072 positions), bf16; 15 GB, about 40 s
  tiny   a 6-layer Llama of hidden 64 (the CPU smoke)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

VOCAB = {"kimi": 163840, "8b": 128256, "tiny": 500}


def build(shape: str, path: Path) -> dict:
    """Write the checkpoint of ``shape`` at ``path`` (kept if it is there already)."""
    path = Path(path)
    if (path / "config.json").exists():
        return {"built": False, "path": str(path)}
    t0 = time.time()
    if shape == "kimi":
        from datagen.models.kimi_config import kimi_width
        from datagen.testmodels.tiny_kimi import make_tiny_kimi

        make_tiny_kimi(path, quantization="int4", num_layers=8, n_routed_experts=16, num_experts_per_tok=8,
                       write_twin=False, device="cuda", **kimi_width())
    elif shape == "8b":
        _llama_8b(path)
    elif shape == "tiny":
        from datagen.testmodels.tiny import TinyArch, make_model

        make_model(path, arch=TinyArch.LLAMA, num_layers=6, with_tokenizer=False)
    else:
        raise SystemExit(f"unknown shape {shape!r}")
    return {"built": True, "path": str(path), "seconds": round(time.time() - t0, 1)}


def _llama_8b(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB["8b"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                      rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16")
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
    model.save_pretrained(path, safe_serialization=True)


def write_rows(path: Path, rows: int, length: int, vocab: int, seed: int = 0) -> int:
    """``rows`` pre-tokenized rows of ``length`` random token ids (JSONL ``{"input_ids": [...]}``)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    with Path(path).open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"input_ids": rng.integers(10, vocab - 10, size=length).tolist()}) + "\n")
    return rows * length
