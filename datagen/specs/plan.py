"""The plan file: what `datagen plan` made of a spec, written once and read by every later step.

`datagen plan` checks the spec against the model and the dataset and resolves it (the default
layers, max_seq_len, the storage dtype, the engine's description, the fingerprints, where each shard
starts and its key). The record of that, ``ExtractionPlan``, is what a range (`datagen extract
--plan FILE --shards A:B`), finalize (`datagen extract --plan FILE`) and assemble (`datagen assemble
--plan FILE`) are given: they check only that their host matches it
(``datagen.extraction.host.plan_on_host``) and never work the extraction out again. The orchestration
passes it whole, as the plan step's result holds it.

This module holds the record and its file and nothing that inspects a model or reads a dataset, so
the orchestration reads it without torch or vLLM.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from datagen.data.contract import STATE_DIR, ResolvedSpec, ShardFormat, state_bytes
from datagen.specs.extraction import ExtractSpec, StorageName
from datagen.errors import SpecError, spec_error

PLAN_FORMAT = 1  # ExtractionPlan.format_version: a reader refuses another
PLAN_DIR = f"{STATE_DIR}/plan"  # under an output: the stored plans (datagen.extraction.stored), by fingerprint


@dataclass(frozen=True)
class ShardCut:
    """A plan's shards: where they start and what they hold."""

    boundaries: tuple[int, ...]  # (0, b_1, ..., rows): shard k holds rows [b_k, b_k+1)
    tokens: tuple[int, ...]  # tokens stored in shard k (its kept rows'), one per shard

    @classmethod
    def of_rows(cls, boundaries: tuple[int, ...], row_tokens: Sequence[int]) -> "ShardCut":
        """The cut of ``boundaries`` over rows of ``row_tokens`` tokens (0 for a skipped row)."""
        return cls(boundaries, tuple(int(sum(row_tokens[a:b])) for a, b in zip(boundaries, boundaries[1:])))

    @classmethod
    def checked(cls, boundaries: Sequence[int], tokens: Sequence[int], rows: int) -> "ShardCut":
        """A cut read back (a stored plan's): boundaries over ``rows`` and a token count per shard.

        Raises:
            ValueError: naming what is wrong.
        """
        cut = cls(tuple(int(x) for x in boundaries), tuple(int(t) for t in tokens))
        check_boundaries(cut.boundaries, rows)
        if len(cut.tokens) != len(cut.boundaries) - 1:
            raise ValueError(f"{len(cut.tokens)} shards' tokens for {len(cut.boundaries) - 1} shards")
        return cut


def check_boundaries(boundaries: Sequence[int], rows: int) -> None:
    """Boundaries as a plan holds them: from 0 to ``rows``, increasing.

    Raises:
        ValueError: naming what is wrong.
    """
    b = list(boundaries)
    if len(b) < 2 or b[0] != 0 or b[-1] != rows or any(x >= y for x, y in zip(b, b[1:])):
        raise ValueError(f"shard boundaries {b[:4]}...{b[-2:]} do not cut rows 0:{rows} into non-empty shards")


