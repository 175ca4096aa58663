"""Planning a dataset on every core: rows checked, rendered and tokenized in worker processes.

``prepare_dataset`` is the one entry. The file is read, hashed and
parsed once in the calling process (JSON parsing is a small share of planning); the rows are then
planned in batches of consecutive rows by worker processes forked from it, so they share the parsed
rows and the loaded tokenizer without copying them, and each sends back its batch's tokens packed
in arrays. The result is the one a single process gets, byte for byte: the same samples, skipped
and truncated rows, kinds and hashes, and on a bad row the same error (the first in file order,
raised again in the calling process from that row alone).

A row of the previous plan of the same dataset path (``Reuse``: the stored plan, with the same
tokenizer, template and settings) whose bytes did not change is not rendered or tokenized again:
its tokens come from the stored plan, after the same checks as every row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from datagen.data import dataset as ds
from datagen.data import media
from datagen.data.contract import SkippedRow, TruncatedRow
from datagen.errors import DatasetError, ModelError

log = logging.getLogger(__name__)

# Rows per batch: large enough that a batch's pickled result is cheap next to its tokenizing, small
# enough that every worker gets several (the last batches do not leave a core idle for long).
MIN_BATCH, MAX_BATCH = 64, 2048
# Below this many rows one process plans them (starting workers costs more than it saves).
PARALLEL_MIN_ROWS = 2000


@dataclass(frozen=True)
class Known:
    """A row's outcome in an earlier plan of the same tokenizer, template and settings."""

    sample: ds.Sample | None  # its tokens (truncated as then), None when it was skipped
    skipped: SkippedRow | None = None
    truncated: TruncatedRow | None = None


class Reuse(Protocol):
    """Outcomes of rows whose bytes an earlier plan tokenized (``datagen.extraction.stored``)."""

    def known(self, first: int, line_hashes: list[bytes]) -> dict[int, Known]:
        """The known outcomes among rows ``first, first+1, ...`` of these sha256 digests (called in
        the worker that plans them: it reads only what its batch needs). Never raises: a row it
        cannot give is tokenized."""
        ...


@dataclass
class _Batch:
    """What a worker sends back for rows [first, stop): packed samples and the rest per row."""

    first: int
    stop: int
    rows: np.ndarray  # int64 [S]: the rows that became samples
    offsets: np.ndarray  # int64 [S+1]
    ids: np.ndarray  # int32 [T]
    mask: np.ndarray  # uint8 [T]
    skipped: list[SkippedRow] = field(default_factory=list)
    truncated: list[TruncatedRow] = field(default_factory=list)
    kinds: set[str] = field(default_factory=set)
    tokenized: bool = False  # a chat row needed the tokenizer
    error_row: int | None = None  # the first row that raised; the caller raises it again
    reused: int = 0  # chat rows taken from the earlier plan
    media: dict = field(default_factory=dict)  # row -> its images (media.MediaItem), image rows only


@dataclass
class _Job:
    """Everything a worker reads: set before the workers fork, so they share it."""

    path: str
    rows: list[tuple[int, bytes, dict]]
    tokenizer: object | None
    vocab_size: int
    max_seq_len: int
    split_tokens: ds.SplitTokens | None
    line_hashes: list[bytes]
    reuse: Reuse | None


_JOB: _Job | None = None


class _NoTokenizer(RuntimeError):
    """A chat row needs the tokenizer, and loading it raised (it is loaded again to say why)."""


def _row(job: _Job, obj: dict, row: int, known: Known | None, state: dict):
    """One row's outcome, checked as ``prepare_dataset`` always has (raising for a bad row):
    ("sample", ids, mask, truncated), ("skipped", reason), or ("chat", messages) to tokenize."""
    line = row + 1
    if "messages" in obj:
        msgs = ds._check_messages(obj, path=job.path, line=line)
        state["kinds"].add("chat")
        if not msgs:
            return ("skipped", "empty")
        state["tokenized"] = True
        if media.has_media(obj):  # images: read, counted and expanded (datagen.data.media)
            if job.tokenizer is None:
                raise _NoTokenizer(row)
            return media.plan_row(job.tokenizer, msgs, row=row, path=job.path, max_seq_len=job.max_seq_len)
        if known is not None:
            state["reused"] += 1
            if known.sample is None:
                return ("skipped", known.skipped.reason)
            return ("sample", known.sample.input_ids, known.sample.loss_mask, known.truncated)
        if job.tokenizer is None:
            raise _NoTokenizer(row)
        return ("chat", msgs)
    if "input_ids" in obj:
        ids, mask = ds._check_tokens_row(obj, path=job.path, line=line, vocab_size=job.vocab_size)
        state["kinds"].add("tokens")
        return _truncate(job, row, ids, mask)
    raise DatasetError(
        f"row has neither 'messages' nor 'input_ids' (fields: {sorted(obj)})",
        path=job.path, line=line,
        hint='write {"messages": [...]} or {"input_ids": [...], "loss_mask": [...]}',
    )


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


