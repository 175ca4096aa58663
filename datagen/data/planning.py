"""Planning a dataset on every core: rows read, checked, rendered and tokenized in worker processes.

``prepare_dataset`` is the one entry. The calling process reads the file once in large blocks: it
hashes it (the dataset's fingerprint), counts its lines and cuts it into byte ranges at line ends,
each with the sha256 of its bytes. Worker processes forked from it (sharing the loaded tokenizer
without copying it) each read their range themselves, check that its bytes are the ones hashed
(else the file changed while it was read, and planning stops), parse and hash its rows
(``row_identity``), render and tokenize its chats in batches, and send back their tokens packed in
arrays. The calling process only assembles them. The result is the one a single process gets, byte
for byte: the same samples, skipped and truncated rows, kinds and hashes, and on a bad row the same
error (the first line that is not a JSON object, else the first row that fails its checks, raised
again in the calling process from that row alone).

A row of the previous plan of the same dataset path (``Reuse``: the stored plan, with the same
tokenizer, template and settings) whose bytes did not change is not rendered or tokenized again:
its tokens come from the stored plan, after the same checks as every row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
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
from datagen.data.tiktoken_ids import tiktoken_encoder

log = logging.getLogger(__name__)

# Bytes per range a worker reads: large enough that a range's pickled result is cheap next to its
# tokenizing, small enough that every worker gets several (the last ranges do not leave a core idle
# for long) and that a range's parsed rows stay small.
MIN_RANGE, MAX_RANGE = 16 << 10, 1 << 20
# Rows tokenized in one call (a call's texts and tokens stay bounded whatever the range holds).
TOKENIZE_BATCH = 2048
# Below this many rows one process plans them (starting workers costs more than it saves).
PARALLEL_MIN_ROWS = 2000
# The calling process reads the file in blocks of this size.
READ_BLOCK = 8 << 20
# A chat row's key: a file without these bytes has no chat row, and its plan loads no tokenizer.
CHAT_KEY = b'"messages"'


def row_identity(line: bytes, obj: dict, base: Path | None = None) -> bytes:
    """A row's identity: what the plan records of it (``PreparedDataset.line_hashes``, the shard
    keys) and what an earlier plan's row must match to be reused. The sha256 of its bytes (without
    the line end); ``obj`` is the row parsed from them. A row with images hashes their bytes in too
    (``media.identity``; relative paths from ``base``, the dataset's directory): a changed image
    re-extracts its shard."""
    return media.identity(hashlib.sha256(line).digest(), obj, base or Path("."))


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
    start: int
    stop: int
    sha256: bytes  # of those bytes, as the calling process read them


@dataclass(frozen=True)
class _Scan:
    """What the calling process learns from its one read of the file."""

    fingerprint: str  # sha256 of the whole file
    rows: int
    ranges: list[_Range]
    chats: bool  # CHAT_KEY occurs in it (else no row is a chat)


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
    split_tokens: ds.SplitTokens | None
    reuse: Reuse | None


_JOB: _Job | None = None


class _NoTokenizer(RuntimeError):
    """A chat row needs the tokenizer, and none was loaded (it is loaded again to say why)."""


def _scan(p: Path, target: int) -> _Scan:
    """Read the file once: its sha256, its lines, and ranges of about ``target`` bytes cut at line
    ends, each with its own sha256."""
    whole, part = hashlib.sha256(), hashlib.sha256()
    ranges: list[_Range] = []
    start = first = newlines = pos = 0
    chats, tail, last = False, b"", b""
    with p.open("rb") as f:
        while block := f.read(READ_BLOCK):
            whole.update(block)
            view = memoryview(block)
            if not chats:  # (the key may span two blocks: the last bytes before this one, and its first)
                k = len(CHAT_KEY) - 1
                chats = CHAT_KEY in block or CHAT_KEY in tail + block[:k]
                tail = block[-k:] if len(block) >= k else (tail + block)[-k:]
            i = 0
            while (want := start + target - pos) <= len(block):
                j = block.find(b"\n", max(want - 1, i))
                if j < 0:
                    break
                part.update(view[i : j + 1])
                ranges.append(_Range(first, start, pos + j + 1, part.digest()))
                first += newlines + block.count(b"\n", i, j + 1)
                start, newlines, part, i = pos + j + 1, 0, hashlib.sha256(), j + 1
            part.update(view[i:])
            newlines += block.count(b"\n", i)
            last, pos = block[-1:], pos + len(block)
    if pos > start:
        ranges.append(_Range(first, start, pos, part.digest()))
        first += newlines + (last != b"\n")
    return _Scan(whole.hexdigest(), first, ranges, chats)


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
            return media.plan_row(job.tokenizer, msgs, row=row, path=job.path, max_seq_len=job.max_seq_len,
                                  tokenize_chat=ds.tokenize_chat)
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
    """The range's rows: read, parsed and identified (a line that is not a JSON object stops it
    before any row is checked, as a whole-file parse did), then checked, tokenized in batches and
    finished in order. Stops at the first row that raises and names it."""
    job = _JOB
    batch = _Batch(r.first, *_pack([]))
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
    base = Path(job.path).parent
    hashes = [row_identity(line.rstrip(b"\r\n"), obj, base) for line, obj in zip(lines, objs)]
    batch.line_hashes = b"".join(hashes)
    known = job.reuse.known(r.first, hashes) if job.reuse is not None else {}
    state = {"kinds": batch.kinds, "tokenized": False, "reused": 0}
    samples: list = []
    for a in range(0, len(objs), TOKENIZE_BATCH):
        rows = range(r.first + a, r.first + min(a + TOKENIZE_BATCH, len(objs)))
        failed_at = _plan_rows(job, rows, objs[a : a + TOKENIZE_BATCH], known, state, batch, samples)
        if failed_at is not None:
            batch.error_row = failed_at
            batch.error_line = as_read(failed_at - r.first)
            break
    batch.rows, batch.offsets, batch.ids, batch.mask = _pack(samples)
    batch.tokenized, batch.reused = state["tokenized"], state["reused"]
    return batch


def _plan_rows(job: _Job, rows: range, objs: list[dict], known: dict, state: dict, batch: _Batch,
               samples: list) -> int | None:
    """These rows checked in order, their chats tokenized in one call, then finished in order; the
    first row that raised, or None."""
    outcomes, failed_at = [], None
    for row, obj in zip(rows, objs):
        try:
            outcomes.append((row, _row(job, obj, row, known.get(row), state)))
        except _NoTokenizer:
            failed_at, batch.no_tokenizer = row, True
            break
        except Exception:  # noqa: BLE001 - the caller raises it again from this row alone
            failed_at = row
            break
    chats = [(o[1], row + 1) for row, o in outcomes if o[0] == "chat"]
    how = ds.Boundaries.TRUST_SPECIAL_TOKENS if job.split_tokens else ds.Boundaries.COMPARE_WHOLE
    tokens = iter(ds.tokenize_chats(job.tokenizer, chats, path=job.path, boundaries=how,
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


def _range_bytes(size: int, workers: int) -> int:
    return max(MIN_RANGE, min(MAX_RANGE, -(-size // (workers * 8))))


def default_workers() -> int:
    """The planning processes: DATAGEN_PLANNING_WORKERS, else every core this process may use."""
    from datagen import settings

    return settings.planning_workers() or len(os.sched_getaffinity(0))


def prepare_dataset(path: str | Path, *, load_tokenizer: ds.TokenizerLoader, vocab_size: int, max_seq_len: int,
                    workers: int | None = None, reuse: Reuse | None = None) -> ds.PreparedDataset:
    """Read, check and tokenize every row, on every core.

    Args:
        path: the JSONL dataset.
        load_tokenizer: loads the tokenizer (called once, only when a chat row may need it).
        vocab_size: the model's vocabulary (token ids must lie below it).
        max_seq_len: rows longer than this are truncated.
        workers: planning processes (default ``default_workers()`` from PARALLEL_MIN_ROWS rows on,
            else this process alone; 1 plans in this process).
        reuse: outcomes of unchanged rows from an earlier plan of the same tokenizer and settings.

    Raises:
        DatasetError: the first bad row (in file order), no row with a target, or the file
            changed while it was read.
        ModelError: the tokenizer does not load, or produces an id outside the vocabulary.
    """
    p = ds.check_file(path)
    asked = workers
    workers = workers or default_workers()
    scan = _scan(p, _range_bytes(p.stat().st_size, workers))
    if scan.rows == 0:
        raise ds.empty_dataset(p)
    parallel = asked is not None or scan.rows >= PARALLEL_MIN_ROWS  # asked for, or worth it
    tokenizer, tried = None, False
    while True:
        if scan.chats and not tried:
            tried = True
            try:
                tokenizer = load_tokenizer()
            except Exception:  # noqa: BLE001 - raised again at the first row that needs it, as before
                tokenizer = None
        split = ds.SplitTokens(tokenizer) if tokenizer is not None else None
        if tokenizer is not None:
            tiktoken_encoder(tokenizer)  # checked once here, not in every worker
        job = _Job(str(p), tokenizer, vocab_size, max_seq_len, split, reuse)
        batches, hashes = _plan(job, scan.ranges, workers if parallel else 1)
        if tried or not any(b.no_tokenizer for b in batches):
            break
        # a chat row the byte search did not see (its key written with escapes): plan again with it
        scan = dataclasses.replace(scan, chats=True)
    return _assemble(job, scan, batches, load_tokenizer, hashes)


def _plan(job: _Job, ranges: list[_Range], workers: int) -> tuple[list[_Batch], tuple[str | None, str | None]]:
    global _JOB
    _JOB = job
    # Whatever the calling process holds (the tokenizer's many small objects) out of the garbage
    # collector's sight meanwhile: in a forked worker its passes would copy every page it shares.
    gc.freeze()
    try:
        with _one_thread_per_process():
            if workers <= 1 or len(ranges) < 2 or "fork" not in multiprocessing.get_all_start_methods():
                return [_plan_range(r) for r in ranges], _hashes(job.tokenizer)
            # the tokenizer's hashes (a serialization of it) while the workers plan
            return _in_workers(ranges, workers, lambda: _hashes(job.tokenizer))
    finally:
        _JOB = None
        gc.unfreeze()


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


def _in_workers(ranges: list[_Range], workers: int, meanwhile):
    """The ranges planned by ``workers`` forked processes, and ``meanwhile()`` run here meanwhile."""
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=min(workers, len(ranges)), mp_context=ctx) as ex:
        results = ex.map(_plan_range, ranges)
        other = meanwhile()
        return list(results), other


def _raise_row_error(job: _Job, batch: _Batch, load_tokenizer) -> None:
    """Plan the batch's failed row again here, as a single process does, so that it raises its own
    error."""
    row = batch.error_row
    obj = ds.parse_row(batch.error_line, path=job.path, line=row + 1)  # raises for a line that is no object
    if batch.parse_error:
        raise RuntimeError(f"line {row + 1} failed to parse in a planning worker but parses here")
    state = {"kinds": set(), "tokenized": False, "reused": 0}
    try:
        outcome = _row(job, obj, row, None, state)
    except _NoTokenizer:
        job = dataclasses.replace(job, tokenizer=load_tokenizer())  # raises what loading it raised
        outcome = _row(job, obj, row, None, state)
    if outcome[0] == "chat":
        outcome = _truncate(job, row, *ds.tokenize_chat(job.tokenizer, outcome[1], path=job.path, line=row + 1))
    _finish(job, row, outcome, _Batch(row, *_pack([])), [])
    raise RuntimeError(f"row {row} failed in a planning worker but plans here")


def _assemble(job: _Job, scan: _Scan, batches: list[_Batch], load_tokenizer,
              hashes: tuple[str | None, str | None]) -> ds.PreparedDataset:
    changed = [b.first for b in batches if b.changed]
    if changed:
        raise DatasetError(
            f"the file changed while it was read (its bytes from line {min(changed) + 1} on are not those hashed)",
            path=job.path, hint="plan it again once nothing writes to it",
        )
    for errors in ([b for b in batches if b.parse_error], [b for b in batches if b.error_row is not None]):
        if errors:  # a line that is no JSON object comes first, as a whole-file parse found it first
            _raise_row_error(job, min(errors, key=lambda b: b.error_row), load_tokenizer)
    samples: dict[int, ds.Sample] = {}
    skipped: list[SkippedRow] = []
    truncated: list[TruncatedRow] = []
    line_hashes: list[bytes] = []
    kinds: set[str] = set()
    for b in batches:
        for r, x, y in zip(b.rows.tolist(), b.offsets[:-1].tolist(), b.offsets[1:].tolist()):
            samples[r] = ds.Sample(row=r, input_ids=b.ids[x:y], loss_mask=b.mask[x:y], media=b.media.get(r, ()))
        h = b.line_hashes
        line_hashes += [h[k : k + 32] for k in range(0, len(h), 32)]
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
            f"no row has a target token: all {scan.rows} rows would be skipped ({', '.join(reasons)})",
            path=job.path,
            hint="give chat rows an assistant turn, or pre-tokenized rows a loss_mask with 1s",
        )
    used = any(b.tokenized for b in batches)
    template_hash, tok_hash = hashes if used else (None, None)
    return ds.PreparedDataset(
        path=job.path,
        rows=scan.rows,
        fingerprint=scan.fingerprint,
        samples=samples,
        skipped=skipped,
        truncated=truncated,
        line_hashes=line_hashes,
        chat_template_hash=template_hash,
        tokenizer_hash=tok_hash,
        kinds=kinds,
    )
