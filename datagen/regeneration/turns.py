"""The as-generated layout: one pre-tokenized row per generated turn, as the engine saw it.

A generated turn's row is the prompt the engine was given (the conversation before the turn,
rendered by the chat template with its generation prompt, tokenized as extraction tokenizes a
render) followed by the ids the engine generated and the stop token that ended the turn. The loss
mask is 1 on the generated ids and the stop token, 0 on the prompt. These are the tokens, and the
context, that the target computes when it serves the conversation: a draft trained on them is
trained on what it will be asked to predict, whatever the template does to finished turns.
"""

from __future__ import annotations

from collections.abc import Callable


def turn_rows(prompt_of: Callable[[int], list[int]], turns: list[dict]) -> list[dict]:
    """The rows of one regenerated chat: ``turns`` is its lineage (message index, token_ids,
    stop_token for a turn that stopped); ``prompt_of(m)`` is the prompt the engine was given for the
    turn at message m."""
    rows = []
    for t in turns:
        prompt = list(prompt_of(t["message"]))
        generated = list(t["token_ids"]) + ([t["stop_token"]] if t.get("stop_token") is not None else [])
        rows.append({"message": t["message"], "input_ids": prompt + generated,
                     "loss_mask": [0] * len(prompt) + [1] * len(generated)})
    return rows