class ExtractionPlan(BaseModel):
    """A spec resolved against its model and dataset: what a dataset of it holds and how it is cut."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: Literal[1] = Field(PLAN_FORMAT, description="Version of the plan file's format.")
    spec: ExtractSpec = Field(description="The extraction spec it was made of, max_seq_len resolved (the value "
                              "used); its paths are where the plan's host found the model and dataset.")
    resolved: ResolvedSpec = Field(description="The resolved spec as the manifest records it: model, layer ids in "
                                   "vLLM numbering, dtypes, preprocessing, the engine and its settings, the dataset.")
    engine: dict[str, Any] = Field(description="The engine the plan was made for (name, version, patches, attention "
                                   "backend, capture path, model runner): a host that describes its engine "
                                   "otherwise is refused.")
    fingerprint: str = Field(description="sha256 of the full spec: the dataset's identity.")
    extraction_fingerprint: str = Field(description="sha256 of the spec without the dataset: in every shard key.")
    boundaries: tuple[int, ...] = Field(description="(0, b_1, ..., rows): shard k holds dataset rows [b_k, b_k+1).")
    tokens: tuple[int, ...] = Field(description="Tokens stored in each shard (its kept rows').")
    shard_keys: tuple[str, ...] = Field(description="Cache key of each shard, by index.")
    shard_group: int = Field(ge=1, description="Shards the engine streams without a drain between them.")
    stored_plan: str | None = Field(
        None, description="Directory of the tokenized rows kept for the ranges (datagen.extraction.stored), absolute; "
        "None when none was kept. A host that cannot read it tokenizes the dataset again and checks the keys.")

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """The captured layers, resolved (vLLM numbering): the order of the stored layer axis."""
        return self.resolved.layer_ids

    @property
    def storage_dtype(self) -> StorageName:
        """The dtype the states are stored in."""
        return self.spec.engine.resolved_storage_dtype

    @property
    def shard_format(self) -> ShardFormat:
        """What every shard of the plan shares (the layer axis, the stored dtype, H): the form the
        engine and the shard jobs are given, from the resolved spec the manifest records."""
        r = self.resolved
        return ShardFormat(layer_ids=r.layer_ids, storage_dtype=r.storage_dtype, hidden_size=r.model.hidden_size)

    @property
    def num_shards(self) -> int:
        return len(self.boundaries) - 1

    @property
    def rows(self) -> int:
        return self.boundaries[-1]

    @property
    def cut(self) -> ShardCut:
        return ShardCut(self.boundaries, self.tokens)

    @property
    def state_bytes(self) -> int:
        """Bytes of stored states per token."""
        f = self.shard_format
        return state_bytes(f.storage_dtype, n_layers=len(f.layer_ids), hidden_size=f.hidden_size)

    @property
    def shard_state_bytes(self) -> tuple[int, ...]:
        """Bytes of stored states of each shard."""
        return tuple(t * self.state_bytes for t in self.tokens)

    @property
    def shard_weights(self) -> dict[str, int]:
        """What the shards weigh in bytes of states: min, median and max."""
        w = self.shard_state_bytes
        return {"min": min(w), "median": int(statistics.median(w)), "max": max(w)}

    @property
    def model_identity(self) -> str:
        """The model's resolved revision, or ``content:<sha256>`` of its files (what the fingerprint holds)."""
        return self.resolved.model.revision or ""

    def on_host(self, *, model: str | None = None, out: str | None = None) -> "ExtractionPlan":
        """The plan with this host's paths: its copy of the model, where it writes. Neither is in a fingerprint."""
        update = {k: v for k, v in (("model", model), ("out", out)) if v is not None}
        return self.model_copy(update={"spec": self.spec.model_copy(update=update)}) if update else self


def plan_dir(out: str | Path, fingerprint: str) -> Path:
    """Where a plan's tokenized rows are kept in the output ``out`` (``datagen.extraction.stored``)."""
    return Path(out) / PLAN_DIR / fingerprint


def read_plan_file(path: str | Path) -> ExtractionPlan:
    """The plan in a file `datagen plan --plan-file FILE` wrote (``--plan FILE``).

    Raises:
        SpecError: the file is missing, unreadable, of another format or not a plan.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise SpecError(f"cannot read the plan file {p}: {e.strerror}",
                        hint="pass the file `datagen plan --plan-file FILE` wrote") from e
    try:
        return ExtractionPlan.model_validate_json(raw)
    except ValidationError as e:
        raise spec_error(e, source=str(p), hint="plan the spec again with this version (`datagen plan --plan-file "
                                               "FILE`): the file is not a plan of this version") from None


def write_plan_file(plan: ExtractionPlan, path: str | Path) -> Path:
    """Write ``plan`` to ``path`` atomically."""
    from datagen.data.files import atomic_write_bytes

    p = Path(path)
    atomic_write_bytes(p, (plan.model_dump_json(indent=1) + "\n").encode())
    return p
