"""The extraction step: ``datagen extract``.

Order of work, so that bad input never costs a model load or leaves output:
check the spec -> read the model's config -> read and tokenize every row (or load
the range's rows from the plan an earlier run stored, ``datagen.extraction.stored``) ->
check the output directory -> start the engine -> claim the output directory ->
write shards -> manifest. Nothing is written into the output before the engine
has started, so every refusal (exit 2 or 3) leaves it as it was found.

Resume: a shard is complete when its file exists under its final name (writes
are atomic) and its record in ``.datagen/shards/`` carries the same shard key.
Re-running after a crash keeps those and redoes the rest; re-running a finished
dataset does nothing. ``--shards A:B`` extracts only shards [A, B) and writes no
manifest (the fan-out unit); a run without it finishes every shard and writes
the manifest last.
"""

from __future__ import annotations

import datetime as dt
import errno
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from filelock import FileLock, Timeout
from pydantic import BaseModel, ConfigDict, Field

from datagen import settings
from datagen.data.contract import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    SHARDS_DIR,
    STATE_DIR,
    Manifest,
    ShardRecord,
    shard_name,
)
from datagen.data.dataset import file_fingerprint
from datagen.data.files import atomic_write_json
from datagen.data.spec import EngineName, ExtractSpec, StorageName, parse_spec, sha256_hex
from datagen.errors import DatasetError, OutputConflictError, SpecError, StorageError
from datagen.extraction.plan import Plan, plan
from datagen.extraction import stored
from datagen.steps._args import StepSpec

if TYPE_CHECKING:
    from datagen.data.shards import ShardJob
    from datagen.engines.base import Engine

HELP = "Extract hidden states of a model for a JSONL dataset into packed safetensors shards."
log = logging.getLogger(__name__)


# --- the output directory ---------------------------------------------------------------------

def _state(out: Path) -> Path:
    return out / STATE_DIR


def check_output(p: Plan) -> None:
    """Refuse an output directory holding another extraction. Writes nothing."""
    out = Path(p.spec.out)
    run_file = _state(out) / "run.json"
    if out.exists() and not out.is_dir():
        raise OutputConflictError(f"output {out} exists and is not a directory", hint="choose another --out")
    if run_file.exists():
        import json

        try:
            prior = json.loads(run_file.read_text())
        except ValueError:  # not ours to read: treat it as another spec's
            prior = {}
        # A claim without a shard (a run that failed before writing one, e.g. on a corrupt model)
        # protects nothing: the fixed run may take the output over.
        if prior.get("extraction_fingerprint") != p.extraction_fingerprint and _holds_data(out):
            raise OutputConflictError(
                f"output {out} holds a dataset of another spec (model, layers, preprocessing or engine differ)",
                hint="choose a new --out, or delete the old dataset first",
            )
    elif out.exists() and any(out.iterdir()) and not _claim_leftovers_only(out):
        raise OutputConflictError(f"output {out} is not empty and holds no datagen dataset",
                                  hint="choose an empty or new --out directory")


