"""The capture alone on a GPU, without vLLM: correctness, peak memory per step, and its own rate.

    python3 bench/gpu/capture_check.py --out $OUT [--shards-dir /dev/shm/cc]   # torch + safetensors + pydantic

Feeds ``datagen.engines.capture.Capture`` the way the worker extension does (a group announced,
then steps of the step budget, each request's states in chunks), at Kimi-K2.5's width (hidden 7168,
4 layers, 16,384 tokens per step) and the 8B shape's (hidden 4096), bf16 and fp8 storage. Checks
that every shard holds exactly the states fed (bf16 byte for byte; fp8 within e4m3 rounding),
measures the extra GPU memory of one step (peak over what was allocated before it) at 1k, 4k and
16k tokens per step, and times capture + writing of the group (tokens/s, GB/s written): the rate
the engine loop cannot exceed whatever the model. Writes capture-check.json under --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def _runner(device, req_ids, prompts):
    return SimpleNamespace(device=device, input_batch=SimpleNamespace(req_ids=req_ids),
                           requests={r: SimpleNamespace(prompt_token_ids=p) for r, p in prompts.items()})


def run_shape(hidden: int, storage: str, root: Path, *, rows: int, row_len: int, per_shard: int, budget: int,
              device: str, writers: int, host_gib: float = 16.0) -> dict:
    import numpy as np
    import torch

    from datagen.data.shards.format import ShardJob
    from datagen.data.shards.kernels import dequantize_fp8
    from datagen.engines.capture import Capture
    from datagen.engines.vllm_settings import CaptureConfig, device_bytes

    dev = torch.device(device)
    layers = (2, 4, 5, 7)
    L = len(layers)
    cfg = CaptureConfig(layer_ids=layers, dtype="bfloat16", storage_dtype=storage, max_tokens=budget,
                        writers=writers, host_budget_bytes=int(host_gib * (1 << 30)))
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    ids = [rng.integers(3, 100000, size=row_len).astype(np.int32) for _ in range(rows)]
    rids = [f"r{i}" for i in range(rows)]
    prompts = {r: x.tolist() for r, x in zip(rids, ids)}
    runner = _runner(dev, [], prompts)
    cap = Capture(runner, cfg, hidden)
    res = {"hidden": hidden, "storage": storage, "device_bytes": cap.device_bytes(),
           "device_bytes_formula": device_bytes(cfg, hidden)}
    # the states fed: one [T, H] bf16 tensor per row and layer, on the device
    g = torch.Generator(device=dev).manual_seed(0)
    states = [torch.randn((row_len, L, hidden), generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)
              for _ in range(rows)]
    nshards = rows // per_shard
    wires = []
    for k in range(nshards):
        sl = slice(k * per_shard, (k + 1) * per_shard)
        job = ShardJob(index=k, path=str(root / f"shard-{k:06d}.safetensors"), first_row=k * per_shard,
                       rows=per_shard, sample_rows=tuple(range(k * per_shard, (k + 1) * per_shard)),
                       input_ids=tuple(ids[sl]), loss_masks=tuple(np.ones(row_len, np.uint8) for _ in ids[sl]),
                       layer_ids=layers, dtype=storage, hidden_size=hidden, shard_key=f"k{k}")
        wires.append({**job.to_wire(), "request_ids": rids[sl]})

    # the schedule: FCFS, each step fills the budget, a request may be split over steps
    steps, pos = [], [0] * rows
    i = 0
    while i < rows:
        left, step = budget, []
        while left and i < rows:
            c = min(left, row_len - pos[i])
            step.append((i, pos[i], c))
            pos[i] += c
            left -= c
            if pos[i] == row_len:
                i += 1
        steps.append(step)

    def feed(step):
        req = [rids[r] for r, _, _ in step]
        runner.input_batch.req_ids = req
        n = sum(c for _, _, c in step)
        aux = [torch.cat([states[r][a:a + c, j] for r, a, c in step]) for j in range(L)]
        so = SimpleNamespace(total_num_scheduled_tokens=n, num_scheduled_tokens={rids[r]: c for r, _, c in step},
                             req_ids=req)
        return so, aux

    # peak extra memory of one step at several sizes (its own group each, then dropped)
    peaks = {}
    if dev.type == "cuda":
        for n in (1024, 4096, budget):
            k = n // row_len
            cap.announce([{**wires[0], "request_ids": [f"p{n}-{x}" for x in range(per_shard)]}])
            for x in range(per_shard):
                runner.requests[f"p{n}-{x}"] = SimpleNamespace(prompt_token_ids=prompts[rids[x]])
            step = [(x, 0, row_len) for x in range(min(k, per_shard))]
            so, aux = feed(step)
            so.num_scheduled_tokens = {f"p{n}-{x}": row_len for x, _, _ in step}
            runner.input_batch.req_ids = list(so.num_scheduled_tokens)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            cap.on_step(so, aux)
            torch.cuda.synchronize()
            peaks[str(len(step) * row_len)] = torch.cuda.max_memory_allocated(dev) - before
            del aux
            for st in cap.requests.values():  # dropped unwritten: their pieces of the host ring go back
                for ch in st.chunks:
                    if ch.block is not None:
                        ch.block.release()
            cap.shards.clear()
            cap.requests.clear()
        cap.collect(True)
    res["peak_extra_bytes_by_step_tokens"] = peaks

    # the group: capture and write, timed
    for r in rids:
        runner.requests[r] = SimpleNamespace(prompt_token_ids=prompts[r])
    cap.announce([dict(w) for w in wires])
    fed = [feed(s) for s in steps]  # built before the clock: the model's work, not the capture's
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.time()
    for so, aux in fed:
        runner.input_batch.req_ids = so.req_ids
        if dev.type == "cuda":
            cap.before_step()  # as the worker does before each forward
        cap.on_step(so, aux)
    reply = cap.collect(True)
    dt = time.time() - t0
    if reply.errors:
        raise RuntimeError(reply.errors[0])
    recs = [r.model_dump() for r in reply.records]
    tokens = rows * row_len
    res.update(tokens=tokens, seconds=dt, tokens_per_s=tokens / dt, bytes=sum(r["bytes"] for r in recs),
               bytes_per_s=sum(r["bytes"] for r in recs) / dt, shards=len(recs), steps=len(steps),
               backpressure_s=reply.backpressure_s, host_outside_bytes=reply.host_outside_bytes)
    # every shard holds exactly what was fed
    from safetensors.torch import load_file

    from datagen.data.shards.kernels import _FP8_OUT, fp8_token_stats, layer_stats, token_stats

    worst = stats_err = 0.0
    for k in range(nshards):
        t = load_file(str(root / f"shard-{k:06d}.safetensors"))
        want = torch.cat([states[r].cpu() for r in range(k * per_shard, (k + 1) * per_shard)])
        if storage == "fp8_e4m3":
            got = dequantize_fp8(t["hidden_states"], t["hidden_states_scale"])
            err = ((got - want.float()).norm(dim=-1) / want.float().norm(dim=-1)).max().item()
            worst = max(worst, err)
            assert err < 0.06, f"shard {k}: fp8 error {err}"
        else:
            assert torch.equal(t["hidden_states"], want), f"shard {k}: states differ"
        # the record's statistics (computed on the device) against the stored values' on the host
        rec = next(r for r in recs if r["index"] == k)
        per = (fp8_token_stats(t["hidden_states"], t["hidden_states_scale"]) if storage == "fp8_e4m3"
               else token_stats(t["hidden_states"]))
        for got_s, ref_s in zip(rec["layer_stats"], layer_stats(t["hidden_states"], tuple(layers), per)):
            for key in ("sum", "sumsq", "absmax"):
                a, b = float(got_s[key]), float(getattr(ref_s, key))
                stats_err = max(stats_err, abs(a - b) / max(abs(b), 1e-30) if key != "sum" else
                                abs(a - b) / max((float(ref_s.sumsq) * ref_s.count) ** 0.5, 1e-30))
    assert stats_err < 1e-4, f"statistics differ from the stored values' by {stats_err}"
    res["stats_rel_err"] = stats_err
    res["fp8_division_stores"] = dict(_FP8_OUT)  # device -> whether a division stored fp8 directly
    res["worst_fp8_rel_err"] = worst if storage == "fp8_e4m3" else None
    res["states_equal"] = True
    shutil.rmtree(root, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shards-dir", default="/dev/shm/capture-check")
    ap.add_argument("--device", default=None)
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--host-gib", type=float, default=16.0,
                    help="the capture's pinned host ring (GiB); below a few steps' bytes the ring wraps and the "
                         "steps wait for the writers, and every shard must still hold exactly the states fed")
    ap.add_argument("--small", action="store_true", help="a CPU dry run: hidden 64, short rows")
    args = ap.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    shapes = [(64, "bfloat16"), (64, "fp8_e4m3")] if args.small else \
        [(7168, "bfloat16"), (7168, "fp8_e4m3"), (4096, "bfloat16"), (4096, "fp8_e4m3")]
    for hidden, storage in shapes:
        kw = dict(rows=16, row_len=64, per_shard=4, budget=256) if args.small else \
            dict(rows=64, row_len=1024, per_shard=8, budget=16384)
        t0 = time.time()
        r = run_shape(hidden, storage, Path(args.shards_dir), device=device, writers=args.writers,
                      host_gib=args.host_gib, **kw)
        r["wall_s"] = time.time() - t0
        results.append(r)
        print(f"hidden {hidden} {storage}: {r['tokens_per_s']:,.0f} tok/s, {r['bytes_per_s'] / 1e9:.2f} GB/s, "
              f"peak extra per step {r['peak_extra_bytes_by_step_tokens']}, buffers {r['device_bytes'] / 2**30:.2f} GiB, "
              f"fp8 err {r['worst_fp8_rel_err']}, waited for the writers {r['backpressure_s']:.2f} s, "
              f"outside the ring {r['host_outside_bytes']} B", flush=True)
    (out / "capture-check.json").write_text(json.dumps({"device": device, "results": results}, indent=1))


if __name__ == "__main__":
    main()
