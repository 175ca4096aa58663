"""Builders for the flow tests' inputs, each taking keyword overrides."""

from __future__ import annotations

from pathlib import Path

from datagen.testmodels.tiny import make_chat_dataset
from tasks.pipeline_spec import PipelineSpec


def pipeline_spec(*, model: Path, dataset: Path, output: Path, **overrides) -> PipelineSpec:
    """A small CPU extraction with the transformers engine (fast; the engine is not the point)."""
    fields = dict(
        model=str(model),
        dataset=str(dataset),
        output=str(output),
        engine={"name": "hf"},
        samples_per_shard=3,
        shards_per_task=2,
        preprocessing={"max_seq_len": 512},
    )
    fields.update(overrides)
    return PipelineSpec.model_validate(fields)


def chat_rows(path: Path, *, rows: int, seed: int = 0) -> Path:
    return make_chat_dataset(path, rows=rows, seed=seed)


def append_rows(path: Path, *, rows: int, seed: int = 1) -> None:
    """Append ``rows`` new chat rows to a JSONL dataset."""
    extra = make_chat_dataset(path.with_suffix(".extra"), rows=rows, seed=seed)
    with path.open("a") as f:
        f.write(extra.read_text())
    extra.unlink()