def claim_output(p: Plan) -> None:
    """Refuse an output directory holding another extraction; record ours.

    All or nothing: when it fails part way, what it created is removed and a claim it
    replaced is put back.
    """
    check_output(p)
    out = Path(p.spec.out)
    run_file = _state(out) / "run.json"
    made = _missing_dirs(out) + [d for d in (out / SHARDS_DIR, _state(out), _state(out) / "shards")
                                 if not d.exists() and d != out]
    prior = run_file.read_bytes() if run_file.is_file() else None
    try:
        (out / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        (_state(out) / "shards").mkdir(parents=True, exist_ok=True)
        atomic_write_json(run_file, {"extraction_fingerprint": p.extraction_fingerprint, "spec": p.resolved_spec})
    except BaseException:
        if prior is None:
            run_file.unlink(missing_ok=True)
        else:
            run_file.write_bytes(prior)
        _remove_empty_dirs(made)
        raise


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist, outermost first."""
    missing = []
    while not path.exists() and not path.is_symlink() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing[::-1]


def _remove_empty_dirs(created: list[Path]) -> None:
    """Remove directories a run created, innermost first, each only while it is empty: what
    anyone else put there since (or was there before) is never touched."""
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            pass


def _holds_data(out: Path) -> bool:
    """True when ``out`` holds a shard file or a manifest."""
    return (out / MANIFEST_NAME).exists() or any((out / SHARDS_DIR).glob("shard-*.safetensors"))


def _claim_leftovers_only(out: Path) -> bool:
    """True when ``out`` holds only what claim_output makes before run.json exists (its two
    directories, temporary files): a run killed in that moment left them, and they are ours."""
    for p in out.rglob("*"):
        rel = p.relative_to(out)
        if rel.parts[0] not in (SHARDS_DIR, STATE_DIR) or p.is_symlink():
            return False
        if not p.is_dir() and not (p.name.startswith(".") and ".tmp-" in p.name):
            return False
    return True


def _record_path(out: Path, k: int) -> Path:
    return _state(out) / "shards" / f"shard-{k:06d}.json"


def completed_shards(p: Plan) -> dict[int, ShardRecord]:
    """Shards already on disk for this plan (file present, record with the same key and size)."""
    out = Path(p.spec.out)
    done = {}
    for k in range(p.num_shards):
        rec_path = _record_path(out, k)
        rec = None
        if rec_path.exists():
            try:
                rec = ShardRecord.model_validate_json(rec_path.read_text())
            except ValueError:
                rec = None
        if rec is None:
            # A crash between the shard's rename and its record's: the file is complete (atomic),
            # and its header names its key, so rebuild the record from the file (the run writes
            # it once it has claimed the output).
            rec = recover_record(p, k)
        if rec is None:
            continue
        f = out / rec.path
        # a record is data on disk: it must name this shard's own file, a regular file
        if (rec.shard_key == p.shard_key(k) and rec.path == shard_name(k) and not f.is_symlink()
                and f.is_file() and f.stat().st_size == rec.bytes):
            done[k] = rec
    return done


def recover_record(p: Plan, k: int) -> ShardRecord | None:
    """The record of shard k rebuilt from its file, when the file is this plan's shard k."""
    import json

    from safetensors import safe_open

    from datagen.data.checksums import sha256_file
    from datagen.data.shards import SCALE_TENSOR, fp8_token_stats, layer_stats

    f = Path(p.spec.out) / shard_name(k)
    if not f.is_file() or f.is_symlink():
        return None
    try:
        with safe_open(str(f), "pt") as st:
            meta = json.loads((st.metadata() or {}).get("datagen", "{}"))
            if meta.get("shard_key") != p.shard_key(k):
                return None
            hs = st.get_tensor("hidden_states")
            per_token = fp8_token_stats(hs, st.get_tensor(SCALE_TENSOR)) if meta.get("storage_dtype") else None
            samples = st.get_slice("sample_index").get_shape()[0]
    except Exception:  # unreadable: not a complete shard of ours, extract it again
        return None
    first, count = p.shard_range(k)
    return ShardRecord(
        index=k, path=shard_name(k), first_sample=first, rows=count, samples=samples, tokens=hs.shape[0],
        bytes=f.stat().st_size, sha256=sha256_file(f), shard_key=p.shard_key(k),
        layer_stats=layer_stats(hs, p.layer_ids, per_token),
    )


def _remove_stale(p: Plan) -> None:
    """Temporary files of a crashed run, and shards beyond the dataset's end."""
    out = Path(p.spec.out)
    for d in (out / SHARDS_DIR, _state(out) / "shards", _state(out), out, *(out / stored.PLAN_DIR).glob("*")):
        for f in d.glob(".*.tmp-*"):
            f.unlink(missing_ok=True)
    for f in (out / SHARDS_DIR).glob("shard-*.safetensors"):
        k = int(f.stem.split("-")[1])
        if k >= p.num_shards:
            f.unlink()
            _record_path(out, k).unlink(missing_ok=True)


def build_job(p: Plan, k: int) -> ShardJob:
    from datagen.data.shards import ShardJob  # torch: not for those that only read the step's types

    first, count = p.shard_range(k)
    rows = [r for r in range(first, first + count) if r in p.data.samples]
    return ShardJob(
        index=k,
        path=str(Path(p.spec.out).resolve() / shard_name(k)),
        first_row=first,
        rows=count,
        sample_rows=tuple(rows),
        input_ids=tuple(p.data.samples[r].input_ids for r in rows),
        loss_masks=tuple(p.data.samples[r].loss_mask for r in rows),
        layer_ids=p.layer_ids,
        dtype=p.resolved_spec["storage_dtype"],
        hidden_size=p.info.hidden_size,
        shard_key=p.shard_key(k),
    )


def make_engine(p: Plan) -> Engine:
    e = p.spec.engine
    if e.name is EngineName.HF:
        from datagen.engines.hf import HFEngine

        return HFEngine(p.info.path, layer_ids=p.layer_ids, num_hidden_layers=p.info.num_hidden_layers,
                        dtype=e.dtype, trust_remote_code=e.trust_remote_code)
    from datagen.engines.vllm_engine import VllmEngine
    from datagen.engines.vllm_settings import VllmSettings

    return VllmEngine(p.info, VllmSettings.from_plan(p))


class Progress:
    """A bar with tokens/s on a terminal, a log line every few seconds otherwise."""

    def __init__(self, total_tokens: int, done_tokens: int):
        self.total, self.done = total_tokens, done_tokens
        self.t0 = time.monotonic()
        self.new = 0
        self.last_log = self.t0
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_tokens, initial=done_tokens, unit="tok", unit_scale=True, desc="extract")

    def advance(self, tokens: int) -> None:
        self.done += tokens
        self.new += tokens
        if self.bar is not None:
            self.bar.update(tokens)
            return
        now = time.monotonic()
        if now - self.last_log >= settings.progress_interval_s() or self.done >= self.total:
            self.last_log = now
            log.info("progress %d/%d tokens (%.0f%%), %.0f tokens/s", self.done, self.total,
                     100.0 * self.done / max(self.total, 1), self.rate())

    def rate(self) -> float:
        return self.new / max(time.monotonic() - self.t0, 1e-9)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def check_dataset_unchanged(p: Plan) -> None:
    """The dataset file must still be what the plan read: the manifest records its sha256.

    The shards hold the rows as read at plan time (their keys say so), so a dataset edited
    during the run would get a manifest whose fingerprint no file has. Refused; the next run
    re-plans from the new content, keeps the shards whose rows did not change and redoes the rest.
    """
    path = p.spec.dataset
    try:
        now = file_fingerprint(path)
    except OSError as e:
        raise DatasetError(f"the dataset can no longer be read ({e.strerror}); it was read at the start of the run",
                           path=path, hint="restore the dataset file and run again (finished shards are kept)") from e
    if now != p.data.fingerprint:
        raise DatasetError(
            f"the dataset changed while it was extracted (sha256 {p.data.fingerprint[:12]} at the start, "
            f"{now[:12]} now); no manifest was written",
            path=path,
            hint="do not edit a dataset during a run (write a new file); run again to extract the changed rows "
                 "(shards whose rows did not change are kept)",
        )