def _plan_batch(first: int, stop: int) -> _Batch:
    """Rows [first, stop) of the job: checked in order, their chats tokenized in one call, then
    finished in order. Stops at the first row that raises and names it."""
    job = _JOB
    known = job.reuse.known(first, job.line_hashes[first:stop]) if job.reuse is not None else {}
    batch = _Batch(first, stop, *_pack([]))
    state = {"kinds": batch.kinds, "tokenized": False, "reused": 0}
    outcomes, failed_at = [], None
    for row, _raw, obj in job.rows[first:stop]:
        try:
            outcomes.append((row, _row(job, obj, row, known.get(row), state)))
        except Exception:  # noqa: BLE001 - the caller raises it again from this row alone
            failed_at = row
            break
    chats = [(o[1], row + 1) for row, o in outcomes if o[0] == "chat"]
    how = ds.Boundaries.TRUST_SPECIAL_TOKENS if job.split_tokens else ds.Boundaries.COMPARE_WHOLE
    tokens = iter(ds.tokenize_chats(job.tokenizer, chats, path=job.path, boundaries=how, split_tokens=job.split_tokens)
                  if chats else [])
    samples: list = []
    for row, outcome in outcomes:
        try:
            if outcome[0] == "chat":
                got = next(tokens)
                if isinstance(got, Exception):
                    raise got
                outcome = _truncate(job, row, *got)
            _finish(job, row, outcome, batch, samples)
        except Exception:  # noqa: BLE001 - as above
            failed_at = row
            break
    batch.error_row = failed_at
    batch.rows, batch.offsets, batch.ids, batch.mask = _pack(samples)
    batch.tokenized, batch.reused = state["tokenized"], state["reused"]
    return batch


def _pack(samples: list) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    lens = [len(ids) for _, ids, _ in samples]
    return (np.asarray([r for r, _, _ in samples], dtype=np.int64),
            np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]).astype(np.int64),
            np.concatenate([ids for _, ids, _ in samples]).astype(np.int32) if samples else np.zeros(0, np.int32),
            np.concatenate([m for _, _, m in samples]).astype(np.uint8) if samples else np.zeros(0, np.uint8))


