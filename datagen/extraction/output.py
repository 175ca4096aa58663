"""The output directory of an extraction: its claim, what a resumed run keeps, what a crash left.

A run claims its output (``.datagen/run.json``: the extraction fingerprint and the resolved spec)
only once nothing can refuse it any more; before that, ``check_output`` refuses an output that
holds another extraction and writes nothing. A shard is complete when its file exists under its
final name (writes are atomic) and its record in ``.datagen/shards/`` carries the same shard key;
a shard whose record a crash lost is recognised by the key in its file's header
(``recover_record``).
"""

from __future__ import annotations

import json
from pathlib import Path

from datagen.data.contract import MANIFEST_NAME, SHARDS_DIR, STATE_DIR, ShardRecord, shard_name
from datagen.data.shards.writer import writer_rank
from datagen.specs.extraction import EngineName
from datagen.data.files import atomic_write_json, fsync_dir
from datagen.errors import OutputConflictError
from datagen.extraction import stored
from datagen.extraction.plan import Plan


def state_dir(out: str | Path) -> Path:
    """The extraction's private state in ``out`` (not part of the data contract)."""
    return Path(out) / STATE_DIR


def run_file(out: str | Path) -> Path:
    """The claim of ``out``: the extraction fingerprint and resolved spec of the run that owns it."""
    return state_dir(out) / "run.json"


def record_path(out: str | Path, k: int) -> Path:
    """Where the record of shard ``k`` is kept while the dataset is being written."""
    return state_dir(out) / "shards" / f"shard-{k:06d}.json"


def check_output(p: Plan) -> None:
    """Refuse an output directory holding another extraction. Writes nothing.

    Raises:
        OutputConflictError: ``out`` is a file, holds a dataset of another spec, or holds files
            that are no datagen dataset.
    """
    out = Path(p.spec.out)
    claim = run_file(out)
    if out.exists() and not out.is_dir():
        raise OutputConflictError(f"output {out} exists and is not a directory", hint="choose another --out")
    check_volumes(p)
    if claim.exists():
        try:
            prior = json.loads(claim.read_text())
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


def check_volumes(p: Plan) -> None:
    """Refuse further output volumes that are missing, not writable directories, or named twice
    (also as ``out``, or one inside another). Writes nothing.

    Raises:
        OutputConflictError: naming the volume and what is wrong with it.
    """
    import os

    seen: dict[Path, str] = {}
    out = Path(p.spec.out).absolute()
    seen[Path(os.path.realpath(out))] = f"the output {out}"
    for v in p.spec.volumes:
        d = Path(v).absolute()
        if not d.is_dir():
            raise OutputConflictError(f"output volume {v} {'is not a directory' if d.exists() else 'does not exist'}",
                                      hint="create the directory (mount the volume) first, or leave it out of volumes")
        if not os.access(d, os.W_OK | os.X_OK):
            raise OutputConflictError(f"output volume {v} is not writable", hint="fix its permissions, or leave it out")
        real = Path(os.path.realpath(d))
        for other, name in seen.items():
            if real == other or other in real.parents or real in other.parents:
                raise OutputConflictError(
                    f"output volume {v} is {'the same directory as' if real == other else 'nested with'} {name}",
                    hint="name each volume once, each a directory of its own outside the others")
        seen[real] = f"volume {v}"


