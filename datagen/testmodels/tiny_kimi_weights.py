"""The tiny Kimi-K2.5 checkpoint's random weights: the language model's tensors (bf16, and the routed
experts INT4 as compressed-tensors packs them), the vision tower's, their names in the Kimi
checkpoint and in the bf16 twin, and the sharded safetensors files they are saved as.

Values are drawn from one seeded generator in a fixed order (the text model, then the vision
tower): the same seed and sizes give the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from datagen.models.kimi_config import GROUP_SIZE

if TYPE_CHECKING:
    import torch


class RandomWeights:
    """bf16 weights drawn from one seeded generator on one device (``"cuda"`` for the full width)."""

    def __init__(self, *, seed: int, device: str):
        import torch

        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def rand(self, *shape, std=0.02):
        import torch

        return (torch.randn(*shape, generator=self.gen, device=self.device) * std).to(torch.bfloat16)

    def ones(self, n):
        import torch

        return (1.0 + torch.randn(n, generator=self.gen, device=self.device) * 0.05).to(torch.bfloat16)


def _pow2_int4(w, gen):
    """Symmetric INT4 group-32 quantization with power-of-two scales: (q int8, scale bf16, deq bf16)."""
    import torch

    out, inp = w.shape
    g = w.float().reshape(out, inp // GROUP_SIZE, GROUP_SIZE)
    absmax = g.abs().amax(dim=-1).clamp_min(1e-8)
    scale = torch.exp2(torch.round(torch.log2(absmax / 7.0)))  # power of two: q * scale is exact in bf16
    q = torch.clamp(torch.round(g / scale[..., None]), -8, 7)
    deq = (q * scale[..., None]).reshape(out, inp)
    return q.reshape(out, inp).to(torch.int8), scale.to(torch.bfloat16), deq.to(torch.bfloat16)


def _pack_int4(q):
    """INT4 values in int8 -> int32 [out, in/8], low nibble first, value + 8 (compressed-tensors)."""
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    except ImportError:
        try:
            from compressed_tensors.compressors.quantized_compressors.pack_quantized import pack_to_int32
        except ImportError:
            pack_to_int32 = None
    if pack_to_int32 is not None:
        return pack_to_int32(q, 4)
    import torch

    u = (q.to(torch.int32) + 8).reshape(q.shape[0], q.shape[1] // 8, 8)
    shifts = torch.arange(8, dtype=torch.int32, device=q.device) * 4
    return (u << shifts).sum(dim=-1, dtype=torch.int32)


def text_tensors(text: dict, draw: RandomWeights, *, quantization: Literal["int4", "none"],
                 write_twin: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The language model of the ``text_config`` ``text``: (the twin's tensors, ``model.*`` and
    ``lm_head.*`` in bf16, with the routed experts dequantized when the twin or ``quantization="none"``
    needs them; the extra INT4 tensors of the routed experts, model-relative names)."""
    import torch

    rand, ones, gen, device = draw.rand, draw.ones, draw.gen, draw.device
    vocab_size, num_layers, hidden_size = text["vocab_size"], text["num_hidden_layers"], text["hidden_size"]
    num_attention_heads, q_lora_rank, kv_lora_rank = (
        text["num_attention_heads"], text["q_lora_rank"], text["kv_lora_rank"])
    qk_rope_head_dim, qk_nope_head_dim, v_head_dim = (
        text["qk_rope_head_dim"], text["qk_nope_head_dim"], text["v_head_dim"])
    intermediate_size, moe_intermediate_size = text["intermediate_size"], text["moe_intermediate_size"]
    n_routed_experts = text["n_routed_experts"]
    H, qk_head = hidden_size, qk_nope_head_dim + qk_rope_head_dim
    tensors: dict[str, torch.Tensor] = {}  # twin names (model.* / lm_head.*), bf16
    quantized: dict[str, torch.Tensor] = {}  # extra INT4 tensors, model-relative names
    tensors["model.embed_tokens.weight"] = rand(vocab_size, H, std=1.0)
    for i in range(num_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        tensors[f"{p}.input_layernorm.weight"] = ones(H)
        tensors[f"{p}.post_attention_layernorm.weight"] = ones(H)
        tensors[f"{a}.q_a_proj.weight"] = rand(q_lora_rank, H, std=H ** -0.5)
        tensors[f"{a}.q_a_layernorm.weight"] = ones(q_lora_rank)
        tensors[f"{a}.q_b_proj.weight"] = rand(num_attention_heads * qk_head, q_lora_rank, std=q_lora_rank ** -0.5)
        tensors[f"{a}.kv_a_proj_with_mqa.weight"] = rand(kv_lora_rank + qk_rope_head_dim, H, std=H ** -0.5)
        tensors[f"{a}.kv_a_layernorm.weight"] = ones(kv_lora_rank)
        tensors[f"{a}.kv_b_proj.weight"] = rand(num_attention_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank,
                                                     std=kv_lora_rank ** -0.5)
        tensors[f"{a}.o_proj.weight"] = rand(H, num_attention_heads * v_head_dim, std=(num_attention_heads * v_head_dim) ** -0.5)
        if i < text["first_k_dense_replace"]:
            mlp = {"gate_proj": (intermediate_size, H), "up_proj": (intermediate_size, H), "down_proj": (H, intermediate_size)}
            for name, shape in mlp.items():
                tensors[f"{p}.mlp.{name}.weight"] = rand(*shape, std=shape[1] ** -0.5)
            continue
        tensors[f"{p}.mlp.gate.weight"] = rand(n_routed_experts, H, std=H ** -0.5)
        tensors[f"{p}.mlp.gate.e_score_correction_bias"] = (
            torch.randn(n_routed_experts, generator=gen, device=device) * 0.01).float()
        shared_i = moe_intermediate_size * text["n_shared_experts"]
        for name, shape in {"gate_proj": (shared_i, H), "up_proj": (shared_i, H), "down_proj": (H, shared_i)}.items():
            tensors[f"{p}.mlp.shared_experts.{name}.weight"] = rand(*shape, std=shape[1] ** -0.5)
        I = moe_intermediate_size
        for e in range(n_routed_experts):
            for name, shape in {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}.items():
                key = f"{p}.mlp.experts.{e}.{name}"
                w = rand(*shape, std=shape[1] ** -0.5)
                q, scale, deq = _pow2_int4(w, gen)
                if write_twin or quantization == "none":
                    tensors[f"{key}.weight"] = deq
                if quantization == "int4":
                    quantized[f"{key}.weight_packed"] = _pack_int4(q).cpu()
                    quantized[f"{key}.weight_scale"] = scale.cpu()
                    quantized[f"{key}.weight_shape"] = torch.tensor(list(shape), dtype=torch.int32)
    tensors["model.norm.weight"] = ones(H)
    tensors["lm_head.weight"] = rand(vocab_size, H, std=H ** -0.5)
    tensors = {k: v.cpu().contiguous() for k, v in tensors.items()}
    return tensors, quantized


def vision_tensors(draw: RandomWeights, *, hidden_size: int, intermediate_size: int, pos_emb: int,
                   text_hidden_size: int) -> dict[str, torch.Tensor]:
    """The vision tower (patch embedding, position embedding, one encoder block) and the projector
    into the language model's ``text_hidden_size``, in bf16 on the CPU."""
    rand, ones = draw.rand, draw.ones
    vh, vi, pos, H = hidden_size, intermediate_size, pos_emb, text_hidden_size
    vt = "vision_tower"
    vision = {
        f"{vt}.patch_embed.proj.weight": rand(vh, 3, 14, 14), f"{vt}.patch_embed.proj.bias": rand(vh),
        f"{vt}.patch_embed.pos_emb.weight": rand(pos, pos, vh),
        f"{vt}.encoder.final_layernorm.weight": ones(vh), f"{vt}.encoder.final_layernorm.bias": rand(vh),
        "mm_projector.pre_norm.weight": ones(vh), "mm_projector.pre_norm.bias": rand(vh),
        "mm_projector.proj.0.weight": rand(4 * vh, 4 * vh), "mm_projector.proj.0.bias": rand(4 * vh),
        "mm_projector.proj.2.weight": rand(H, 4 * vh), "mm_projector.proj.2.bias": rand(H),
    }
    b = f"{vt}.encoder.blocks.0"
    vision.update({
        f"{b}.norm0.weight": ones(vh), f"{b}.norm0.bias": rand(vh),
        f"{b}.norm1.weight": ones(vh), f"{b}.norm1.bias": rand(vh),
        f"{b}.wqkv.weight": rand(3 * vh, vh), f"{b}.wqkv.bias": rand(3 * vh),
        f"{b}.wo.weight": rand(vh, vh), f"{b}.wo.bias": rand(vh),
        f"{b}.mlp.fc0.weight": rand(vi, vh), f"{b}.mlp.fc0.bias": rand(vi),
        f"{b}.mlp.fc1.weight": rand(vh, vi), f"{b}.mlp.fc1.bias": rand(vh),
    })
    return {k: v.cpu().contiguous() for k, v in vision.items()}


def kimi_tensors(text_model: dict, quantized: dict, vision: dict, *,
                 quantization: Literal["int4", "none"]) -> dict[str, torch.Tensor]:
    """The Kimi checkpoint's tensors: the language model ``text_model`` (``text_tensors``' first
    result) under ``language_model.``, its routed experts packed (``quantized``) for
    ``quantization="int4"``, and the vision tower and projector ``vision`` as they are."""
    kimi: dict[str, torch.Tensor] = {}
    for k, v in text_model.items():
        if quantization == "int4" and ".mlp.experts." in k:
            continue  # the routed experts travel packed
        kimi[f"language_model.{k}"] = v
    kimi.update({f"language_model.{k}": v for k, v in quantized.items()})
    kimi.update(vision)
    return kimi


def save_sharded(d: Path, tensors: dict, shard_bytes: int = 4 << 30) -> None:
    """model-0000k-of-0000n.safetensors + model.safetensors.index.json, as released checkpoints are."""
    from safetensors.torch import save_file

    for old in list(d.glob("model*.safetensors")) + list(d.glob("model.safetensors.index.json")):
        old.unlink()
    groups: list[dict] = [{}]
    size = 0
    for k in sorted(tensors):
        n = tensors[k].numel() * tensors[k].element_size()
        if groups[-1] and size + n > shard_bytes:
            groups.append({})
            size = 0
        groups[-1][k] = tensors[k]
        size += n
    total = len(groups)
    weight_map = {}
    for i, g in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{total:05d}.safetensors"
        save_file(g, str(d / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in g})
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=1) + "\n")


def expert_bytes_int4(hidden_size: int, moe_intermediate_size: int) -> int:
    """Bytes of one routed expert in the INT4 checkpoint (packed values + bf16 scales)."""
    n = 3 * hidden_size * moe_intermediate_size
    return n // 2 + 2 * n // GROUP_SIZE + 3 * 8


__all__ = ["RandomWeights", "expert_bytes_int4", "kimi_tensors", "save_sharded", "text_tensors", "vision_tensors"]
