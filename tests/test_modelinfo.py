"""What a model directory is, read from config.json and the weights' headers: multimodal wrappers
(Kimi-K2.5's text_config), quantization in words, layer counts, the weight files an index names,
the content fingerprint. Model directories are written by hand (config and a small safetensors
file): no model is built, no weight is loaded."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from datagen.errors import ModelError, ModelNotFoundError, SpecError, UnsafePathError
from datagen.models import modelinfo
from datagen.models.modelinfo import (
    check_layer_ids,
    describe_quantization,
    has_tokenizer_files,
    inspect_model,
    model_content_hash,
    read_safetensors_header,
)
from datagen.models.kimi_config import (
    KIMI_K25_VOCAB,
    kimi_width,
    quantization_config,
    text_config,
    vision_config,
)


def kimi_config(*, num_layers: int = 61, quantized: bool = True) -> dict:
    """Kimi-K2.5's config.json at its real sizes: the wrapper around a DeepseekV3 text_config."""
    w = kimi_width()
    text = text_config(vocab_size=w["vocab_size"], num_layers=num_layers, hidden_size=w["hidden_size"],
                       num_attention_heads=w["num_attention_heads"], q_lora_rank=w["q_lora_rank"],
                       kv_lora_rank=w["kv_lora_rank"], qk_rope_head_dim=w["qk_rope_head_dim"],
                       qk_nope_head_dim=w["qk_nope_head_dim"], v_head_dim=w["v_head_dim"],
                       intermediate_size=w["intermediate_size"], moe_intermediate_size=w["moe_intermediate_size"],
                       n_routed_experts=384, num_experts_per_tok=8, max_position_embeddings=262144)
    if quantized:
        text["quantization_config"] = quantization_config()
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
        "model_type": "kimi_k25",
        "text_config": text,
        # the vision tower has its own (different) layer count and width: not the decoder's
        "vision_config": vision_config(hidden_size=1152, num_layers=27, num_heads=16, intermediate_size=4304,
                                       pos_emb=64),
    }


def llama_config(**overrides) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 6,
           "hidden_size": 64, "vocab_size": 400, "max_position_embeddings": 2048}
    cfg.update(overrides)
    return cfg


def model_dir(root: Path, cfg: dict, *, weights: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    for name, tensors in (weights if weights is not None else {"model.safetensors": {"w": torch.ones(2, 3)}}).items():
        save_file(tensors, str(root / name))
    return root


# --- the wrapper, its text_config and the quantization ------------------------------------------------

def test_kimi_wrapper_is_described_by_its_text_config_61_layers_and_int4_experts(tmp_path):
    info = inspect_model(model_dir(tmp_path / "kimi", kimi_config()))
    assert info.architecture == "KimiK25ForConditionalGeneration"
    assert info.text_architecture == "DeepseekV3ForCausalLM"  # what vLLM runs inside the wrapper
    assert info.model_type == "kimi_k2"  # the text model's, not the wrapper's kimi_k25
    # the decoder's 61 layers and width, not the vision tower's 27 layers of 1152
    assert (info.num_hidden_layers, info.hidden_size, info.vocab_size) == (61, 7168, KIMI_K25_VOCAB)
    assert info.max_position_embeddings == 262144
    assert info.quantization == "compressed-tensors pack-quantized int4 group 32"
    assert info.wants_remote_code is True  # auto_map, accepted for an architecture datagen captures
    assert info.multimodal


def test_the_layer_count_follows_the_text_config_and_bounds_the_layer_ids(tmp_path):
    info = inspect_model(model_dir(tmp_path / "kimi", kimi_config(num_layers=3, quantized=False)))
    assert info.num_hidden_layers == 3 and info.quantization is None
    check_layer_ids((0, 2, 3), info)  # id N: the last layer's output before the final norm
    with pytest.raises(SpecError, match=r"layer ids \[4\] are out of range .* with 3 layers: valid ids are 0..3") as e:
        check_layer_ids((2, 4), info)
    assert e.value.hint == "the EAGLE-3 default for this model is 0,1,2,3"
    big = inspect_model(model_dir(tmp_path / "kimi61", kimi_config()))
    with pytest.raises(SpecError) as e:
        check_layer_ids((62,), big)
    assert e.value.hint == "the EAGLE-3 default for this model is 2,30,58,61"


def test_a_plain_causal_lm_is_its_own_text_architecture_and_unquantized(tmp_path):
    info = inspect_model(model_dir(tmp_path / "m", llama_config()))
    assert (info.architecture, info.text_architecture, info.model_type) == ("LlamaForCausalLM", "LlamaForCausalLM", "llama")
    assert (info.num_hidden_layers, info.hidden_size, info.vocab_size) == (6, 64, 400)
    assert info.quantization is None and info.wants_remote_code is False and not info.multimodal
    assert info.weight_files == ("model.safetensors",) and info.path == str((tmp_path / "m").resolve())


@pytest.mark.parametrize("cfg, words", [
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "fp8"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                              "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}}}}},
     "compressed-tensors float-quantized float8"),
    ({"quantization_config": {"format": "pack-quantized"}}, "quantized pack-quantized"),
    ({"text_config": {"quantization_config": quantization_config()}}, "compressed-tensors pack-quantized int4 group 32"),
    ({"quantization_config": None, "text_config": {}}, None),
    ({"quantization_config": "int4"}, None),  # not an object: nothing to say
    ({}, None),
])
def test_quantization_is_described_from_the_top_level_or_the_text_config(cfg, words):
    assert describe_quantization(cfg) == words


