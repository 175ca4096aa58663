"""A range of a dataset's rows planned, in whichever process plans it (``datagen.data.planning``).

A worker reads its byte range itself and checks that its bytes are the ones the calling process
hashed (or takes its rows from the ``Records`` read whole before it was forked), parses them, brings
each to its normal form (``datagen.data.row_formats``) and identifies it (``row_identity``), checks each row, tokenizes its chats in
batches of ``TOKENIZE_BATCH`` and packs their tokens into a ``_Batch`` (the rows of an earlier plan
whose bytes did not change, ``Reuse``, keep their tokens). A row that raises stops the range and is
named; ``_raise_row_error`` plans it again in the calling process, alone, so that it raises its
own error.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from datagen.data import chat_tokens, media, media_identity, media_tokens, row_checks, row_formats
from datagen.data import dataset as ds
from datagen.data.chat_tokens import Boundaries, SplitTokens
from datagen.data.contract import SkippedRow, TruncatedRow
from datagen.data.dataset_files import Records
from datagen.data.row_formats import RowFormat
from datagen.errors import DatasetError, ModelError

# Rows tokenized in one call (a call's texts and tokens stay bounded whatever the range holds).
TOKENIZE_BATCH = 2048


def row_identity(normal: dict, base: Path | None = None) -> bytes:
    """A row's identity: what the plan records of it (``PreparedDataset.line_hashes``, the shard
    keys) and what an earlier plan's row must match to be reused. The sha256 of its normal form
    (``row_formats.identity``: the same chat in any format is the same row; a changed tool schema
    is a changed row). A row with images hashes their bytes in too (``media_identity.identity``;
    relative paths from ``base``, the row's file's directory): a changed image re-extracts its shard."""
    return media_identity.identity(row_formats.identity(normal), normal, base or Path("."))


@dataclass(frozen=True)
class Known:
    """A row's outcome in an earlier plan of the same tokenizer, template and settings."""

    sample: ds.Sample | None  # its tokens (truncated as then), None when it was skipped
    skipped: SkippedRow | None = None
    truncated: TruncatedRow | None = None


class Reuse(Protocol):
    """Outcomes of rows whose bytes an earlier plan tokenized (``datagen.extraction.stored``)."""

    def known(self, first: int, line_hashes: list[bytes]) -> dict[int, Known]:
        """The known outcomes among rows ``first, first+1, ...`` of these identities (called in
        the worker that plans them: it reads only what its range needs). Never raises: a row it
        cannot give is tokenized."""
        ...


@dataclass(frozen=True)
class _Range:
    """Bytes [start, stop) of the file: whole lines, the first of them row ``first``."""

    first: int
    start: int  # (rows [start, stop) of the job's records, when it has them)
    stop: int
    sha256: bytes  # of those bytes, as the calling process read them


@dataclass
class _Batch:
    """What a worker sends back for a range: packed samples and the rest per row."""

    first: int
    rows: np.ndarray  # int64 [S]: the rows that became samples
    offsets: np.ndarray  # int64 [S+1]
    ids: np.ndarray  # int32 [T]
    mask: np.ndarray  # uint8 [T]
    line_hashes: bytes = b""  # row_identity of each row of the range, 32 bytes each
    skipped: list[SkippedRow] = field(default_factory=list)
    truncated: list[TruncatedRow] = field(default_factory=list)
    kinds: set[str] = field(default_factory=set)
    row_formats: set[str] = field(default_factory=set)  # RowFormat values of its rows
    tokenized: bool = False  # a chat row needed the tokenizer
    reused: int = 0  # chat rows taken from the earlier plan
    changed: bool = False  # the range's bytes are not those the calling process hashed
    # the first row that raised, and its line as read; the caller raises it again
    error_row: int | None = None
    error_line: bytes = b""
    parse_error: bool = False  # the line is not a JSON object
    no_tokenizer: bool = False  # a chat row needed the tokenizer and none was loaded
    media: dict = field(default_factory=dict)  # row -> its images (media.MediaItem), image rows only


@dataclass
class _Job:
    """Everything a worker reads: set before the workers fork, so they share it."""

    path: str
    tokenizer: object | None
    vocab_size: int
    max_seq_len: int
    split_tokens: SplitTokens | None
    reuse: Reuse | None
    records: Records | None = None  # the rows, read whole (every container but a single JSONL file)
    row_format: RowFormat | None = None  # the format every row must be of (the dataset's options)

    def where(self, row: int) -> tuple[str, int]:
        """(file, 1-based line) of a row, as its errors name it."""
        return self.records.where(row) if self.records is not None else (self.path, row + 1)


_JOB: _Job | None = None


class _NoTokenizer(RuntimeError):
    """A chat row needs the tokenizer, and none was loaded (it is loaded again to say why)."""


