"""Planning a dataset on every core: rows read, checked, rendered and tokenized in worker processes.

``prepare_dataset`` is the one entry. The calling process reads the file once in large blocks: it
hashes it (the dataset's fingerprint), counts its lines and cuts it into byte ranges at line ends,
each with the sha256 of its bytes. Worker processes forked from it (sharing the loaded tokenizer
without copying it) each read their range themselves, check that its bytes are the ones hashed
(else the file changed while it was read, and planning stops), parse and hash its rows
(``planning_rows.row_identity``), render and tokenize its chats in batches, and send back their
tokens packed in arrays. The calling process only assembles them. The result is the one a single process gets, byte
for byte: the same samples, skipped and truncated rows, kinds and hashes, and on a bad row the same
error (the first line that is not a JSON object, else the first row that fails its checks, raised
again in the calling process from that row alone).

A row of the previous plan of the same dataset path (``Reuse``: the stored plan, with the same
tokenizer, template and settings) whose bytes did not change is not rendered or tokenized again:
its tokens come from the stored plan, after the same checks as every row.

This module is the calling process: the one read of the file, the workers, and the assembly of
their batches (with the first error in file order). What is done with a range of rows, in
whichever process plans it, is ``datagen.data.planning_rows``.
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
from dataclasses import dataclass
from pathlib import Path

from datagen.data import chat_tokens, dataset_files, planning_rows
from datagen.data import dataset as ds
from datagen.data.contract import SkippedRow, TruncatedRow
from datagen.data.planning_rows import TOKENIZE_BATCH as TOKENIZE_BATCH_ROWS
from datagen.data.planning_rows import Reuse, _Batch, _Job, _Range, _plan_range, _raise_row_error
from datagen.errors import DatasetError
from datagen.data.tiktoken_ids import tiktoken_encoder

log = logging.getLogger(__name__)

# Bytes per range a worker reads: large enough that a range's pickled result is cheap next to its
# tokenizing, small enough that every worker gets several (the last ranges do not leave a core idle
# for long) and that a range's parsed rows stay small.
MIN_RANGE, MAX_RANGE = 16 << 10, 1 << 20
# Below this many rows one process plans them (starting workers costs more than it saves).
PARALLEL_MIN_ROWS = 2000
# The calling process reads the file in blocks of this size.
READ_BLOCK = 8 << 20
# A chat row's key: a file without these bytes has no chat row, and its plan loads no tokenizer.
CHAT_KEY = b'"messages"'


@dataclass(frozen=True)
class _Scan:
    """What the calling process learns from its one read of the file."""

    fingerprint: str  # sha256 of the whole file
    rows: int
    ranges: list[_Range]
    chats: bool  # CHAT_KEY occurs in it (else no row is a chat)
    container: dataset_files.Container = dataset_files.Container.JSONL
    records: dataset_files.Records | None = None  # the rows, when read whole (not a single JSONL file)


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


def _range_bytes(size: int, workers: int) -> int:
    return max(MIN_RANGE, min(MAX_RANGE, -(-size // (workers * 8))))


def _read(ref: dataset_files.DatasetRef, workers: int) -> _Scan:
    """A single JSONL file scanned (its rows are read by the workers), or any other dataset read
    whole into records, cut into ranges of rows."""
    kind = dataset_files.container(ref)
    if kind is dataset_files.Container.JSONL and ref.path.is_file() and not ref.has_options:
        return _scan(ref.path, _range_bytes(ref.path.stat().st_size, workers))
    records = dataset_files.read_records(ref)
    n = len(records.rows)
    step = max(64, min(TOKENIZE_BATCH_ROWS, -(-n // (workers * 8))))
    ranges = [_Range(a, a, min(a + step, n), b"") for a in range(0, n, step)]
    chats = any(not isinstance(r, dict) or "input_ids" not in r for r in records.rows)
    return _Scan(records.fingerprint, n, ranges, chats, kind, records)


def default_workers() -> int:
    """The planning processes: DATAGEN_PLANNING_WORKERS, else every core this process may use."""
    from datagen import settings

    return settings.planning_workers() or len(os.sched_getaffinity(0))


def prepare_dataset(path: str | Path, *, load_tokenizer: ds.TokenizerLoader, vocab_size: int, max_seq_len: int,
                    workers: int | None = None, reuse: Reuse | None = None) -> ds.PreparedDataset:
    """Read, check and tokenize every row, on every core.

    Args:
        path: the dataset (``datagen.data.dataset_files``: a JSONL or JSON file, a folder of them,
            a Hugging Face dataset on disk; options after ``#``).
        load_tokenizer: loads the tokenizer (called once, only when a chat row may need it).
        vocab_size: the model's vocabulary (token ids must lie below it).
        max_seq_len: rows longer than this are truncated.
        workers: planning processes (default ``default_workers()`` from PARALLEL_MIN_ROWS rows on,
            else this process alone; 1 plans in this process).
        reuse: outcomes of unchanged rows from an earlier plan of the same tokenizer and settings.

    Raises:
        DatasetError: the first bad row (in file order), no row with a target, the file changed
            while it was read, or a dataset path that holds no dataset.
        ModelError: the tokenizer does not load, or produces an id outside the vocabulary.
    """
    ref = dataset_files.parse_ref(path)
    asked = workers
    workers = workers or default_workers()
    scan = _read(ref, workers)
    if scan.rows == 0:
        raise ds.empty_dataset(ref.path)
    parallel = asked is not None or scan.rows >= PARALLEL_MIN_ROWS  # asked for, or worth it
    tokenizer, tried = None, False
    while True:
        if scan.chats and not tried:
            tried = True
            try:
                tokenizer = load_tokenizer()
            except Exception:  # noqa: BLE001 - raised again at the first row that needs it, as before
                tokenizer = None
        split = chat_tokens.SplitTokens(tokenizer) if tokenizer is not None else None
        if tokenizer is not None:
            tiktoken_encoder(tokenizer)  # checked once here, not in every worker
        job = _Job(str(ref.path) if scan.records is None else ref.text, tokenizer, vocab_size, max_seq_len, split,
                   reuse, scan.records, ref.format)
        batches, hashes = _plan(job, scan.ranges, workers if parallel else 1)
        if tried or not any(b.no_tokenizer for b in batches):
            break
        # a chat row the byte search did not see (its key written with escapes): plan again with it
        scan = dataclasses.replace(scan, chats=True)
    return _assemble(job, scan, batches, load_tokenizer, hashes)


def _plan(job: _Job, ranges: list[_Range], workers: int) -> tuple[list[_Batch], tuple[str | None, str | None]]:
    planning_rows._JOB = job  # (read by _plan_range, here and in the workers forked from here)
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
        planning_rows._JOB = None
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
    formats: set[str] = set()
    for b in batches:
        for r, x, y in zip(b.rows.tolist(), b.offsets[:-1].tolist(), b.offsets[1:].tolist()):
            samples[r] = ds.Sample(row=r, input_ids=b.ids[x:y], loss_mask=b.mask[x:y], media=b.media.get(r, ()))
        h = b.line_hashes
        line_hashes += [h[k : k + 32] for k in range(0, len(h), 32)]
        skipped += b.skipped
        truncated += b.truncated
        kinds |= b.kinds
        formats |= b.row_formats
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
        format=f"{scan.container.value}/{'+'.join(sorted(formats))}",
    )
