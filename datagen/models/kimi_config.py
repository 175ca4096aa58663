"""Kimi-K2.5's config files at chosen sizes: ``config.json`` (the ``KimiK25ForConditionalGeneration``
wrapper around a DeepseekV3 ``text_config`` and a MoonViT ``vision_config``), the bf16 twin's
``config.json`` and ``generation_config.json``.

Every key and value but the sizes is the released checkpoint's; ``kimi_width()`` gives its real
sizes. ``datagen.testmodels.tiny_kimi`` writes these files into the tiny checkpoint; the tests build the
real-size config from them.
"""

from __future__ import annotations

from typing import Literal

GROUP_SIZE = 32  # INT4 group size of Kimi-K2.5's routed experts
BOS, EOS, PAD = 163584, 163585, 163839  # the real tokenizer's special ids (when the vocab holds them)
MEDIA_PLACEHOLDER = 163605
KIMI_K25_VOCAB = 163840

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


def model_config(text: dict, *, quantization: Literal["int4", "none"], vocab_size: int, vision: dict) -> dict:
    """The checkpoint's ``config.json``: the wrapper around ``text`` (``text_config``, with the INT4
    ``quantization_config`` for ``quantization="int4"``) and ``vision`` (``vision_config``)."""
    kimi_text = dict(text)
    if quantization == "int4":
        kimi_text["quantization_config"] = quantization_config()
    return {
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
        "vision_config": vision,
    }


def twin_config(text: dict) -> dict:
    """The bf16 twin's ``config.json``: ``text`` as a plain ``deepseek_v3`` (no remote code names)."""
    twin_cfg = dict(text)
    twin_cfg["model_type"] = "deepseek_v3"
    twin_cfg.pop("auto_map")
    return twin_cfg


def generation_config(text: dict) -> dict:
    """The checkpoint's ``generation_config.json``."""
    return {"bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"], "max_length": 262144}


__all__ = ["GROUP_SIZE", "IGNORE", "KIMI_K25_VOCAB", "generation_config", "kimi_width", "model_config",
           "quantization_config", "text_config", "twin_config", "vision_config"]
