"""The extraction run: a plan's shards through an engine into the output, then the manifest.

Order of work, so that bad input never costs a model load or leaves output:
check the spec -> read the model's config -> read and tokenize every row (or load
the range's rows from the plan an earlier run stored, ``datagen.extraction.stored``) ->
check the output directory -> start the engine -> claim the output directory ->
write shards -> manifest. Nothing is written into the output before the engine
has started, so every refusal (exit 2 or 3) leaves it as it was found.

Resume (``datagen.extraction.output``): re-running after a crash keeps the complete
shards and redoes the rest; re-running a finished dataset does nothing. A shard range
extracts only shards [A, B) and writes no manifest (the fan-out unit); a run without
one finishes every shard and writes the manifest last (``datagen.extraction.manifest``).

``extract_shards`` is the loop itself, on an engine already started: the benchmarks call
it rather than a copy of it.
"""

from __future__ import annotations

import errno
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock, Timeout

from datagen import settings
from datagen.data import media
from datagen.data.contract import ShardRecord, shard_name
from datagen.specs.extraction import EngineName, ExtractSpec
from datagen.errors import OutputConflictError, SpecError, StorageError
from datagen.extraction import stored
from datagen.extraction.manifest import check_dataset_unchanged, existing_manifest, manifest_result, write_manifest
from datagen.extraction.output import (
    check_output, commit, completed_shards, missing_dirs, remove_empty_dirs, save_records,
)
from datagen.extraction.plan import Plan, describe_shards
from datagen.specs.plan import ExtractionPlan
from datagen.extraction.progress import Progress

if TYPE_CHECKING:
    from datagen.data.shards.format import ShardJob
    from datagen.engines.base import Engine

log = logging.getLogger(__name__)


def build_job(p: Plan, k: int) -> ShardJob:
    """Shard ``k`` of ``p`` as the engine takes it: its rows' tokens, where to write, what to store."""
    from datagen.data.shards.format import ShardJob  # torch: not for those that only read the step's types

    first, count = p.shard_range(k)
    rows = [r for r in range(first, first + count) if r in p.data.samples]
    return ShardJob(
        index=k,
        path=str(p.shard_dir(k).resolve() / shard_name(k)),
        first_row=first,
        rows=count,
        sample_rows=tuple(rows),
        input_ids=tuple(p.data.samples[r].input_ids for r in rows),
        loss_masks=tuple(p.data.samples[r].loss_mask for r in rows),
        format=p.shard_format,
        shard_key=p.shard_key(k),
        media=tuple(p.data.samples[r].media for r in rows),
    )


def make_engine(p: Plan) -> Engine:
    """The engine the plan's spec names, not started."""
    e = p.spec.engine
    if e.name is EngineName.HF:
        from datagen.engines.hf import HFEngine

        if media.media_samples(p.data):
            from datagen.errors import EngineUnsupportedError

            raise EngineUnsupportedError("the dataset has image rows and the transformers engine runs no vision tower",
                                         hint="extract image rows with --engine vllm")

        return HFEngine(p.info.path, layer_ids=p.layer_ids, num_hidden_layers=p.info.num_hidden_layers,
                        dtype=e.dtype, trust_remote_code=e.trust_remote_code)
    from datagen.engines.vllm_engine import VllmEngine
    from datagen.engines.vllm_settings import VllmSettings

    return VllmEngine(p.info, VllmSettings.from_plan(p))


def extract_shards(p: Plan, engine: Engine, shards: Iterable[int], *,
                   progress: Progress | None = None) -> dict[int, ShardRecord]:
    """The run loop: each of ``shards`` through ``engine`` (started), its record kept in the
    output as it is written. The output must be claimed (``datagen.extraction.output``).

    Returns:
        The records of the shards written, by index.

    Raises:
        RuntimeError: the engine finished without writing a shard it was given.
    """
    records: dict[int, ShardRecord] = {}
    submitted = []
    saver = _RecordSaver(p, engine, records, progress)
    if progress is not None:
        progress.begin()
    try:
        for k in shards:
            job = build_job(p, k)
            engine.submit(job)
            submitted.append(k)
        finished = engine.finish()
    except BaseException:
        saver.close(raise_error=False)  # what the engine handed out is kept, on a failure too
        raise
    saver.close()
    saver.save(finished)
    missing = [k for k in submitted if k not in records]
    if missing:
        raise RuntimeError(f"shards {missing} were submitted but not written")
    return records


