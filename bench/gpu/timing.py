"""The timing the GPU benches share (``run.py``'s plain stage, ``kimi.py wide-bench``, ``media.py``):
plain vLLM prefill and the project's extraction, each on one started engine, timed pass by
pass in tokens per second.

Plain prefill is ``LLM.generate`` (one sampled token, nothing captured) on the extraction engine's
own arguments less the capture's; extraction is the real engine's shard loop (``extract_shards``:
patches, capture, shard writer), the manifest written after the clock stops.
"""

from __future__ import annotations

import time
from typing import Literal


def sync_device() -> None:
    """Wait for the GPU's queued work (nothing to wait for on the CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def plain_prefill(eng, prompts, *, tokens: int, repeats: int, warmup: int,
                  until: Literal["returned", "synced"] = "returned") -> tuple[list[float], float]:
    """Plain vLLM prefill with ``eng``'s settings, started once and shut down after.

    Args:
        eng: a VllmEngine, not started: its ``engine_kwargs()`` less the capture worker and config.
        prompts: the prompts (vLLM ``TokensPrompt``s).
        tokens: the prompts' tokens, all together.
        repeats: timed passes over all the prompts, after one untimed pass over the first ``warmup``.
        until: when a pass's clock stops: when ``generate`` returns, or (``"synced"``, as
            ``run.py`` times it) after the device's queued work has finished too.

    Returns:
        Tokens per second of each timed pass, and the seconds ``LLM(...)`` took to start.
    """
    import torch
    from vllm import LLM, SamplingParams

    kwargs = eng.engine_kwargs()
    kwargs.pop("worker_extension_cls")
    kwargs.pop("additional_config")
    t0 = time.time()
    llm = LLM(**kwargs)
    start_s = time.time() - t0
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    llm.generate(prompts[:warmup], sp, use_tqdm=False)
    rates = []
    for _ in range(repeats):
        sync_device()
        t0 = time.time()
        llm.generate(prompts, sp, use_tqdm=False)
        if until == "synced":
            sync_device()
        rates.append(tokens / (time.time() - t0))
    llm.llm_engine.engine_core.shutdown()
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rates, start_s


def extraction(eng, warm, plans, *, tokens: int) -> tuple[list[float], list[float]]:
    """The project's extraction on the started ``eng``: shard 0 of the plan ``warm`` untimed, then
    one timed pass per plan of ``plans``, each into its own (claimed) output.

    ``plans`` may be a generator: each plan is made when its pass starts, after the one before has
    finished (and whatever the generator does between them, such as removing its output, is not timed).

    Returns:
        Tokens per second and bytes written per second of each pass.
    """
    from datagen.extraction.manifest import write_manifest
    from datagen.extraction.output import claim_output
    from datagen.extraction.run import build_job, extract_shards

    claim_output(warm)
    eng.submit(build_job(warm, 0))
    eng.finish()
    rates, written = [], []
    for p in plans:
        claim_output(p)
        t0 = time.time()
        records = extract_shards(p, eng, range(p.num_shards))
        dt = time.time() - t0
        write_manifest(p, records)
        rates.append(tokens / dt)
        written.append(sum(r.bytes for r in records.values()) / dt)
    return rates, written


def dd_direct(work, mb: int) -> dict:
    """``dd oflag=direct`` of ``mb`` MB into ``work``: its last line and the rate it names (the disk bound)."""
    import subprocess
    from pathlib import Path

    target = Path(work) / "ddtest"
    proc = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={max(1, mb // 16)}", "oflag=direct"],
                          capture_output=True, text=True)
    target.unlink(missing_ok=True)
    line = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return {"dd": line, "dd_bytes_per_s": _dd_rate(line)}


def _dd_rate(line: str) -> float | None:
    # "... bytes (...) copied, 3.1 s, 1.4 GB/s"
    try:
        n, unit = line.rsplit(",", 1)[1].split()
        return float(n) * {"kB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12}[unit]
    except (ValueError, KeyError, IndexError):
        return None