def claim_output(p: Plan) -> None:
    """Refuse an output directory holding another extraction; record ours.

    All or nothing: when it fails part way, what it created is removed and a claim it
    replaced is put back.
    """
    check_output(p)
    out = Path(p.spec.out)
    claim = run_file(out)
    made = missing_dirs(out) + [d for d in (out / SHARDS_DIR, state_dir(out), state_dir(out) / "shards")
                                if not d.exists() and d != out]
    prior = claim.read_bytes() if claim.is_file() else None
    try:
        (out / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        (state_dir(out) / "shards").mkdir(parents=True, exist_ok=True)
        for v in p.volume_dirs[1:]:  # the volumes exist (check_volumes): only their shards/ is made
            if not (v / SHARDS_DIR).exists():
                made.append(v / SHARDS_DIR)
                (v / SHARDS_DIR).mkdir()
        atomic_write_json(claim, {"extraction_fingerprint": p.extraction_fingerprint, "spec": p.resolved_spec.record()})
    except BaseException:
        if prior is None:
            claim.unlink(missing_ok=True)
        else:
            claim.write_bytes(prior)
        remove_empty_dirs(made)
        raise


def claimed_by(p: Plan) -> bool:
    """True when ``p``'s extraction has claimed its output (a run of this spec wrote there)."""
    try:
        return json.loads(run_file(p.spec.out).read_text()).get("extraction_fingerprint") == p.extraction_fingerprint
    except (OSError, ValueError, AttributeError):
        return False


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist, outermost first."""
    missing = []
    while not path.exists() and not path.is_symlink() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing[::-1]


def remove_empty_dirs(created: list[Path]) -> None:
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


def completed_shards(p: Plan) -> dict[int, ShardRecord]:
    """Shards already on disk for this plan (file present, record with the same key and size)."""
    out = Path(p.spec.out)
    done = {}
    for k in range(p.num_shards):
        rec_path = record_path(out, k)
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
        f = p.shard_dir(k) / rec.path
        # a record is data on disk: it must name this shard's own file, a regular file, on its volume
        if (rec.shard_key == p.shard_key(k) and rec.path == shard_name(k) and rec.volume == p.volume_of(k)
                and not f.is_symlink()
                and f.is_file() and f.stat().st_size == rec.bytes):
            done[k] = rec
    return done


def recover_record(p: Plan, k: int) -> ShardRecord | None:
    """The record of shard k rebuilt from its file, when the file is this plan's shard k."""
    from safetensors import safe_open

    from datagen.data.checksums import sha256_file
    from datagen.data.shards.format import SCALE_TENSOR
    from datagen.data.shards.kernels import fp8_token_stats, layer_stats

    f = p.shard_dir(k) / shard_name(k)
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
        layer_stats=layer_stats(hs, p.layer_ids, per_token), volume=p.volume_of(k), written_by=writer_of(p, k),
    )


def writer_of(p: Plan, k: int) -> int | None:
    """The tensor-parallel rank that writes shard k on the vLLM engine (``writer_rank``); None for
    the transformers engine, which has no ranks."""
    e = p.spec.engine
    return writer_rank(k, e.tensor_parallel_size) if e.name is EngineName.VLLM else None


def remove_stale(p: Plan) -> None:
    """Temporary files of a crashed run, and shards beyond the dataset's end."""
    out = Path(p.spec.out)
    volumes = [v / SHARDS_DIR for v in p.volume_dirs]
    for d in (*volumes, state_dir(out) / "shards", state_dir(out), out, *(out / stored.PLAN_DIR).glob("*")):
        for f in d.glob(".*.tmp-*"):
            f.unlink(missing_ok=True)
    for f in (f for d in volumes for f in d.glob("shard-*.safetensors")):
        k = int(f.stem.split("-")[1])
        if k >= p.num_shards and f.parent == p.shard_dir(k) / SHARDS_DIR:
            f.unlink()
            record_path(out, k).unlink(missing_ok=True)


def save_records(out: str | Path, new: list[ShardRecord], records: dict[int, ShardRecord]) -> None:
    """Keep the records of shards just written (on disk, and in ``records``): each file synced,
    then their directory once."""
    for rec in new:
        atomic_write_json(record_path(out, rec.index), rec.model_dump(mode="json"), sync_dir=False)
    if new:
        fsync_dir(record_path(out, new[0].index).parent)
    for rec in new:
        records[rec.index] = rec


def commit(p: Plan, done: dict[int, ShardRecord], *, store_plan: bool = False) -> None:
    """The run's first writes, once nothing can refuse it any more: claim the output, drop a
    manifest of other rows and what a crashed run left, record shards rebuilt from their files,
    and keep a computed plan for the ranges that follow (``datagen.extraction.stored``)."""
    out = Path(p.spec.out)
    claim_output(p)
    manifest_path = out / MANIFEST_NAME
    if manifest_path.exists():  # a dataset of other rows: no longer complete once we write
        manifest_path.unlink()
    remove_stale(p)
    for k, rec in done.items():
        if not record_path(out, k).exists():
            atomic_write_json(record_path(out, k), rec.model_dump(mode="json"))
    if store_plan:
        stored.store_plan(p)
