"""Chats whose assistant turns the target generated itself (greedy), for proving a draft.

A draft learns to predict the target; on chats the target wrote itself, the dataset's next token
is the target's greedy token, so held-out agreement measures what speculative decoding accepts.
The user turns are made from a fixed list of tasks and topics (seeded); the assistant turns are
written by the project's own regeneration step (`datagen regenerate`, vLLM, greedy), run as a
command so that its engine lives and dies in its own process. A finished regeneration is not run
again (the step's own resume), so the chats are made once per output directory.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

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


def write_self_generated_chats(model_dir: str | Path, out: str | Path, *, rows: int, max_new_tokens: int = 48,
                               seed: int = 0) -> Path:
    """Regenerate ``rows`` one-turn chats with ``model_dir`` into the directory ``out`` (`datagen
    regenerate`: greedy, ``max_new_tokens`` a turn). Returns the chats file the extraction reads,
    ``out/chats.jsonl``. Raises ``RuntimeError`` with the step's error when it fails."""
    import os
    import subprocess
    import sys

    from datagen.regeneration.output import CHATS, MANIFEST

    out = Path(out)
    if (out / CHATS).exists() and (out / MANIFEST).exists():
        return out / CHATS
    out.parent.mkdir(parents=True, exist_ok=True)
    users = out.with_name(out.name + ".users.jsonl")
    users.write_text("".join(json.dumps({"messages": [{"role": "user", "content": u}]}) + "\n"
                             for u in prompts(rows, seed=seed)))
    env = {**os.environ, "DATAGEN_ENFORCE_EAGER": "1"}  # a few hundred turns: no compile warm-up
    cmd = [sys.executable, "-m", "datagen", "regenerate", "--model", str(model_dir), "--dataset", str(users),
           "--out", str(out), "--max-new-tokens", str(max_new_tokens), "--temperature", "0",
           "--max-model-len", "1024"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"datagen regenerate failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    log.info("self-generated chats: %d rows in %s", rows, out)
    return out / CHATS
