"""The assemble step: ``datagen assemble --plan FILE --records DIR``.

The manifest of a dataset whose shards many hosts wrote to object storage (``datagen.storage.fleet``).
The flow's parent checks every shard object in the bucket (size and sha256 against its record)
and puts the records it found into DIR; this step takes the plan (``--plan FILE``: checked to fit
this host, no weights loaded), requires a record of the plan's shard key for every shard, checks that the dataset file is still
what the plan read, and writes ``<out>/manifest.json`` exactly as `datagen extract` writes a
single host's (same records, same statistics, same bytes but for ``created_at``). The flow
uploads it to the bucket, last.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from datagen.data.contract import MANIFEST_NAME, Manifest
from datagen.specs.extraction import sha256_hex
from datagen.errors import SpecError, ValidationFailed
from datagen.extraction.manifest import (
    RESULT_SHARD_FIELDS, check_dataset_unchanged, read_records, result_shards, write_manifest,
)
from datagen.specs.plan import ExtractionPlan, read_plan_file
from datagen.steps._args import Arg, StepSpec

HELP = "Write the manifest of a dataset whose shards are in object storage, from their checked records."


class Spec(StepSpec):
    """``datagen assemble``'s input: the plan, and the directory of records."""

    SPEC_FILE: ClassVar[bool] = True

    plan: Annotated[ExtractionPlan, Arg(metavar="FILE", parse=read_plan_file)] = Field(
        description="the plan `datagen plan --plan-file FILE` wrote; the manifest is written into its output")
    records: str = Field(description="directory of shard-NNNNNN.json records (checked in the bucket)")


class AssembleResult(BaseModel):
    """The manifest `datagen assemble` wrote."""

    model_config = ConfigDict(frozen=True)

    dataset: str = Field(description="Directory the manifest was written to (absolute).")
    fingerprint: str = Field(description="The manifest's fingerprint.")
    manifest_sha256: str = Field(description="sha256 of manifest.json.")
    layer_ids: list[int] = Field(description="Captured layers (vLLM numbering).")
    engine: dict = Field(description="Engine name, version, patches and attention backend.")
    totals: dict = Field(description="rows, samples, tokens, bytes, shards, skipped, truncated.")
    shards_total: int = Field(description="Shards of the dataset.")
    shards: list[dict] = Field(description="The manifest's shards: " + ", ".join(RESULT_SHARD_FIELDS) + " of each.")

    @classmethod
    def of_manifest(cls, raw: bytes, *, dataset: str) -> "AssembleResult":
        """The account of a manifest already written (``raw``, its bytes) where ``dataset`` says:
        what the orchestration reports when the dataset's bucket holds its manifest already."""
        manifest = Manifest.model_validate_json(raw)
        return cls(
            dataset=dataset,
            fingerprint=manifest.fingerprint,
            manifest_sha256=sha256_hex(raw),
            layer_ids=list(manifest.spec.layer_ids),
            engine=manifest.spec.engine.record(),
            totals=manifest.totals,
            shards_total=len(manifest.shards),
            shards=result_shards(manifest),
        )


Result = AssembleResult


def run(args: Spec) -> AssembleResult:
    from datagen.extraction.host import plan_on_host

    records_dir = Path(args.records)
    if not records_dir.is_dir():
        raise SpecError(f"--records {records_dir} is not a directory", hint="pass the directory of shard records")
    p, _ = plan_on_host(args.plan, shards=(0, args.plan.num_shards))
    spec = p.spec
    records, missing, foreign = read_records(records_dir, p)
    if missing or foreign:
        def shown(ks: list[int]) -> str:
            return ", ".join(str(k) for k in ks[:20]) + (" ..." if len(ks) > 20 else "")

        parts = ([f"{len(missing)} are not in the dataset's bucket ({shown(missing)})"] if missing else []) + (
            [f"{len(foreign)} were extracted with another shard key ({shown(foreign)}): the model, dataset "
             "or engine differ from this plan's"] if foreign else [])
        raise ValidationFailed(
            f"of {p.num_shards} shards, " + "; ".join(parts),
            hint="run the extraction again: the ranges that hold them are extracted again (the rest is kept)",
        )
    check_dataset_unchanged(p)
    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = write_manifest(p, records)
    raw = (out / MANIFEST_NAME).read_bytes()
    return AssembleResult(
        dataset=str(out.resolve()),
        fingerprint=p.fingerprint,
        manifest_sha256=sha256_hex(raw),
        layer_ids=list(p.layer_ids),
        engine=p.engine_desc,
        totals=manifest.totals,
        shards_total=p.num_shards,
        shards=result_shards(manifest),
    )
