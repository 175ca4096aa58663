"""The capture's per-step work without an engine (datagen.engines.capture): shards from chunked
steps, the tensor-parallel split of the writes, and the memory bound of the per-step kernels."""

from __future__ import annotations

import json
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from datagen.data.contract import ShardFormat
from datagen.data.shards.format import ShardJob
from datagen.data.shards.kernels import (
    dequantize_fp8,
    layer_stats,
    quantize_fp8,
    quantize_into,
    stats_into,
    token_stats,
    work_rows,
)
from datagen.engines.capture import Capture
from datagen.engines.vllm_settings import CaptureConfig, device_bytes

LAYERS = (1, 3, 4)
H = 48
ROWS = [5, 70, 33, 1, 90, 12, 40, 64]  # tokens per request; the step budget (64) splits several
PER_SHARD = 2
BUDGET = 64


def _group(root, storage):
    rng = np.random.default_rng(0)
    ids = [rng.integers(3, 400, size=n).astype(np.int32) for n in ROWS]
    states = [torch.randn(n, len(LAYERS), H).to(torch.bfloat16) for n in ROWS]
    rids = [f"q{i}-{i}" for i in range(len(ROWS))]
    wires = []
    for k in range(len(ROWS) // PER_SHARD):
        sl = slice(k * PER_SHARD, (k + 1) * PER_SHARD)
        job = ShardJob(index=k, path=str(root / f"shard-{k:06d}.safetensors"), first_row=k * PER_SHARD,
                       rows=PER_SHARD, sample_rows=tuple(range(sl.start, sl.stop)), input_ids=tuple(ids[sl]),
                       loss_masks=tuple(np.ones(len(x), np.uint8) for x in ids[sl]), format=ShardFormat(LAYERS, storage, H),
                       shard_key=f"k{k}")
        wires.append({**job.to_wire(), "request_ids": rids[sl]})
    return ids, states, rids, wires


def _steps(rids, states):
    """FCFS steps of BUDGET tokens; a request is split across steps (chunked prefill); the engine
    core ids carry a suffix, as vLLM 0.32 gives them."""
    pos, i, out = [0] * len(rids), 0, []
    while i < len(rids):
        left, step = BUDGET, []
        while left and i < len(rids):
            c = min(left, len(states[i]) - pos[i])
            step.append((i, pos[i], c))
            pos[i] += c
            left -= c
            if pos[i] == len(states[i]):
                i += 1
        out.append(step)
    for step in out:
        req = [f"{rids[r]}-abcd1234" for r, _, _ in step]
        so = SimpleNamespace(total_num_scheduled_tokens=sum(c for _, _, c in step),
                             num_scheduled_tokens={q: c for q, (_, _, c) in zip(req, step)})
        aux = [torch.cat([states[r][a:a + c, j] for r, a, c in step]) for j in range(len(LAYERS))]
        yield req, so, aux


def _run(tmp_path, storage, rank=0, world=1):
    ids, states, rids, wires = _group(tmp_path, storage)
    runner = SimpleNamespace(device=torch.device("cpu"), input_batch=SimpleNamespace(req_ids=[]),
                             requests={f"{r}-abcd1234": SimpleNamespace(prompt_token_ids=x.tolist())
                                       for r, x in zip(rids, ids)})
    cfg = CaptureConfig(shard=ShardFormat(LAYERS, storage, H), dtype="bfloat16", max_tokens=BUDGET, writers=2)
    cap = Capture(runner, cfg, H, rank, world)
    cap.announce([dict(w) for w in wires])
    for req, so, aux in _steps(rids, states):
        runner.input_batch.req_ids = req
        cap.on_step(so, aux)
    reply = cap.collect(True)
    assert not reply.errors, reply.errors
    assert reply.pending_requests == 0 and reply.pending_shards == ()
    return states, {r.index: r.model_dump() for r in reply.records}


@pytest.mark.parametrize("storage", ["bfloat16", "fp8_e4m3"])
def test_shards_hold_the_states_fed_in_chunks_with_their_statistics(tmp_path, storage):
    states, records = _run(tmp_path, storage)
    assert sorted(records) == [0, 1, 2, 3]
    for k, rec in records.items():
        t = load_file(str(tmp_path / f"shard-{k:06d}.safetensors"))
        want = torch.cat(states[k * PER_SHARD:(k + 1) * PER_SHARD])
        if storage == "fp8_e4m3":
            q, s = quantize_fp8(want)
            assert torch.equal(t["hidden_states"].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(t["hidden_states_scale"], s)
            stored = dequantize_fp8(q, s)
        else:
            assert torch.equal(t["hidden_states"], want)
            stored = want
        expect = layer_stats(stored, LAYERS)  # from the stored values, in one pass
        for got, exp in zip(rec["layer_stats"], expect):
            assert got["count"] == exp.count
            assert got["sum"] == pytest.approx(exp.sum, rel=1e-5, abs=1e-3)
            assert got["sumsq"] == pytest.approx(exp.sumsq, rel=1e-5)
            assert got["absmax"] == pytest.approx(exp.absmax, rel=1e-6)


def test_each_tensor_parallel_rank_writes_shard_k_mod_tp(tmp_path):
    for rank in (0, 1):
        out = tmp_path / f"r{rank}"
        out.mkdir()
        states, records = _run(out, "bfloat16", rank=rank, world=2)
        assert sorted(records) == [k for k in range(4) if k % 2 == rank]
        assert sorted(p.name for p in out.iterdir()) == [f"shard-{k:06d}.safetensors" for k in sorted(records)]
        for k in records:
            t = load_file(str(out / f"shard-{k:06d}.safetensors"))
            assert torch.equal(t["hidden_states"], torch.cat(states[k * PER_SHARD:(k + 1) * PER_SHARD]))


def test_a_request_of_no_announced_shard_is_kept_apart_until_taken(tmp_path):
    runner = SimpleNamespace(device=torch.device("cpu"), input_batch=SimpleNamespace(req_ids=["x-1"]), requests={})
    cap = Capture(runner, CaptureConfig(shard=ShardFormat(LAYERS, "bfloat16", H), dtype="bfloat16",
                                        max_tokens=BUDGET, writers=1), H)
    so = SimpleNamespace(total_num_scheduled_tokens=3, num_scheduled_tokens={"x-1": 3})
    x = [torch.randn(3, H).to(torch.bfloat16) for _ in LAYERS]
    cap.on_step(so, x)
    got = torch.cat([c.host for c in cap.take_loose("x")])
    assert torch.equal(got, torch.stack(x, dim=1))
    assert cap.collect(True).records == () and not cap.requests


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of tensors that ops create (not their inputs), alive at once."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                n = t.untyped_storage().nbytes()
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, n)
        return out

    def _free(self, n):
        self.live -= n


@pytest.mark.parametrize("fp8", [False, True])
def test_the_per_step_kernels_peak_does_not_grow_with_the_step(fp8):
    """What the capture does on the device for one step and one layer: statistics (and fp8) into
    preallocated buffers through the fixed workspace. The memory it allocates besides them stays
    within a few values per chunk whatever the step's size; a float32 copy of the step (what
    token_stats once made: 1.5 GiB at Kimi width) would grow with it."""
    h = 1024
    peaks = {}
    for n in (256, 8192):
        x = torch.randn(n, h).to(torch.bfloat16)
        out = torch.empty(3, n)
        work = torch.empty(work_rows(h, n), h)
        q, s = torch.empty(n, h, dtype=torch.float8_e4m3fn), torch.empty(n)
        with _LiveBytes() as m:
            if fp8:
                quantize_into(x, q, s, out, work)
            else:
                stats_into(x, out, work)
        peaks[n] = m.peak
    chunk = work_rows(h)
    bound = 64 * chunk  # a few float32 values per token of one chunk (sums, scales, masks)
    assert peaks[8192] <= bound, peaks
    assert peaks[8192] < 8192 * h * 4 // 100  # far from a float32 copy of the step
    # and the old way is caught by the same measure
    with _LiveBytes() as m:
        x = torch.randn(8192, h).to(torch.bfloat16)
        f = x.float()
        torch.stack([f.sum(-1), (f * f).sum(-1), f.abs().amax(-1)], dim=-1)
    assert m.peak > bound


def test_the_statistics_in_chunks_equal_one_pass():
    x = torch.randn(300, 2, 40).to(torch.bfloat16)
    f = x.float()
    ref = torch.stack([f.sum(-1), (f * f).sum(-1), f.abs().amax(-1)], dim=-1)
    assert torch.equal(token_stats(x), ref)


def test_the_device_buffers_are_stated_at_kimi_width():
    cfg = CaptureConfig(shard=ShardFormat((2, 4, 5, 7), "bfloat16", 7168), dtype="bfloat16", max_tokens=16384)
    staged = 16384 * 4 * 7168 * 2
    assert staged <= device_bytes(cfg, 7168) <= staged + (64 << 20)
    fp8 = CaptureConfig(shard=ShardFormat((2, 4, 5, 7), "fp8_e4m3", 7168), dtype="bfloat16", max_tokens=16384)
    assert device_bytes(fp8, 7168) < 0.6 * device_bytes(cfg, 7168)


def test_the_capture_settings_travel_as_one_object_and_come_back_equal():
    from datagen.engines.vllm_settings import VllmSettings

    s = VllmSettings(shard=ShardFormat((2, 4), "fp8_e4m3", 16), dtype="bfloat16", max_seq_len=64,
                     max_num_batched_tokens=512, writers=3, host_budget_bytes=1 << 30)
    cfg = s.capture()
    wire = json.loads(json.dumps(cfg.to_additional_config()))  # vLLM's additional_config: JSON
    back = CaptureConfig.from_vllm_config(SimpleNamespace(additional_config=wire))
    assert back == cfg and back.max_tokens == 512 and back.storage_dtype == "fp8_e4m3"
    assert back.shard == s.shard and back.layer_ids == (2, 4)
    assert CaptureConfig.from_vllm_config(SimpleNamespace(additional_config=None)) is None
    with pytest.raises(ValueError, match="unknown keys"):
        CaptureConfig.from_dict({**cfg.to_additional_config()["datagen_capture"], "layer": 1})


@pytest.mark.parametrize("fp8", [False, "direct", "chunked"], ids=["bf16", "fp8", "fp8-chunked-division"])
def test_the_gpu_kernels_store_what_the_chunked_ones_store(fp8, monkeypatch):
    """The CUDA path (one absmax reduction of the states, no clamp, reductions without a float32
    copy) run here on CPU tensors: the same fp8 bytes and scales as the chunked path, statistics
    equal to float32 rounding; an all-zero token keeps scale 1."""
    from datagen.data.shards import kernels as shards
    from datagen.data.shards.kernels import _norms_into, _quantize_cuda

    monkeypatch.setitem(shards._FP8_OUT, "cpu", fp8 != "chunked")  # noqa: SLF001 (both division paths)

    torch.manual_seed(0)
    x = (torch.randn(700, 96) * torch.logspace(-3, 3, 700).unsqueeze(-1)).to(torch.bfloat16)
    x[5] = 0
    x[9, 3] = -x[9].float().abs().max() * 2  # the absmax negative: |x / s| = 448 exactly
    work = torch.empty((64, 96), dtype=torch.float32)
    ref, got = torch.empty((3, 700)), torch.empty((3, 700))
    if fp8:
        q0, s0 = torch.empty((700, 96), dtype=torch.float8_e4m3fn), torch.empty(700)
        q1, s1 = torch.empty_like(q0), torch.empty_like(s0)
        quantize_into(x, q0, s0, ref, work)
        _quantize_cuda(x, q1, s1, got, work)
        assert torch.equal(q0.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s0, s1)
        assert s1[5] == 1 and not q1.float().isnan().any()
    else:
        stats_into(x, ref, work)
        _norms_into(x, got, 0, 700)
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=0)