def _normal(job: _Job, obj: dict, row: int) -> tuple[RowFormat, dict]:
    """The row's format and normal form (``row_formats.normalise``), of the format the options name."""
    path, line = job.where(row)
    fmt, normal = row_formats.normalise(obj, path=path, line=line)
    if job.row_format is not None and fmt is not job.row_format:
        raise DatasetError(f"row is a {fmt.value} row, and the dataset's options name {job.row_format.value}",
                           path=path, line=line, hint="write every row in the format named, or leave format out")
    return fmt, normal


def _row(job: _Job, fmt: RowFormat, obj: dict, row: int, known: Known | None, state: dict):
    """One row's outcome (``obj`` its normal form), checked as ``prepare_dataset`` always has
    (raising for a bad row): ("sample", ids, mask, truncated), ("skipped", reason), or
    ("chat", messages, tools) to tokenize."""
    path, line = job.where(row)
    state["formats"].add(fmt.value)
    if fmt is not RowFormat.TOKENS:
        msgs = row_checks._check_messages(obj, path=path, line=line)
        tools = obj.get("tools")
        state["kinds"].add("chat")
        if not msgs:
            return ("skipped", "empty")
        state["tokenized"] = True
        if media.has_media(obj):  # images: read, counted and expanded (datagen.data.media_tokens)
            if job.tokenizer is None:
                raise _NoTokenizer(row)
            return media_tokens.plan_row(job.tokenizer, msgs, row=row, path=path, line=line, tools=tools,
                                         max_seq_len=job.max_seq_len, tokenize_chat=chat_tokens.tokenize_chat)
        if known is not None:
            state["reused"] += 1
            if known.sample is None:
                return ("skipped", known.skipped.reason)
            return ("sample", known.sample.input_ids, known.sample.loss_mask, known.truncated)
        if job.tokenizer is None:
            raise _NoTokenizer(row)
        return ("chat", msgs, tools)
    ids, mask = row_checks._check_tokens_row(obj, path=path, line=line, vocab_size=job.vocab_size)
    state["kinds"].add("tokens")
    return _truncate(job, row, ids, mask)


def _truncate(job: _Job, row: int, ids: np.ndarray, mask: np.ndarray):
    if len(ids) == 0:
        return ("skipped", "empty")
    truncated = None
    if len(ids) > job.max_seq_len:
        truncated = TruncatedRow(row=row, original_tokens=len(ids), kept_tokens=job.max_seq_len)
        ids, mask = ids[: job.max_seq_len], mask[: job.max_seq_len]
    return ("sample", ids, mask, truncated)


def _finish(job: _Job, row: int, outcome, batch: _Batch, samples: list) -> None:
    if outcome[0] == "skipped":
        batch.skipped.append(SkippedRow(row=row, reason=outcome[1]))
        return
    _, ids, mask, truncated, *images = outcome
    if images:
        batch.media[row] = images[0]
    if truncated is not None:
        batch.truncated.append(truncated)
    if not mask.any():
        batch.skipped.append(SkippedRow(row=row, reason="no_target"))
        return
    # (a pre-tokenized row's ids were checked against the vocabulary already)
    if int(ids.max()) >= job.vocab_size:
        raise ModelError(
            f"the tokenizer produced id {int(ids.max())} but the model's vocabulary has "
            f"{job.vocab_size} entries", hint="use the tokenizer that belongs to this model",
        )
    samples.append((row, ids, mask))


def _read_range(job: _Job, r: _Range) -> tuple[list[bytes], bool] | None:
    """The range's lines (without their "\\n") and whether its last one ends with one, or None
    when its bytes are not those hashed."""
    with open(job.path, "rb") as f:
        f.seek(r.start)
        data = f.read(r.stop - r.start)
    if hashlib.sha256(data).digest() != r.sha256:
        return None
    lines = data.split(b"\n")
    ends = data.endswith(b"\n")
    if ends:
        lines.pop()
    return lines, ends


def _parse(line: bytes):
    """The line's JSON object, or None (``ds.parse_row`` then says what is wrong with it)."""
    try:
        obj = json.loads(line.decode("utf-8"))
    except Exception:  # noqa: BLE001 - said again by ds.parse_row in the calling process
        return None
    return obj if isinstance(obj, dict) else None