def test_a_top_level_quantization_beats_the_text_configs(tmp_path):
    cfg = llama_config(quantization_config={"quant_method": "fp8"})
    assert inspect_model(model_dir(tmp_path / "m", cfg)).quantization == "fp8"


# --- refusals before any weight is read ---------------------------------------------------------------

def test_a_missing_directory_or_config_is_model_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        inspect_model(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        inspect_model(tmp_path / "empty")


def test_a_config_that_is_not_json_or_lacks_a_size_is_refused(tmp_path):
    m = model_dir(tmp_path / "m", llama_config())
    (m / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    with pytest.raises(ModelError, match="is not valid JSON"):
        inspect_model(m)
    cfg = llama_config()
    del cfg["hidden_size"]
    (m / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="lacks 'hidden_size'"):
        inspect_model(m)
    kimi = kimi_config()
    del kimi["text_config"]["num_hidden_layers"]  # the wrapper's vision layers must not stand in
    (m / "config.json").write_text(json.dumps(kimi))
    with pytest.raises(ModelError, match="lacks 'num_hidden_layers'"):
        inspect_model(m)


def test_an_architecture_that_cannot_be_captured_is_refused_with_the_supported_list(tmp_path):
    m = model_dir(tmp_path / "m", llama_config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ModelError, match="architecture GPT2LMHeadModel cannot be captured: .*LlamaForCausalLM"):
        inspect_model(m)
    (m / "config.json").write_text(json.dumps(llama_config(architectures=[])))
    with pytest.raises(ModelError, match=r"architecture \(none\) cannot be captured"):
        inspect_model(m)


def test_remote_code_of_an_unknown_architecture_needs_trust_and_is_still_not_captured(tmp_path):
    m = model_dir(tmp_path / "m", llama_config(architectures=["MyModel"], auto_map={"AutoModel": "x.MyModel"}))
    with pytest.raises(ModelError, match="asks to run its own Python code"):
        inspect_model(m)
    with pytest.raises(ModelError, match="architecture MyModel cannot be captured"):
        inspect_model(m, trust_remote_code=True)


# --- the weight files ---------------------------------------------------------------------------------

def test_weight_files_are_the_index_names_or_every_safetensors_file(tmp_path):
    two = {"a.safetensors": {"x": torch.zeros(2)}, "b.safetensors": {"y": torch.zeros(3)}}
    m = model_dir(tmp_path / "m", llama_config(), weights=two)
    assert inspect_model(m).weight_files == ("a.safetensors", "b.safetensors")
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "b.safetensors", "y": "b.safetensors"}}))
    assert inspect_model(m).weight_files == ("b.safetensors",)  # the index decides, once per file


def test_an_index_naming_a_missing_or_outside_file_or_corrupt_is_refused(tmp_path):
    m = model_dir(tmp_path / "m", llama_config())
    index = m / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "model-00002.safetensors"}}))
    with pytest.raises(ModelNotFoundError, match=r"missing weight files \['model-00002.safetensors'\]"):
        inspect_model(m)
    for outside in ("../model.safetensors", "/etc/passwd", "sub\\model.safetensors", ""):
        index.write_text(json.dumps({"weight_map": {"w": outside}}))
        with pytest.raises(UnsafePathError, match="outside the model directory"):
            inspect_model(m)
    index.write_text(json.dumps({"weights": {}}))
    with pytest.raises(ModelError, match="model.safetensors.index.json is corrupt"):
        inspect_model(m)


