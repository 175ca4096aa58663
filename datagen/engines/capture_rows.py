"""What a step hands the capture: one ``StepRows``, whatever the model runner.

The V1 runner's is made by ``step_rows_v1`` here (its ``execute_model_state``'s scheduler output
and aux states), Model Runner V2's by ``datagen.engines.capture_v2.step_rows_v2``; the capture
(datagen.engines.capture) consumes either the same way. No vLLM import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepRows:
    """One engine step's aux hidden states as a model runner's adapter hands them to the capture."""

    req_ids: tuple[str, ...]  # engine-core request ids, in batch order
    counts: tuple[int, ...]  # req_ids[i] -> its tokens in the step; its rows follow those of req_ids[i - 1]
    aux: Sequence[torch.Tensor]  # one per captured layer, layer order: [rows, H]; rows past sum(counts) unread
    prompt: Callable[[str], Sequence[int] | None]  # engine-core id -> the engine's prompt tokens (None: unknown)


def runner_prompt(runner) -> Callable[[str], Sequence[int] | None]:
    """The prompts of the V1 runner's cached requests (``runner.requests``: id -> state with
    ``prompt_token_ids``); the public path's shim holds the same."""

    def prompt(req_id: str):
        cached = runner.requests.get(req_id)
        return getattr(cached, "prompt_token_ids", None) if cached is not None else None

    return prompt


def step_rows_v1(runner, scheduler_output, aux_hidden_states) -> StepRows | None:
    """The V1 runner's step (docs/vllm-versions.md b, g): rows per request in
    ``runner.input_batch.req_ids`` order, ``scheduler_output.num_scheduled_tokens[req_id]`` each.
    None for a step without states.

    Raises:
        RuntimeError: the requests' tokens do not add up to the step's.
    """
    if aux_hidden_states is None or len(aux_hidden_states) == 0:  # never test a tensor list's truth
        return None
    n = int(scheduler_output.total_num_scheduled_tokens)
    if n == 0:
        return None
    req_ids = tuple(runner.input_batch.req_ids)
    counts = tuple(int(scheduler_output.num_scheduled_tokens.get(r, 0)) for r in req_ids)
    if sum(counts) != n:
        raise RuntimeError(f"batch layout mismatch: {sum(counts)} tokens by request, {n} scheduled")
    return StepRows(req_ids, counts, aux_hidden_states, runner_prompt(runner))