def _plan_range(r: _Range) -> _Batch:
    """The range's rows: read, parsed (a line that is not a JSON object stops it before any row is
    checked, as a whole-file parse did), brought to their normal form and identified, then checked,
    tokenized in batches and finished in order. Stops at the first row that raises and names it."""
    job = _JOB
    batch = _Batch(r.first, *_pack([]))
    if job.records is not None:
        objs, as_read = job.records.rows[r.start : r.stop], (lambda k: b"")
    else:
        read = _read_range(job, r)
        if read is None:
            batch.changed = True
            return batch
        lines, ends = read

        def as_read(k: int) -> bytes:  # line k with its line end
            return lines[k] + b"\n" if k < len(lines) - 1 or ends else lines[k]

        objs = []
        for k, line in enumerate(lines):
            obj = _parse(line)
            if obj is None:
                batch.error_row, batch.parse_error = r.first + k, True
                batch.error_line = as_read(k)
                return batch
            objs.append(obj)
    normals, bad = [], None
    for k, obj in enumerate(objs):
        try:
            normals.append(_normal(job, obj, r.first + k))
        except Exception:  # noqa: BLE001 - the caller raises it again from this row alone
            bad = k
            break
    base = Path(job.path).parent
    hashes = [row_identity(n, base if job.records is None else Path(job.where(r.first + k)[0]).parent)
              for k, (_, n) in enumerate(normals)]
    batch.line_hashes = b"".join(hashes)
    known = job.reuse.known(r.first, hashes) if job.reuse is not None else {}
    state = {"kinds": batch.kinds, "formats": batch.row_formats, "tokenized": False, "reused": 0}
    samples: list = []
    failed_at = None
    for a in range(0, len(normals), TOKENIZE_BATCH):
        rows = range(r.first + a, r.first + min(a + TOKENIZE_BATCH, len(normals)))
        failed_at = _plan_rows(job, rows, normals[a : a + TOKENIZE_BATCH], known, state, batch, samples)
        if failed_at is not None:
            break
    if failed_at is None and bad is not None:
        failed_at = r.first + bad
    if failed_at is not None:
        batch.error_row = failed_at
        batch.error_line = as_read(failed_at - r.first)
    batch.rows, batch.offsets, batch.ids, batch.mask = _pack(samples)
    batch.tokenized, batch.reused = state["tokenized"], state["reused"]
    return batch


def _plan_rows(job: _Job, rows: range, normals: list[tuple[RowFormat, dict]], known: dict, state: dict,
               batch: _Batch, samples: list) -> int | None:
    """These rows checked in order, their chats tokenized in one call, then finished in order; the
    first row that raised, or None."""
    outcomes, failed_at = [], None
    for row, (fmt, obj) in zip(rows, normals):
        try:
            outcomes.append((row, _row(job, fmt, obj, row, known.get(row), state)))
        except _NoTokenizer:
            failed_at, batch.no_tokenizer = row, True
            break
        except Exception:  # noqa: BLE001 - the caller raises it again from this row alone
            failed_at = row
            break
    chats = [(o[1], row + 1, o[2]) for row, o in outcomes if o[0] == "chat"]
    how = Boundaries.TRUST_SPECIAL_TOKENS if job.split_tokens else Boundaries.COMPARE_WHOLE
    tokens = iter(chat_tokens.tokenize_chats(job.tokenizer, chats, path=job.path, boundaries=how,
                                             split_tokens=job.split_tokens) if chats else [])
    for row, outcome in outcomes:
        try:
            if outcome[0] == "chat":
                got = next(tokens)
                if isinstance(got, Exception):
                    raise got
                outcome = _truncate(job, row, *got)
            _finish(job, row, outcome, batch, samples)
        except Exception:  # noqa: BLE001 - as above
            return row
    return failed_at


def _pack(samples: list) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    lens = [len(ids) for _, ids, _ in samples]
    return (np.asarray([r for r, _, _ in samples], dtype=np.int64),
            np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]).astype(np.int64),
            np.concatenate([ids for _, ids, _ in samples]).astype(np.int32) if samples else np.zeros(0, np.int32),
            np.concatenate([m for _, _, m in samples]).astype(np.uint8) if samples else np.zeros(0, np.uint8))


def _raise_row_error(job: _Job, batch: _Batch, load_tokenizer) -> None:
    """Plan the batch's failed row again here, as a single process does, so that it raises its own
    error."""
    row = batch.error_row
    if job.records is not None:
        obj = job.records.rows[row]
    else:
        obj = ds.parse_row(batch.error_line, path=job.path, line=row + 1)  # raises for a line that is no object
    if batch.parse_error:
        raise RuntimeError(f"line {row + 1} failed to parse in a planning worker but parses here")
    fmt, normal = _normal(job, obj, row)
    state = {"kinds": set(), "formats": set(), "tokenized": False, "reused": 0}
    try:
        outcome = _row(job, fmt, normal, row, None, state)
    except _NoTokenizer:
        job = dataclasses.replace(job, tokenizer=load_tokenizer())  # raises what loading it raised
        outcome = _row(job, fmt, normal, row, None, state)
    if outcome[0] == "chat":
        path, line = job.where(row)
        outcome = _truncate(job, row, *chat_tokens.tokenize_chat(job.tokenizer, outcome[1], tools=outcome[2],
                                                                 path=path, line=line))
    _finish(job, row, outcome, _Batch(row, *_pack([])), [])
    raise RuntimeError(f"row {row} failed in a planning worker but plans here")