def write_manifest(p: Plan, records: dict[int, ShardRecord]) -> Manifest:
    shards = [records[k] for k in range(p.num_shards)]
    from datagen.data.shards import combine_stats

    stats = combine_stats([r.layer_stats for r in shards if r.tokens], p.layer_ids)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        fingerprint=p.fingerprint,
        extraction_fingerprint=p.extraction_fingerprint,
        spec=p.resolved_spec,
        shards=shards,
        totals={
            "rows": p.data.rows,
            "samples": sum(r.samples for r in shards),
            "tokens": sum(r.tokens for r in shards),
            "bytes": sum(r.bytes for r in shards),
            "shards": len(shards),
            "skipped": len(p.data.skipped),
            "truncated": len(p.data.truncated),
        },
        skipped=p.data.skipped,
        truncated=p.data.truncated,
        layer_stats=stats,
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    )
    atomic_write_json(Path(p.spec.out) / MANIFEST_NAME, manifest.model_dump(mode="json"))
    return manifest


def existing_manifest(p: Plan) -> Manifest | None:
    path = Path(p.spec.out) / MANIFEST_NAME
    if not path.exists():
        return None
    try:
        m = Manifest.model_validate_json(path.read_text())
    except ValueError:
        return None
    return m if m.fingerprint == p.fingerprint else None