class _RecordSaver:
    """Keeps the records of the shards the engine has written (``save_records``), from a thread of
    its own while the run goes on. A record's fsyncs wait behind the shard writers' I/O on the
    same volume; in the thread that feeds the engine they held up its next group's requests."""

    INTERVAL_S = 0.05

    def __init__(self, p: Plan, engine: Engine, records: dict[int, ShardRecord], progress: Progress | None = None):
        self.p, self.engine, self.records, self.progress = p, engine, records, progress
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="datagen-records", daemon=True)
        self._thread.start()

    def save(self, recs: list[ShardRecord]) -> None:
        save_records(self.p.spec.out, _placed(self.p, recs), self.records)
        if recs and self.progress is not None:  # tokens are done when their shard is written, not when handed over
            self.progress.wrote(sum(r.bytes for r in recs))
            self.progress.advance(sum(r.tokens for r in recs))

    def _loop(self) -> None:
        try:
            while True:
                stopping = self._stop.wait(self.INTERVAL_S)
                self.save(self.engine.completed())
                if stopping:
                    return
        except BaseException as e:  # noqa: BLE001 (raised again in the run's thread by close)
            self.error = e

    def close(self, *, raise_error: bool = True) -> None:
        """Save what is handed out by now and stop; a failure to save is raised here."""
        self._stop.set()
        self._thread.join()
        if self.error is not None and raise_error:
            raise self.error


def _placed(p: Plan, recs: list[ShardRecord]) -> list[ShardRecord]:
    """The records with the volume their shard was written to (the job's path named it)."""
    return [r.model_copy(update={"volume": p.volume_of(r.index)}) for r in recs]


def extract(spec: ExtractSpec, *, shards: tuple[int, int] | None = None) -> dict:
    """Plan ``spec`` here (its rows from the output's stored plan when one is this spec's), then
    extract as ``extract_planned`` does: `datagen extract` given a spec rather than a plan.

    Raises:
        SpecError, ModelError, DatasetError: the spec, the model or the rows are refused (nothing written).
    """
    t0 = time.monotonic()
    p, from_store = stored.plan_shards(spec, shards)
    return _extract(p, shards=shards, t0=t0, store_plan=not from_store)


def extract_planned(record: ExtractionPlan, *, shards: tuple[int, int] | None = None) -> dict:
    """Extract the plan's shards in ``shards``, or all and then the manifest, on this host: checked
    to be the plan's (its model and engine: ``datagen.extraction.host``), nothing planned again.

    Returns:
        The extract step's result record (``datagen.steps.extract.ExtractResult``'s fields).

    Raises:
        SpecError: ``shards`` is outside the plan's.
        ModelError, CannotRunHereError, DatasetError: this host's model, engine or dataset is not the plan's.
        OutputConflictError: the output holds another dataset, or another run is writing it.
        StorageError: the device is full (the shards written are kept).
    """
    from datagen.extraction.host import plan_on_host

    t0 = time.monotonic()
    lo, hi = _range(shards, record.num_shards)
    p, from_store = plan_on_host(record, shards=(lo, hi))
    return _extract(p, shards=shards, t0=t0, store_plan=not from_store)


def _range(shards: tuple[int, int] | None, num_shards: int) -> tuple[int, int]:
    lo, hi = shards if shards is not None else (0, num_shards)
    if not (0 <= lo <= hi <= num_shards):
        raise SpecError(f"--shards {lo}:{hi} is outside 0:{num_shards}",
                        hint=f"this dataset has {num_shards} shards (`datagen plan` lists them)")
    return lo, hi


