"""The extraction's scheduler (``datagen.engines.vllm_window.WindowScheduler``) on vLLM's own
``Scheduler``, driven without a model by ``bench.scheduler_window``: a group's requests arrive at
random between steps, and each step's batch is compared with the one the group makes when every
request is there before the first step. Text rows: the same steps under every arrival, equal to the
held group's. Image rows: the same steps under every arrival. vLLM's plain ``Scheduler`` fed the
same way fails the first (its steps follow the arrival)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

ARRIVALS = 3


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    from bench.gpu.media import make_tiny
    from bench.scheduler_window import scheduler_config

    return scheduler_config(str(make_tiny(tmp_path_factory.mktemp("window"), "none")))  # the tiny Kimi-K2.5


def test_text_rows_step_as_the_held_group_under_every_arrival(cfg):
    from bench.scheduler_window import group_rows, group_steps

    rows = group_rows("text")
    held, _ = group_steps(cfg, rows, "held", 0)
    waits = 0
    for seed in range(ARRIVALS):
        steps, stalls = group_steps(cfg, rows, "datagen", seed)
        assert steps == held, f"arrival {seed}"
        waits += stalls
    assert waits > 0  # the requests did stream in: some steps had to wait for them


def test_requests_let_in_as_they_arrive_follow_the_arrival(cfg):
    """What the window is for: the plain scheduler's batches depend on when the requests came."""
    from bench.scheduler_window import group_rows, group_steps

    rows = group_rows("text")
    held, _ = group_steps(cfg, rows, "held", 0)
    assert any(group_steps(cfg, rows, "arrival", seed)[0] != held for seed in range(ARRIVALS))


@pytest.mark.parametrize("kind", ["images", "images-large"])
def test_image_rows_step_the_same_under_every_arrival(cfg, kind):
    from bench.scheduler_window import group_rows, group_steps

    rows = group_rows(kind)
    runs = [group_steps(cfg, rows, "datagen", seed)[0] for seed in range(ARRIVALS)]
    assert all(r == runs[0] for r in runs[1:])
    assert runs[0] == group_steps(cfg, rows, "window", 0)[0]  # the design's steps, driven by hand


def test_a_group_cut_short_lets_the_requests_it_has_go(cfg):
    """A group whose adding failed midway: the requests it added are aborted, the window no longer
    waits for the group's end, and the next group runs."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    from datagen.engines.vllm_window import WindowScheduler, group_params

    kv = KVCacheConfig(num_blocks=10_000, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16))])
    sched = WindowScheduler(cfg, kv, StructuredOutputManager(cfg), block_size=16)
    budget = sched.max_num_scheduled_tokens

    def request(name, n, last):
        return Request(name, list(range(1, n + 1)), group_params(SamplingParams(max_tokens=1), last), None)

    sched.add_request(request("a0", budget // 4, False))
    sched.add_request(request("a1", budget // 4, False))
    assert not sched.has_requests()  # held: half a step's tokens, the group's end not here
    assert not sched.schedule().num_scheduled_tokens
    sched.add_request(request("a2", budget, False))  # the step's budget is reached: it runs
    assert sched.has_requests()
    sched.finish_requests(["a0", "a1", "a2"], RequestStatus.FINISHED_ABORTED)
    assert not sched.schedule().num_scheduled_tokens  # the step that reports them finished
    assert not sched.has_requests()
    sched.add_request(request("b0", 8, True))  # the next group, a whole one of one short request
    assert sched.has_requests() and dict(sched.schedule().num_scheduled_tokens) == {"b0": 8}

    plain = WindowScheduler(cfg, kv, StructuredOutputManager(cfg), block_size=16)
    plain.add_request(Request("c", [1, 2, 3], SamplingParams(max_tokens=1), None))  # no group: straight in
    assert dict(plain.schedule().num_scheduled_tokens) == {"c": 3}