def _batches(n: int, workers: int) -> list[tuple[int, int]]:
    size = max(MIN_BATCH, min(MAX_BATCH, -(-n // (workers * 8))))
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def default_workers() -> int:
    """The planning processes: DATAGEN_PLANNING_WORKERS, else every core this process may use."""
    from datagen import settings

    return settings.planning_workers() or len(os.sched_getaffinity(0))


def _needs_tokenizer(rows) -> bool:
    return any(isinstance(obj.get("messages"), list) and obj["messages"] for _, _, obj in rows)


def prepare_dataset(path: str | Path, *, load_tokenizer: ds.TokenizerLoader, vocab_size: int, max_seq_len: int,
                    workers: int | None = None, reuse: Reuse | None = None) -> ds.PreparedDataset:
    """Read, check and tokenize every row, on every core.

    Args:
        path: the JSONL dataset.
        load_tokenizer: loads the tokenizer (called once, only when a chat row needs it).
        vocab_size: the model's vocabulary (token ids must lie below it).
        max_seq_len: rows longer than this are truncated.
        workers: planning processes (default ``default_workers()`` from PARALLEL_MIN_ROWS rows on,
            else this process alone; 1 plans in this process).
        reuse: outcomes of unchanged rows from an earlier plan of the same tokenizer and settings.

    Raises:
        DatasetError: the first bad row (in file order), or no row with a target.
        ModelError: the tokenizer does not load, or produces an id outside the vocabulary.
    """
    global _JOB
    p = Path(path)
    # The fingerprint is of the bytes parsed, not of a second read: a file changed in between
    # would otherwise get a fingerprint that its shards were not extracted from.
    digest = hashlib.sha256()
    rows = ds.read_rows(p, digest=digest)
    fingerprint = digest.hexdigest()
    line_hashes = media.identities(rows, [hashlib.sha256(raw).digest() for _, raw, _ in rows], p.parent)
    tokenizer = None
    if _needs_tokenizer(rows):
        try:
            tokenizer = load_tokenizer()
        except Exception:  # noqa: BLE001 - raised again at the first row that needs it, as before
            tokenizer = None
    split = ds.SplitTokens(tokenizer) if tokenizer is not None else None
    job = _Job(str(p), rows, tokenizer, vocab_size, max_seq_len, split, line_hashes, reuse)
    parallel = workers is not None or len(rows) >= PARALLEL_MIN_ROWS  # asked for, or worth it
    workers = workers or default_workers()
    ranges = _batches(len(rows), workers)
    _JOB = job
    # The parsed rows are many small objects that live until the plan is made: out of the garbage
    # collector's sight meanwhile (its full passes over them cost more than the planning's own
    # allocations, and in a forked worker they would copy every page the parent shares with it).
    gc.freeze()
    try:
        with _one_thread_per_process():
            if workers <= 1 or not parallel or "fork" not in multiprocessing.get_all_start_methods():
                batches = [_plan_batch(a, b) for a, b in ranges]
                hashes = _hashes(tokenizer)
            else:  # the tokenizer's hashes (a serialization of it) while the workers plan
                batches, hashes = _in_workers(ranges, workers, lambda: _hashes(tokenizer))
    finally:
        _JOB = None
        gc.unfreeze()
    return _assemble(job, batches, load_tokenizer, fingerprint, line_hashes, hashes)


def _hashes(tokenizer) -> tuple[str | None, str | None]:
    return ds.tokenizer_hashes(tokenizer) if tokenizer is not None else (None, None)


@contextlib.contextmanager
def _one_thread_per_process():
    """The Rust tokenizer without its thread pool while planning: a few short texts per call cost
    more to hand to threads than to tokenize, and each worker process is one core already (a pool
    started before the workers fork would also be disabled in them, with a warning)."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _in_workers(ranges, workers: int, meanwhile):
    """The batches planned by ``workers`` forked processes, and ``meanwhile()`` run here meanwhile."""
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=min(workers, len(ranges)), mp_context=ctx) as ex:
        results = ex.map(_plan_batch, [a for a, _ in ranges], [b for _, b in ranges])
        other = meanwhile()
        return list(results), other


def _raise_row_error(job: _Job, row: int, load_tokenizer) -> None:
    """Plan ``row`` again here, as a single process does, so that it raises its own error."""
    _, _, obj = job.rows[row]
    state = {"kinds": set(), "tokenized": False, "reused": 0}
    try:
        outcome = _row(job, obj, row, None, state)
    except _NoTokenizer:
        job = dataclasses.replace(job, tokenizer=load_tokenizer())  # raises what loading it raised
        outcome = _row(job, obj, row, None, state)
    if outcome[0] == "chat":
        outcome = _truncate(job, row, *ds.tokenize_chat(job.tokenizer, outcome[1], path=job.path, line=row + 1))
    _finish(job, row, outcome, _Batch(row, row + 1, *_pack([])), [])
    raise RuntimeError(f"row {row} failed in a planning worker but plans here")


def _assemble(job: _Job, batches: list[_Batch], load_tokenizer, fingerprint: str, line_hashes: list[bytes],
              hashes: tuple[str | None, str | None]) -> ds.PreparedDataset:
    errors = [b.error_row for b in batches if b.error_row is not None]
    if errors:
        _raise_row_error(job, min(errors), load_tokenizer)
    samples: dict[int, ds.Sample] = {}
    skipped: list[SkippedRow] = []
    truncated: list[TruncatedRow] = []
    kinds: set[str] = set()
    for b in batches:
        for r, x, y in zip(b.rows.tolist(), b.offsets[:-1].tolist(), b.offsets[1:].tolist()):
            samples[r] = ds.Sample(row=r, input_ids=b.ids[x:y], loss_mask=b.mask[x:y], media=b.media.get(r, ()))
        skipped += b.skipped
        truncated += b.truncated
        kinds |= b.kinds
    reused = sum(b.reused for b in batches)
    if reused:
        log.info("plan: %d chat rows unchanged since the stored plan were not tokenized again", reused)
    if not samples:
        # Every row skipped: a run would start an engine, store nothing and call it complete.
        reasons = sorted({s.reason for s in skipped})
        raise DatasetError(
            f"no row has a target token: all {len(job.rows)} rows would be skipped ({', '.join(reasons)})",
            path=job.path,
            hint="give chat rows an assistant turn, or pre-tokenized rows a loss_mask with 1s",
        )
    used = any(b.tokenized for b in batches)
    template_hash, tok_hash = hashes if used else (None, None)
    return ds.PreparedDataset(
        path=job.path,
        rows=len(job.rows),
        fingerprint=fingerprint,
        samples=samples,
        skipped=skipped,
        truncated=truncated,
        line_hashes=line_hashes,
        chat_template_hash=template_hash,
        tokenizer_hash=tok_hash,
        kinds=kinds,
    )
