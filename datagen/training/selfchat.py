"""Chats whose assistant turns the target generated itself (greedy), for proving a draft.

A draft learns to predict the target; on chats the target wrote itself, the dataset's next token
is the target's greedy token, so held-out agreement measures what speculative decoding accepts.
The user turns are made from a fixed list of tasks and topics (seeded); the assistant turn is the
target's greedy continuation under its own chat template, with transformers (float32 on the CPU).
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_TASKS = (
    "Write one sentence about {}.", "Give me a fun fact about {}.", "Describe {} in a few words.",
    "What is {}?", "List three things about {}.", "Why do people like {}?", "Write a short poem about {}.",
    "Explain {} to a child.", "What are the benefits of {}?", "Tell me a short story about {}.",
)
_TOPICS = (
    "the ocean", "a cat", "winter", "coffee", "the moon", "trains", "gardening", "music", "the sun", "rain",
    "mountains", "dogs", "bread", "the internet", "football", "bicycles", "chess", "volcanoes", "bees", "paper",
    "the desert", "libraries", "tea", "clouds", "photography", "rivers", "apples", "robots", "forests", "birds",
    "snow", "the city", "painting", "stars", "running", "cheese", "computers", "the wind", "islands", "honey",
)


def prompts(n: int, *, seed: int = 0) -> list[str]:
    """``n`` distinct user prompts (task x topic), in a seeded order."""
    every = [t.format(topic) for t in _TASKS for topic in _TOPICS]
    if n > len(every):
        raise ValueError(f"at most {len(every)} prompts, asked for {n}")
    random.Random(seed).shuffle(every)
    return every[:n]


@torch.no_grad()
def write_self_generated_chats(model_dir: str | Path, out: str | Path, *, rows: int, max_new_tokens: int = 48,
                               seed: int = 0, batch_size: int = 16) -> Path:
    """Write ``rows`` chats (JSONL ``{"messages": [user, assistant]}``) whose assistant turn is the
    model's greedy reply to the user turn. Returns ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    users = prompts(rows, seed=seed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w") as f:
        for i in range(0, rows, batch_size):
            chunk = users[i:i + batch_size]
            texts = [tok.apply_chat_template([{"role": "user", "content": u}], tokenize=False,
                                             add_generation_prompt=True) for u in chunk]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            for u, g in zip(chunk, gen[:, enc["input_ids"].shape[1]:]):
                reply = tok.decode(g, skip_special_tokens=True).strip()
                f.write(json.dumps({"messages": [{"role": "user", "content": u},
                                                 {"role": "assistant", "content": reply}]}) + "\n")
            log.info("self-generated chats: %d/%d", min(i + batch_size, rows), rows)
    tmp.replace(out)
    return out
