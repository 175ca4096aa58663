"""The timing the GPU benches share (``run.py``'s plain stage, ``kimi.py wide-bench``, ``media.py``):
plain vLLM prefill and the project's extraction, each on one started engine, timed pass by
pass in tokens per second.

Plain prefill is ``LLM.generate`` (one sampled token, nothing captured) on the extraction engine's
own arguments less the capture's; extraction is the real engine's shard loop (``extract_shards``:
patches, capture, shard writer), the manifest written after the clock stops.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Literal


def run_group(cmd: list[str], *, timeout: float, stdout_to=None, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)`` in a
    process group of its own, and the whole group killed when it ends or times out.

    A bench child starts vLLM, whose engine core and workers are processes of their own: killing
    the child alone on its timeout left the engine core holding 70 GiB of the GPU, and the next
    run on the machine failed with CUDA out of memory. The output goes to files, not pipes, so a
    process the child left behind cannot hold the call open. On the timeout, ``TimeoutExpired``
    carries the output so far (the per-pass lines say how far it got). ``stdout_to``: a path that
    keeps the child's stdout as it is written (a poll of a long run reads it), else a temporary file.
    """
    import tempfile

    out_file = open(stdout_to, "w+", errors="replace") if stdout_to else tempfile.TemporaryFile("w+", errors="replace")
    with out_file as out, tempfile.TemporaryFile("w+", errors="replace") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, text=True,
                                start_new_session=True, **kwargs)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc.pid)  # on the timeout, and whatever it left running (an engine core not shut down)
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


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


def extraction(eng, warm, plans, *, tokens: int, say=None) -> tuple[list[float], list[float]]:
    """The project's extraction on the started ``eng``: shard 0 of the plan ``warm`` untimed, then
    one timed pass per plan of ``plans``, each into its own (claimed) output.

    ``plans`` may be a generator: each plan is made when its pass starts, after the one before has
    finished (and whatever the generator does between them, such as removing its output, is not timed).

    ``say(i, tokens_per_s, bytes_per_s)``, if given, is called after each pass (a bench prints it, so
    that a run stopped by its timeout still says which passes it finished).

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
        if say is not None:
            say(len(rates) - 1, rates[-1], written[-1])
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
