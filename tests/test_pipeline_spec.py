"""The pipeline spec: validation, derived step specs, shard ranges."""

from __future__ import annotations

import pytest

from datagen.errors import SpecError
from tasks.pipeline_spec import PipelineSpec, ShardRange, parse_pipeline_spec
from tasks.pipeline_spec import Runner


def spec(**overrides) -> PipelineSpec:
    fields = dict(model="models/tiny", dataset="data/chat.jsonl", output="out/ds")
    fields.update(overrides)
    return PipelineSpec.model_validate(fields)


def test_ranges_cut_the_shards_into_pieces_of_shards_per_task():
    assert [r.arg for r in spec(shards_per_task=3).ranges(8)] == ["0:3", "3:6", "6:8"]
    assert spec().ranges(0) == []


def test_an_empty_shard_range_is_refused():
    with pytest.raises(ValueError, match="empty"):
        ShardRange(first=3, stop=3)


def test_resolved_makes_local_paths_absolute_and_keeps_remote_sources(tmp_path):
    s = spec(model="hf://org/name@abc", model_cache="cache").resolved(tmp_path)
    assert s.model == "hf://org/name@abc"
    assert s.dataset == str(tmp_path / "data/chat.jsonl") and s.output == str(tmp_path / "out/ds")
    assert s.model_cache == str(tmp_path / "cache")
    assert spec().resolved(tmp_path).model == str(tmp_path / "models/tiny")


def test_the_extract_spec_carries_what_decides_the_dataset():
    s = spec(layer_ids=[2, 30, 58, 61], samples_per_shard=32, preprocessing={"max_seq_len": 8192},
             engine={"tensor_parallel_size": 8})
    x = s.extract_spec(model_dir="/models/kimi", model_revision="abc")
    assert (x.model, x.model_revision, x.layer_ids, x.samples_per_shard, x.max_seq_len) == (
        "/models/kimi", "abc", (2, 30, 58, 61), 32, 8192)
    assert x.engine.tensor_parallel_size == 8


def test_shards_are_sized_by_bytes_unless_the_spec_names_rows():
    x = spec().extract_spec(model_dir="/m", model_revision=None)
    assert (x.shard_sizing.value, x.resolved_shard_bytes, x.samples_per_shard) == ("bytes", 1 << 30, None)
    x = spec(shard_bytes=2 << 30).extract_spec(model_dir="/m", model_revision=None)
    assert (x.shard_sizing.value, x.resolved_shard_bytes) == ("bytes", 2 << 30)
    assert spec(samples_per_shard=8).extract_spec(model_dir="/m", model_revision=None).shard_sizing.value == "rows"


def test_the_sources_spec_is_what_env_check_and_download_read():
    from datagen.specs.source import parse_sources_spec

    parsed = parse_sources_spec(spec(model="hf://org/name@main", layer_ids=[1, 2]).sources_spec())
    assert parsed.model == "hf://org/name@main" and parsed.layer_ids == (1, 2)


# ExtractSpec's fields that are not the user's extraction choices: set by ``extract_spec`` from the run (the
# downloaded model, its revision, the output, preprocessing's max_seq_len), or given only on the command line
# of `datagen extract` (further output volumes, another tokenizer).
FROM_THE_RUN = {"model", "model_revision", "out", "max_seq_len"}
COMMAND_LINE_ONLY = {"volumes", "tokenizer"}


def own_fields(cls) -> set[str]:
    """The fields ``cls`` itself declares (not those it derives)."""
    return set(cls.__dict__.get("__annotations__", {})) & set(cls.model_fields)


def test_each_extraction_choice_is_declared_once_in_the_spec_package():
    from datagen.specs.extraction import CaptureChoices, ExtractionChoices, ExtractSpec
    from datagen.specs.source import ModelChoice, SourcesSpec

    choices = set(ExtractionChoices.model_fields)
    assert choices == {"layer_ids", "engine", "dataset", "shard_bytes", "samples_per_shard"}
    for cls in (PipelineSpec, SourcesSpec):  # derived, never declared again
        assert not own_fields(cls) & (choices | set(ModelChoice.model_fields)), cls
    assert not own_fields(ExtractSpec) & choices  # its own model is the downloaded directory, not the source
    assert set(CaptureChoices.model_fields) <= set(SourcesSpec.model_fields)
    # a field added to ExtractSpec itself, rather than to ExtractionChoices, must say why here
    assert set(ExtractSpec.model_fields) == choices | FROM_THE_RUN | COMMAND_LINE_ONLY
    assert set(PipelineSpec.model_fields) & set(ExtractSpec.model_fields) == choices | {"model"}


def test_every_extraction_choice_reaches_the_spec_the_plan_is_given():
    s = spec(layer_ids=[1, 5], dataset="rows.jsonl", samples_per_shard=7,
             engine={"name": "hf", "dtype": "float32", "max_num_batched_tokens": 64, "storage_dtype": "fp8_e4m3"})
    x = s.extract_spec(model_dir="/m", model_revision=None)
    assert x.extraction_choices() == s.extraction_choices()
    assert spec(shard_bytes=123).extract_spec(model_dir="/m", model_revision=None).shard_bytes == 123


def test_the_sources_spec_carries_the_model_its_cache_the_layers_and_the_engine():
    from datagen.specs.source import parse_sources_spec

    s = spec(model="hf://org/name@v1", model_cache="/cache", layer_ids=[3], engine={"tensor_parallel_size": 4})
    parsed = parse_sources_spec(s.sources_spec())
    assert (parsed.model, parsed.model_cache, parsed.layer_ids, parsed.engine, parsed.out) == (
        s.model, "/cache", (3,), s.engine, s.output)


def test_only_cuda_specs_ask_for_gpus():
    assert spec(engine={"tensor_parallel_size": 8}).gpus == 0
    assert spec(engine={"tensor_parallel_size": 8}, device="cuda").gpus == 8


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"model": "ftp://x/y"}, "model"),
        ({"dataset": "s3://bucket/chat.jsonl"}, "dataset"),
        ({"output": "s3://bucket/out"}, "output"),
        ({"publish_to": "/local/dir"}, "publish_to"),
        ({"layer_ids": [30, 2]}, "layer_ids"),
        ({"shards_per_task": 0}, "shards_per_task"),
        ({"shard_bytes": 0}, "shard_bytes"),
        ({"shard_bytes": 1 << 30, "samples_per_shard": 8}, "name one"),
        ({"runner": "kubernetes"}, "runner"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_a_bad_field_is_named_in_one_spec_error(overrides, field):
    raw = {"model": "m", "dataset": "d.jsonl", "output": "o", **overrides}
    with pytest.raises(SpecError, match=field):
        parse_pipeline_spec(raw)


def test_ranges_in_flight_above_one_fans_out_to_a_bucket():
    assert not spec().fans_out
    assert spec(ranges_in_flight=4, publish_to="s3://datasets/ds").fans_out
    with pytest.raises(SpecError, match="publish_to"):
        parse_pipeline_spec({"model": "m", "dataset": "d.jsonl", "output": "o", "ranges_in_flight": 4})


def test_validation_settings_are_the_validate_steps_own():
    from datagen.steps.validate import Spec as ValidateSpec

    s = spec(validation={"golden_samples": 0, "previous": "last"}).resolved()
    step = ValidateSpec(**s.validation.model_dump(mode="json"), dataset="ds")
    assert step.settings() == s.validation and step.golden_samples == 0 and step.previous.endswith("/last")
    assert spec().runner is Runner.LOCAL