def test_a_directory_without_safetensors_is_refused(tmp_path):
    m = model_dir(tmp_path / "m", llama_config(), weights={})
    (m / "pytorch_model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ModelNotFoundError, match="has no safetensors weights"):
        inspect_model(m)


def _raw_file(path: Path, header: dict, data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_a_header_written_by_safetensors_is_read_back(tmp_path):
    save_file({"a": torch.zeros(2, 3, dtype=torch.bfloat16), "b": torch.ones(4, dtype=torch.int32)},
              str(tmp_path / "w.safetensors"), metadata={"format": "pt"})
    header = read_safetensors_header(tmp_path / "w.safetensors")
    assert header["__metadata__"] == {"format": "pt"}
    assert header["a"]["dtype"] == "BF16" and header["a"]["shape"] == [2, 3]
    assert header["b"]["data_offsets"][1] - header["b"]["data_offsets"][0] == 16


@pytest.mark.parametrize("header, data, error", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "is truncated: "),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, "4 more than its header describes"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "has a hole"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "overlaps"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "has 8 bytes for shape \\[3\\] of F32"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "not a list of non-negative integers"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, "not \\[begin, end\\]"),
    ({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, "lacks dtype, shape or data_offsets"),
    ([1, 2], b"", "not a JSON object"),
])
def test_a_header_that_does_not_tile_its_data_is_refused(tmp_path, header, data, error):
    with pytest.raises(ModelError, match=error):
        read_safetensors_header(_raw_file(tmp_path / "w.safetensors", header, data))


def test_a_header_shorter_than_its_length_prefix_or_claiming_too_much_is_refused(tmp_path):
    p = tmp_path / "w.safetensors"
    p.write_bytes(b"\x01\x02")
    with pytest.raises(ModelError, match="truncated \\(no header\\)"):
        read_safetensors_header(p)
    p.write_bytes(struct.pack("<Q", modelinfo.MAX_SAFETENSORS_HEADER + 1) + b"{}")
    with pytest.raises(ModelError, match="claims a .*-byte header"):
        read_safetensors_header(p)


# --- tokenizer files and the content fingerprint ------------------------------------------------------

@pytest.mark.parametrize("name, found", [
    ("tokenizer.json", True), ("tiktoken.model", True), ("cl100k.tiktoken", True), ("vocab.json", True),
    ("tokenizer_config.json", False), ("special_tokens_map.json", False),
])
def test_a_tokenizer_is_found_by_its_own_files_not_its_config(tmp_path, name, found):
    (tmp_path / name).write_text("{}")
    assert has_tokenizer_files(tmp_path) is found


def test_the_content_fingerprint_follows_configs_and_weights_and_samples_large_files(tmp_path, monkeypatch):
    m = model_dir(tmp_path / "m", llama_config(), weights={"model.safetensors": {"w": torch.zeros(64, 64)}})
    info = inspect_model(m)
    base = model_content_hash(info)
    assert model_content_hash(info) == base
    (m / "README.md").write_text("not part of the model")  # neither a config nor a weight file
    assert model_content_hash(info) == base
    (m / "generation_config.json").write_text('{"max_length": 10}')
    with_gen = model_content_hash(info)
    assert with_gen != base

    # past FULL_HASH_LIMIT a weight file counts by size, first and last MiB: a byte in the middle of a
    # large file is not read, a byte in its first MiB is
    monkeypatch.setattr(modelinfo, "FULL_HASH_LIMIT", 1 << 20)
    big = m / "model.safetensors"
    save_file({"w": torch.zeros(3 << 18)}, str(big))  # 3 MiB of data
    info = inspect_model(m)
    sampled = model_content_hash(info)
    raw = bytearray(big.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    big.write_bytes(bytes(raw))
    assert model_content_hash(info) == sampled
    raw[(1 << 20) - 1] ^= 0xFF
    big.write_bytes(bytes(raw))
    assert model_content_hash(info) != sampled
