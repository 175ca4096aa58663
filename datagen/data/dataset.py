"""A dataset read into token ids and loss masks: its records, its rows, its fingerprints.

A row is a chat, tokenized with the model's chat template (``loss_mask`` = 1 on the tokens the
assistant produced), or pre-tokenized ``{"input_ids": [...], "loss_mask": [...]}``. A chat may be
written as OpenAI messages (with ``tools``), ShareGPT conversations or UltraChat turns
(``datagen.data.row_formats``); the rows may be a JSONL or JSON file, a folder of them or a Hugging
Face dataset on disk (``datagen.data.dataset_files``). A user message's content may be a list of
text and image parts (``datagen.data.media``).

Every row is read and checked before any model weight is loaded: a bad row
stops the run with its line number and what to fix, before anything is written.

This module holds what a dataset becomes (``Sample``, ``PreparedDataset``), the reading of a JSONL
file into rows, and the fingerprints a plan records (the dataset's, the tokenizer's and its chat
template's). What a row may hold is checked in ``datagen.data.row_checks``; a chat is rendered with
its template in ``datagen.data.chat_template`` and tokenized with its loss mask in
``datagen.data.chat_tokens``; ``datagen.data.planning`` plans a whole dataset on every core.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from datagen.data import dataset_files
from datagen.data.contract import SkippedRow, TruncatedRow
from datagen.data.dataset_files import empty_dataset, parse_row  # noqa: F401 - read here too
from datagen.errors import DatasetError


@dataclass(frozen=True)
class Sample:
    """One tokenized row."""

    row: int  # 0-based line number in the dataset file
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    media: tuple = ()  # datagen.data.media.MediaItem per image of the row, in token order


@dataclass
class PreparedDataset:
    """A whole dataset, read, checked and tokenized."""

    path: str
    rows: int  # number of lines (rows) in the file
    fingerprint: str  # sha256 of the file's bytes
    samples: dict[int, Sample]  # row -> sample, rows not skipped
    skipped: list[SkippedRow]
    truncated: list[TruncatedRow]
    line_hashes: list[bytes]  # each row's identity (planning_rows.row_identity), 32 bytes
    chat_template_hash: str | None  # sha256 of the chat template when chat rows exist
    tokenizer_hash: str | None  # tokenizer_fingerprint() when chat rows exist
    kinds: set[str] = field(default_factory=set)  # {"chat", "tokens"}
    # how the rows were stored and written: "<container>/<row formats>", e.g. "jsonl/sharegpt",
    # "hf-disk/messages" (datagen.data.dataset_files, datagen.data.row_formats); None when not read
    format: str | None = None
    # the tokens of every sample, when ``samples`` holds only some rows (a stored plan's shards)
    total_tokens: int | None = None

    def shard_rows_hash(self, first: int, count: int) -> str:
        """sha256 over the identities of rows [first, first+count)."""
        h = hashlib.sha256()
        for d in self.line_hashes[first : first + count]:
            h.update(d)
        return h.hexdigest()

    @property
    def tokens(self) -> int:
        if self.total_tokens is not None:
            return self.total_tokens
        return sum(len(s.input_ids) for s in self.samples.values())


TokenizerLoader = Callable[[], object]


def check_file(path: str | Path) -> Path:
    """The dataset path as a file, or the error that says what it is instead."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(
            "dataset file does not exist" if not p.exists() else "dataset path is not a file",
            path=str(p),
            hint="pass a JSONL file with --dataset",
        )
    return p


def read_rows(path: str | Path, *, digest=None) -> list[tuple[int, bytes, dict]]:
    """Parse each line of a JSONL file. Returns (row, raw bytes, object) per line.

    ``digest`` (a hashlib object), when given, is fed every byte read: the fingerprint of exactly
    the content parsed, even if the file changes while it is read. (Planning reads the lines in
    its worker processes instead: ``datagen.data.planning``.)
    """
    p = check_file(path)
    out = []
    with p.open("rb") as f:
        for i, raw in enumerate(f):
            if digest is not None:
                digest.update(raw)
            out.append((i, raw.rstrip(b"\r\n"), parse_row(raw, path=str(p), line=i + 1)))
    if not out:
        raise empty_dataset(p)
    return out


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what decides token ids: a fast tokenizer's serialized state, else the class,
    the vocabulary and the added tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if getattr(tokenizer, "is_fast", False) and backend is not None:
        return hashlib.sha256(backend.to_str().encode()).hexdigest()
    added = {int(i): str(t) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    state = {"class": type(tokenizer).__name__, "vocab": sorted(tokenizer.get_vocab().items()),
             "added": sorted(added.items())}
    return hashlib.sha256(json.dumps(state, ensure_ascii=False).encode()).hexdigest()


def tokenizer_hashes(tokenizer) -> tuple[str, str]:
    """(sha256 of the chat template, ``tokenizer_fingerprint``): what a plan records of a tokenizer."""
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest(), tokenizer_fingerprint(tokenizer)


def file_fingerprint(path: str | Path) -> str:
    """sha256 of a dataset as it is now (``PreparedDataset.fingerprint`` is this at read time): a
    file's bytes, or every file of a folder or a Hugging Face dataset (``dataset_files.fingerprint``)."""
    return dataset_files.fingerprint(dataset_files.parse_ref(path))