def _extract(p: Plan, *, shards: tuple[int, int] | None, t0: float, store_plan: bool) -> dict:
    log.info("plan: %s", describe_shards(p))
    out = Path(p.spec.out)
    lo, hi = _range(shards, p.num_shards)
    if shards is None and (m := existing_manifest(p)) is not None:
        log.info("dataset %s is complete (fingerprint %s): nothing to do", out, p.fingerprint[:12])
        return {**_result(p, m.totals["tokens"], extracted=[], cached=list(range(p.num_shards)),
                          seconds=time.monotonic() - t0), **manifest_result(out, m)}
    if out.exists() and not out.is_dir():
        raise OutputConflictError(f"output {out} exists and is not a directory", hint="choose another --out")
    # A failure before the first shard leaves the output location as found: nothing is written
    # into it until the engine has started (commit), and the directories made here for the lock
    # are removed again when they are still empty.
    created: list[Path] = []
    lock = None
    if shards is None:  # a whole run holds a lock beside the output; a range (fan-out) shares it
        try:
            created = missing_dirs(out.parent)
            out.parent.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(out.parent / f".{out.name}.lock"))
            lock.acquire(timeout=0)
        except Timeout:
            raise OutputConflictError(f"another extraction is writing {out}", hint="wait for it to finish") from None
        except OSError as e:
            remove_empty_dirs(created)
            raise OutputConflictError(f"cannot create the output directory {out}: {e.strerror}",
                                      hint="choose an --out whose parent is a writable directory") from e
    try:
        return _run_locked(p, whole=shards is None, lo=lo, hi=hi, t0=t0, store_plan=store_plan)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageError(
                f"no space left on the device of {out} ({e.strerror}); no manifest was written",
                hint="free space there (or choose another --out), then run again: the shards already written are kept",
            ) from e
        raise
    finally:
        if lock is not None:
            lock.release()
            Path(lock.lock_file).unlink(missing_ok=True)
        remove_empty_dirs(created)  # a no-op once the output is in them


def _run_locked(p: Plan, *, whole: bool, lo: int, hi: int, t0: float, store_plan: bool) -> dict:
    """The part of ``extract`` that writes, under the output's lock. ``whole``: every shard, then
    the manifest. ``store_plan``: keep the (computed) plan in the output for the ranges that follow."""
    out = Path(p.spec.out)
    check_output(p)  # refused before the engine starts; claimed (written) only once it has
    done = completed_shards(p)
    todo = [k for k in range(lo, hi) if k not in done]
    G = p.shard_group
    if G > 1 and todo:  # a group's batches depend on all its rows: recompute whole groups (in range)
        groups = {k // G for k in todo}
        todo = [k for k in range(lo, hi) if k // G in groups]
    log.info("%d shards in range %d:%d, %d already complete, %d to extract", hi - lo, lo, hi,
             hi - lo - len(todo), len(todo))
    records = dict(done)
    tokens_todo = sum(build_job(p, k).tokens for k in todo)
    if not todo:
        commit(p, done, store_plan=store_plan)
    else:
        progress = Progress(tokens_todo)
        with make_engine(p) as engine:
            t_start = time.monotonic()
            engine.start()
            log.info("engine started in %.1f s", time.monotonic() - t_start)
            commit(p, done, store_plan=store_plan)
            records.update(extract_shards(p, engine, todo, progress=progress))
        progress.close()
    manifest = None
    if whole:
        check_dataset_unchanged(p)
        manifest = write_manifest(p, records)
    elapsed = time.monotonic() - t0
    result = _result(p, sum(records[k].tokens for k in range(lo, hi)), extracted=todo,
                     cached=[k for k in range(lo, hi) if k not in todo], seconds=elapsed,
                     tokens_extracted=tokens_todo)
    if manifest is not None:
        result.update(manifest_result(out, manifest))
    return result


def _result(p: Plan, tokens: int, *, extracted: list[int], cached: list[int], seconds: float,
            tokens_extracted: int = 0) -> dict:
    return {
        "dataset": str(Path(p.spec.out).resolve()),
        "fingerprint": p.fingerprint,
        "extraction_fingerprint": p.extraction_fingerprint,
        "layer_ids": list(p.layer_ids),
        "shards_total": p.num_shards,
        "shards_extracted": extracted,
        "shards_cached": cached,
        "tokens": tokens,
        "tokens_extracted": tokens_extracted,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens_extracted / seconds, 1) if seconds > 0 and tokens_extracted else 0.0,
        "engine": p.engine_desc,
    }
