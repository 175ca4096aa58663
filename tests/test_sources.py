"""datagen.specs.source: model source strings and the env-check / download spec."""

from __future__ import annotations

import pytest

from datagen.errors import SpecError
from datagen.storage.model_files import needed_files
from datagen.specs.source import (
    HubSource,
    LocalSource,
    S3Source,
    parse_model_source,
    parse_sources_spec,
)


def test_hub_source_defaults_to_main_and_knows_a_pinned_commit():
    assert parse_model_source("hf://moonshotai/Kimi-K2.5") == HubSource("moonshotai/Kimi-K2.5", "main")
    sha = "a" * 40
    src = parse_model_source(f"hf://org/name@{sha}")
    assert src.revision == sha and src.pinned
    assert not parse_model_source("hf://org/name@v1.0").pinned


def test_s3_source_strips_slashes_and_refuses_bad_bucket_names():
    assert parse_model_source("s3://models/kimi/k2.5/") == S3Source("models", "kimi/k2.5")
    assert parse_model_source("s3://models") == S3Source("models", "")
    for bad in ("s3://Models/x", "s3://a/x", "s3://models/a//b", "s3://models/../x"):
        with pytest.raises(SpecError):
            parse_model_source(bad)


def test_a_path_is_a_local_source_and_unknown_schemes_are_refused(tmp_path):
    assert parse_model_source(str(tmp_path)) == LocalSource(tmp_path)
    with pytest.raises(SpecError, match="unknown scheme"):
        parse_model_source("gs://bucket/model")
    with pytest.raises(SpecError, match="hf://org/name"):
        parse_model_source("hf://just-a-name")


def test_a_source_is_parsed_once_per_process_and_a_relative_directory_against_its_cwd(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    here = parse_model_source("model")
    assert here == LocalSource(tmp_path / "a" / "model")
    assert parse_model_source(" model ") is here  # the same text: the same parsed source
    assert parse_model_source("hf://org/name") is parse_model_source("hf://org/name")
    monkeypatch.chdir(tmp_path / "b")
    assert parse_model_source("model") == LocalSource(tmp_path / "b" / "model")  # another cwd: parsed again


def test_only_the_engines_files_are_needed_and_code_only_when_trusted():
    files = [
        "config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
        "tokenizer.json", "tiktoken.model", "chat_template.jinja", "README.md", "pytorch_model.bin",
        "original/consolidated.00.pth", "modeling_deepseek.py", "tokenization_kimi.py", "images/logo.png",
    ]
    plain = needed_files(files, trust_remote_code=False)
    assert plain == sorted([
        "config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
        "tokenizer.json", "tiktoken.model", "chat_template.jinja",
    ])
    trusted = needed_files(files, trust_remote_code=True)
    assert set(trusted) - set(plain) == {"modeling_deepseek.py", "tokenization_kimi.py"}


def test_spec_errors_name_every_bad_field():
    with pytest.raises(SpecError) as e:
        parse_sources_spec({"model": "gs://x", "out": "ftp://y", "engine": {"tensor_parallel_size": 0}, "extra": 1})
    text = str(e.value)
    for field in ("model", "out", "engine.tensor_parallel_size", "extra"):
        assert field in text