def test_the_pinned_ring_reuses_its_pieces_in_order_and_waits_only_for_a_pending_write():
    """The host arena of the CUDA path (here unpinned: the ring's bookkeeping is the same): pieces
    come back once they and every older piece are written, the ring wraps, a full ring waits
    while a write is pending and otherwise sends the copy outside it."""
    import threading
    import time

    from datagen.engines.capture_host import HostArena

    A = HostArena.ALIGN
    ring = HostArena(4 * A, pin=False)
    never = lambda: False  # noqa: E731

    def take(r, nbytes, pending):  # a piece for one step's copy of nbytes
        region, _, waited = r.take([torch.empty(nbytes, dtype=torch.uint8)], pending)
        return region, waited

    # views of several dtypes, page-aligned, hold what is written into them
    a, (x, none, y), _ = ring.take([torch.empty((3, 5), dtype=torch.bfloat16), None, torch.empty(7)], never)
    b, _ = take(ring, A, never)
    assert (a[0], b[0]) == (0, 2 * A) and none is None
    assert x.data_ptr() == ring.buf.data_ptr() and y.data_ptr() == ring.buf.data_ptr() + A
    x.copy_(torch.arange(15, dtype=torch.bfloat16).view(3, 5))
    y.copy_(torch.full((7,), 2.5))
    assert torch.equal(x, torch.arange(15, dtype=torch.bfloat16).view(3, 5)) and torch.equal(y, torch.full((7,), 2.5))
    # the newer piece freed first gives nothing back while the older one is held
    ring.free(b)
    c, _ = take(ring, A, never)
    assert c[0] == 3 * A
    # full, nothing pending: the copy goes outside the ring, into tensors of its own
    region, (outside,), _ = ring.take([torch.empty(2 * A, dtype=torch.uint8)], never)
    assert region is None and ring.outside_bytes == 2 * A and outside.shape == (2 * A,)
    ring.free(a)  # a and b are free now: the ring wraps to its start
    d, _ = take(ring, 3 * A, never)
    assert d[0] == 0
    # full, a write pending that frees a piece: the step waits for it, then gets that space
    threading.Timer(0.2, ring.free, args=(c,)).start()
    t0 = time.perf_counter()
    e, waited = take(ring, A, lambda: True)
    assert e[0] == 3 * A and waited >= 0.15 and time.perf_counter() - t0 >= 0.15
    ring.free(d)
    ring.free(e)
    assert not ring.live and take(ring, 4 * A, never)[0][0] == 0
    assert take(HostArena(A, pin=False), 2 * A, lambda: True)[0] is None  # larger than the ring: never fits


