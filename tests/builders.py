"""Builders for test inputs, each taking keyword overrides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from datagen.testmodels.tiny import TinyArch, make_chat_dataset, make_model

REPO = Path(__file__).resolve().parents[1]


def make_model_dir(root: Path, *, arch: str = "llama", num_layers: int = 6, seed: int = 0) -> Path:
    return make_model(Path(root) / "model", arch=TinyArch(arch), num_layers=num_layers, seed=seed)


def write_jsonl(path: Path, rows: list) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def token_rows(lengths: list[int], *, vocab: int = 400, seed: int = 0, masks: dict | None = None) -> list[dict]:
    """Pre-tokenized rows of the given lengths; ``masks`` maps a row to its loss mask."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, n in enumerate(lengths):
        ids = rng.integers(3, vocab, size=n).tolist()
        row = {"input_ids": ids}
        if masks and i in masks:
            row["loss_mask"] = masks[i]
        rows.append(row)
    return rows


def chat_dataset(path: Path, *, rows: int = 8, seed: int = 0) -> Path:
    return make_chat_dataset(path, rows=rows, seed=seed)


def datagen_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "datagen", *args]


def run_datagen(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `datagen ...` in a subprocess (vLLM spawns workers: it needs a real __main__)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(datagen_cmd(*args), capture_output=True, text=True, env=full_env, timeout=timeout, cwd=REPO)


def result_of(proc: subprocess.CompletedProcess) -> dict:
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("datagen-result: "):
            return json.loads(line[len("datagen-result: "):])
    raise AssertionError(f"no result line; exit {proc.returncode}\nstderr:\n{proc.stderr[-3000:]}")