def extract(spec: ExtractSpec, *, shards: tuple[int, int] | None = None) -> dict:
    """Extract (the shards in ``shards``, or all and then the manifest). Returns a result record."""
    t0 = time.monotonic()
    p, from_store = stored.plan_shards(spec, shards)
    out = Path(spec.out)
    lo, hi = shards if shards is not None else (0, p.num_shards)
    if not (0 <= lo <= hi <= p.num_shards):
        raise SpecError(f"--shards {lo}:{hi} is outside 0:{p.num_shards}",
                        hint=f"this dataset has {p.num_shards} shards of {spec.samples_per_shard} rows")
    if shards is None and (m := existing_manifest(p)) is not None:
        log.info("dataset %s is complete (fingerprint %s): nothing to do", out, p.fingerprint[:12])
        return {**_result(p, m.totals["tokens"], extracted=[], cached=list(range(p.num_shards)),
                          seconds=time.monotonic() - t0), **_manifest_result(out, m)}
    if out.exists() and not out.is_dir():
        raise OutputConflictError(f"output {out} exists and is not a directory", hint="choose another --out")
    # A failure before the first shard leaves the output location as found: nothing is written
    # into it until the engine has started (_commit), and the directories made here for the lock
    # are removed again when they are still empty.
    created: list[Path] = []
    lock = None
    if shards is None:  # a whole run holds a lock beside the output; a range (fan-out) shares it
        try:
            created = _missing_dirs(out.parent)
            out.parent.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(out.parent / f".{out.name}.lock"))
            lock.acquire(timeout=0)
        except Timeout:
            raise OutputConflictError(f"another extraction is writing {out}", hint="wait for it to finish") from None
        except OSError as e:
            _remove_empty_dirs(created)
            raise OutputConflictError(f"cannot create the output directory {out}: {e.strerror}",
                                      hint="choose an --out whose parent is a writable directory") from e
    try:
        return _run_locked(p, shards=shards, lo=lo, hi=hi, t0=t0, store_plan=not from_store)
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
        _remove_empty_dirs(created)  # a no-op once the output is in them