def test_a_group_running_longer_than_the_collect_interval_fetches_its_records_while_it_runs(monkeypatch):
    """VllmEngine._finish_running steps the engine until the group's requests finish and, every
    COLLECT_EVERY_S meanwhile, fetches the workers' finished records without waiting, so a long
    group's shards are kept as they are written, not all after it. The mechanism on a stand-in
    engine whose steps take 0.6 s each (no vLLM engine starts): three requests, one finishing per
    step; after the second step more than a second has passed with one request left."""
    import time

    from datagen.engines import vllm_engine
    from datagen.engines.vllm_engine import VllmEngine
    from datagen.engines.vllm_settings import INTERNAL

    monkeypatch.setattr(vllm_engine, "COLLECT_EVERY_S", 1.0)
    steps, added, collected = [], [], []

    class StandIn:  # LLMEngine: requests in, one finished per step
        def add_request(self, rid, prompt, params):
            added.append(rid)

        def has_unfinished_requests(self):
            return len(steps) < len(added)

        def step(self):
            time.sleep(0.6)
            steps.append(time.monotonic())
            return [SimpleNamespace(finished=True)]

    engine = object.__new__(VllmEngine)  # its __init__ checks the installed vLLM
    engine._group, engine._run, engine._submitted = [], 0, 0
    engine.config = SimpleNamespace(capture_path=INTERNAL)
    engine.llm = SimpleNamespace(llm_engine=StandIn(), collective_rpc=lambda name, args: [])
    monkeypatch.setattr(engine, "_take", lambda wires: [])
    monkeypatch.setattr(engine, "_collect", lambda *, wait: collected.append((len(steps), wait)))
    job = SimpleNamespace(index=0, input_ids=[np.array(ids) for ids in ([1, 2], [3], [4, 5, 6])], media=None,
                          to_wire=lambda: {"index": 0})
    monkeypatch.setattr(engine, "_render_one", lambda prompt: prompt)  # the stand-in takes vLLM's prompt as is
    engine._group = [job]
    engine._run_group()  # renders and adds the group, which then computes while the caller goes on
    assert len(added) == 3 and steps == [] and engine._group == []
    engine._finish_running()
    engine.close()
    assert len(steps) == 3
    assert collected == [(2, False)]  # once, after the second step (1.2 s, a request left), never after the last
