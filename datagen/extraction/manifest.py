"""The manifest of an extraction: written last, from every shard's record.

One writer for both ways a dataset is finished: a single host's `datagen extract` (records from
its own output) and `datagen assemble` (records of shards many hosts put in a bucket, checked
there). Same records, same statistics: the same bytes but for ``created_at``.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from pydantic import ValidationError

from datagen.data.contract import FORMAT_VERSION, MANIFEST_NAME, Manifest, ShardRecord
from datagen.data.dataset import file_fingerprint
from datagen.data.files import atomic_write_json
from datagen.data.media import media_records
from datagen.specs.extraction import sha256_hex
from datagen.errors import DatasetError
from datagen.extraction.plan import Plan

# What a step's result says of the manifest, per shard (its statistics stay in the manifest).
RESULT_SHARD_FIELDS = ("index", "path", "first_sample", "rows", "samples", "tokens", "bytes", "sha256")


def check_dataset_unchanged(p: Plan) -> None:
    """The dataset file must still be what the plan read: the manifest records its sha256.

    The shards hold the rows as read at plan time (their keys say so), so a dataset edited
    during the run would get a manifest whose fingerprint no file has. Refused; the next run
    re-plans from the new content, keeps the shards whose rows did not change and redoes the rest.

    Raises:
        DatasetError: the file can no longer be read, or its content changed.
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
    """Write ``<out>/manifest.json`` (atomically) from a record of every shard of ``p``."""
    from datagen.data.shards.kernels import combine_stats  # torch: not for those that only read the types

    shards = [records[k] for k in range(p.num_shards)]
    stats = combine_stats([r.layer_stats for r in shards if r.tokens], p.layer_ids)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        fingerprint=p.fingerprint,
        extraction_fingerprint=p.extraction_fingerprint,
        spec=p.resolved_spec,
        shards=shards,
        volumes=[str(v) for v in p.volume_dirs[1:]],
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
        media=media_records(p.data),
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    )
    atomic_write_json(Path(p.spec.out) / MANIFEST_NAME, manifest.model_dump(mode="json"))
    return manifest


def existing_manifest(p: Plan) -> Manifest | None:
    """The output's manifest when it is this plan's dataset (same fingerprint); else None."""
    path = Path(p.spec.out) / MANIFEST_NAME
    if not path.exists():
        return None
    try:
        m = Manifest.model_validate_json(path.read_text())
    except ValueError:
        return None
    return m if m.fingerprint == p.fingerprint else None


def result_shards(manifest: Manifest) -> list[dict]:
    """The manifest's shards as a result lists them (``RESULT_SHARD_FIELDS`` of each)."""
    return [s.model_dump(mode="json", include=set(RESULT_SHARD_FIELDS)) for s in manifest.shards]


def manifest_result(out: str | Path, manifest: Manifest) -> dict:
    """A result's account of the manifest in ``out``: the orchestrator keys validation and
    publishing on its sha256 and reports its totals and shards without reading the file."""
    return {
        "bytes": manifest.totals["bytes"],
        "manifest_sha256": sha256_hex((Path(out) / MANIFEST_NAME).read_bytes()),
        "totals": manifest.totals,
        "shards": result_shards(manifest),
    }


def read_records(directory: Path, p: Plan) -> tuple[dict[int, ShardRecord], list[int], list[int]]:
    """This plan's records found in ``directory`` (``shard-NNNNNN.json``), the shards without one,
    and the shards whose record names another shard key (extracted for another model, dataset or
    engine)."""
    found: dict[int, ShardRecord] = {}
    missing: list[int] = []
    foreign: list[int] = []
    for k in range(p.num_shards):
        path = directory / f"shard-{k:06d}.json"
        try:
            rec = ShardRecord.model_validate_json(path.read_bytes())
        except (OSError, ValidationError, ValueError):
            missing.append(k)
            continue
        if rec.index != k or rec.shard_key != p.shard_key(k):
            foreign.append(k)
            continue
        found[k] = rec
    return found, missing, foreign