def _run_locked(p: Plan, *, shards: tuple[int, int] | None, lo: int, hi: int, t0: float,
                store_plan: bool) -> dict:
    """The part of ``extract`` that writes, under the output's lock. ``store_plan``: keep the
    (computed) plan in the output for the ranges that follow."""
    out = Path(p.spec.out)
    check_output(p)  # refused before the engine starts; claimed (written) only once it has
    done = completed_shards(p)
    todo = [k for k in range(lo, hi) if k not in done]
    G = p.spec.engine.shard_group
    if G > 1 and todo:  # a group's batches depend on all its rows: recompute whole groups (in range)
        groups = {k // G for k in todo}
        todo = [k for k in range(lo, hi) if k // G in groups]
    log.info("%d shards in range %d:%d, %d already complete, %d to extract", hi - lo, lo, hi,
             hi - lo - len(todo), len(todo))
    records = dict(done)
    tokens_todo = sum(build_job(p, k).tokens for k in todo)
    if not todo:
        _commit(p, done, store_plan=store_plan)
    else:
        progress = Progress(tokens_todo, 0)
        with make_engine(p) as engine:
            engine.start()
            _commit(p, done, store_plan=store_plan)
            for k in todo:
                job = build_job(p, k)
                engine.submit(job)
                progress.advance(job.tokens)
                _save_records(out, engine.completed(), records)
            _save_records(out, engine.finish(), records)
        progress.close()
        missing = [k for k in todo if k not in records]
        if missing:
            raise RuntimeError(f"shards {missing} were submitted but not written")
    manifest = None
    if shards is None:
        check_dataset_unchanged(p)
        manifest = write_manifest(p, records)
    elapsed = time.monotonic() - t0
    result = _result(p, sum(records[k].tokens for k in range(lo, hi)), extracted=todo,
                     cached=[k for k in range(lo, hi) if k not in todo], seconds=elapsed,
                     tokens_extracted=tokens_todo)
    if manifest is not None:
        result.update(_manifest_result(out, manifest))
    return result


def _commit(p: Plan, done: dict[int, ShardRecord], *, store_plan: bool = False) -> None:
    """The run's first writes, once nothing can refuse it any more: claim the output, drop a
    manifest of other rows and what a crashed run left, record shards rebuilt from their files,
    and keep a computed plan for the ranges that follow (``datagen.extraction.stored``)."""
    out = Path(p.spec.out)
    claim_output(p)
    manifest_path = out / MANIFEST_NAME
    if manifest_path.exists():  # a dataset of other rows: no longer complete once we write
        manifest_path.unlink()
    _remove_stale(p)
    for k, rec in done.items():
        if not _record_path(out, k).exists():
            atomic_write_json(_record_path(out, k), rec.model_dump(mode="json"))
    if store_plan:
        stored.store_plan(p)


def _save_records(out: Path, new: list[ShardRecord], records: dict[int, ShardRecord]) -> None:
    for rec in new:
        atomic_write_json(_record_path(out, rec.index), rec.model_dump(mode="json"))
        records[rec.index] = rec


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


# What the result says of the manifest, per shard (its statistics stay in the manifest).
RESULT_SHARD_FIELDS = ("index", "path", "first_sample", "rows", "samples", "tokens", "bytes", "sha256")


def _manifest_result(out: Path, manifest: Manifest) -> dict:
    """The result's account of the manifest in ``out``: the orchestrator keys validation and
    publishing on its sha256 and reports its totals and shards without reading the file."""
    return {
        "bytes": manifest.totals["bytes"],
        "manifest_sha256": sha256_hex((out / MANIFEST_NAME).read_bytes()),
        "totals": manifest.totals,
        "shards": result_shards(manifest),
    }


def result_shards(manifest: Manifest) -> list[dict]:
    """The manifest's shards as a result lists them (``RESULT_SHARD_FIELDS`` of each)."""
    return [s.model_dump(mode="json", include=set(RESULT_SHARD_FIELDS)) for s in manifest.shards]


# --- command line -----------------------------------------------------------------------------

def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip() != "")
    except ValueError:
        raise SpecError(f"--layers {text!r} is not a comma-separated list of integers", hint="e.g. --layers 2,30,58,61") from None


def _range(text: str) -> tuple[int, int]:
    try:
        a, b = text.split(":")
        return int(a), int(b)
    except ValueError:
        raise SpecError(f"--shards {text!r} is not A:B", hint="e.g. --shards 0:4") from None


class Spec(StepSpec):
    """``datagen extract``'s command line: a spec file, options that override it, and a shard range."""

    spec: str | None = Field(None, description="spec JSON file (options given here override it)")
    model: str | None = Field(None, description="local Hugging Face model directory")
    model_revision: str | None = Field(
        None, description="resolved revision of the model (recorded, part of the fingerprint)")
    dataset: str | None = Field(None, description="JSONL dataset")
    out: str | None = Field(None, description="output dataset directory")
    layers: str | None = Field(None, description="comma-separated layer ids in vLLM numbering (default: EAGLE-3 set)")
    max_seq_len: int | None = None
    samples_per_shard: int | None = None
    engine: EngineName | None = None
    tensor_parallel_size: int | None = None
    dtype: Literal["bfloat16", "float16", "float32"] | None = None
    storage_dtype: StorageName | None = Field(
        None, description="dtype of the stored states (default: --dtype); fp8_e4m3 halves the bytes")
    shard_group: int | None = Field(
        None, description="shards streamed through the engine without a drain between them (default 1)")
    max_num_batched_tokens: int | None = None
    shards: str | None = Field(None, description="extract only shards A:B and write no manifest")


class ExtractResult(BaseModel):
    """What `datagen extract` did: the whole dataset, or the shards of ``--shards A:B``."""

    model_config = ConfigDict(frozen=True)

    dataset: str = Field(description="Dataset directory (absolute).")
    fingerprint: str = Field(description="sha256 of the full spec: the dataset's identity.")
    extraction_fingerprint: str = Field(description="The spec without the dataset.")
    layer_ids: list[int] = Field(description="Captured layers (vLLM numbering).")
    shards_total: int = Field(description="Shards of the dataset.")
    shards_extracted: list[int] = Field(description="Shards the engine computed in this run.")
    shards_cached: list[int] = Field(description="Shards of the range that were already complete.")
    tokens: int = Field(description="Tokens in the range's shards.")
    tokens_extracted: int = Field(description="Tokens computed in this run.")
    seconds: float = Field(description="Wall time of the step.")
    tokens_per_s: float = Field(description="Extraction throughput (tokens computed / seconds).")
    engine: dict = Field(description="Engine name, version, patches and attention backend.")
    bytes: Annotated[int | None, Field(exclude_if=lambda v: v is None)] = Field(
        None, description="Bytes of the dataset, when this run wrote its manifest (no --shards).")
    # The manifest, when this run wrote (or found) it: the orchestration reads it from here.
    manifest_sha256: Annotated[str | None, Field(exclude_if=lambda v: v is None)] = Field(
        None, description="sha256 of manifest.json (the key of validation and publishing).")
    totals: Annotated[dict | None, Field(exclude_if=lambda v: v is None)] = Field(
        None, description="The manifest's totals: rows, samples, tokens, bytes, shards, skipped, truncated.")
    shards: Annotated[list[dict] | None, Field(exclude_if=lambda v: v is None)] = Field(
        None, description="The manifest's shards: " + ", ".join(RESULT_SHARD_FIELDS) + " of each.")


Result = ExtractResult


def spec_from_args(args: Spec) -> ExtractSpec:
    """The extraction spec: the ``--spec`` file's, with the options given on top."""
    import json

    raw: dict = {}
    if args.spec:
        try:
            raw = json.loads(Path(args.spec).read_text())
        except (OSError, ValueError) as e:
            raise SpecError(f"cannot read spec file {args.spec}: {e}", hint="pass a JSON spec file") from e
        if not isinstance(raw, dict):
            raise SpecError(f"spec file {args.spec} must hold a JSON object", hint="see README")
    top = {"model": args.model, "model_revision": args.model_revision, "dataset": args.dataset, "out": args.out,
           "max_seq_len": args.max_seq_len, "samples_per_shard": args.samples_per_shard}
    raw.update({k: v for k, v in top.items() if v is not None})
    if args.layers is not None:
        raw["layer_ids"] = list(_layers(args.layers))
    eng = raw.get("engine") or {}
    if not isinstance(eng, dict):
        raise SpecError(f"{args.spec or 'the spec'}: engine must be an object, got {type(eng).__name__}",
                        hint='write e.g. "engine": {"name": "vllm", "tensor_parallel_size": 8}')
    eng = dict(eng)
    for k, v in {"name": args.engine, "tensor_parallel_size": args.tensor_parallel_size, "dtype": args.dtype,
                 "max_num_batched_tokens": args.max_num_batched_tokens,
                 "storage_dtype": getattr(args, "storage_dtype", None),
                 "shard_group": getattr(args, "shard_group", None)}.items():
        if v is not None:
            eng[k] = v
    raw["engine"] = eng
    missing = [k for k in ("model", "dataset", "out") if not raw.get(k)]
    if missing:
        raise SpecError(f"missing {', '.join('--' + m for m in missing)}", hint="see `datagen extract --help`")
    return parse_spec(raw, source=args.spec or "the command line")


def run(spec: Spec) -> ExtractResult:
    """``datagen extract``: the spec the command line gives, extracted (``extract``)."""
    shards = _range(spec.shards) if spec.shards else None
    result = ExtractResult.model_validate(extract(spec_from_args(spec), shards=shards))
    log.info("dataset: %s", result.dataset)
    return result
