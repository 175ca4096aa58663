"""Chat rows with any tokenizer: loss masks exact with a slow tiktoken tokenizer shaped like
Kimi-K2.5's (remote code, no character offsets) and with a fast one."""

from __future__ import annotations

import json

import numpy as np
import pytest

from datagen.data.dataset import _tokenize_by_offsets, prepare_dataset, target_spans, tokenize_chat
from datagen.errors import DatasetError
from datagen.models.modelinfo import has_tokenizer_files
from datagen.models.tiny import make_chat_dataset, make_tokenizer
from datagen.models.tiny_tiktoken import SPECIAL_OFFSETS, write_kimi_tokenizer

VOCAB = 1024


@pytest.fixture(scope="module")
def kimi_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("kimi-tok")
    write_kimi_tokenizer(d, vocab_size=VOCAB)
    return AutoTokenizer.from_pretrained(d, trust_remote_code=True)


@pytest.fixture(scope="module")
def fast_tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("fast-tok"))


def runs(tok, ids, mask) -> list[str]:
    """The text of each run of masked tokens."""
    out, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    if cur:
        out.append(tok.decode(cur))
    return out


def call(i: int, name: str, args: dict) -> dict:
    return {"id": f"functions.{name}:{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def test_the_kimi_tokenizer_is_a_slow_remote_code_tokenizer_with_kimis_special_token_layout(kimi_tok, tmp_path):
    assert not kimi_tok.is_fast and type(kimi_tok).__name__ == "TikTokenTokenizer"
    base = VOCAB - 256
    for off, name in SPECIAL_OFFSETS.items():
        assert kimi_tok.convert_tokens_to_ids(name) == base + off, name
    assert (kimi_tok.bos_token_id, kimi_tok.eos_token_id, kimi_tok.pad_token_id) == (base, base + 1, VOCAB - 1)
    text = "<|im_user|>user<|im_middle|>what is a residual stream 中文?<|im_end|>"
    ids = kimi_tok(text, add_special_tokens=False)["input_ids"]
    assert max(ids) < VOCAB and kimi_tok.decode(ids) == text
    assert len(ids) < len(text.encode()) - 10, "merges were learned"
    assert "offset_mapping" not in kimi_tok(text, return_offsets_mapping=True), "no character offsets"
    write_kimi_tokenizer(tmp_path, vocab_size=VOCAB)
    assert has_tokenizer_files(tmp_path) and not has_tokenizer_files(tmp_path / "nothing")


def test_multi_turn_masks_cover_each_assistant_turn_and_its_end_of_turn_token_only(kimi_tok):
    msgs = [
        {"role": "system", "content": "you are terse"},
        {"role": "user", "content": "what is a residual stream"},
        {"role": "assistant", "content": "the model reads tokens"},
        {"role": "user", "content": "why are shards large"},
        {"role": "assistant", "content": "storage bandwidth matters more"},
    ]
    ids, mask = tokenize_chat(kimi_tok, msgs)
    whole = kimi_tok(kimi_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False),
                     add_special_tokens=False)["input_ids"]
    assert ids.tolist() == whole
    # The generation prompt ends with <think>: the target is the rest of the turn, <|im_end|> included.
    assert runs(kimi_tok, ids, mask) == ["</think>the model reads tokens<|im_end|>",
                                         "</think>storage bandwidth matters more<|im_end|>"]


def test_tool_calls_tool_results_and_thinking_blocks_are_masked_as_the_template_renders_them(kimi_tok):
    msgs = [
        {"role": "user", "content": "how many experts route each token"},
        {"role": "assistant", "content": "", "reasoning_content": "ask the tool",
         "tool_calls": [call(0, "count", {"layer": 3})]},
        {"role": "tool", "tool_call_id": "functions.count:0", "content": "8 experts"},
        {"role": "assistant", "content": "let me check twice", "reasoning_content": "again",
         "tool_calls": [call(1, "count", {"layer": 4}), call(2, "count", {"layer": 5})]},
    ]
    ids, mask = tokenize_chat(kimi_tok, msgs)
    got = runs(kimi_tok, ids, mask)
    assert got == [
        'ask the tool</think><|tool_calls_section_begin|><|tool_call_begin|>functions.count:0'
        '<|tool_call_argument_begin|>{"layer": 3}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        'again</think>let me check twice<|tool_calls_section_begin|><|tool_call_begin|>functions.count:1'
        '<|tool_call_argument_begin|>{"layer": 4}<|tool_call_end|><|tool_call_begin|>functions.count:2'
        '<|tool_call_argument_begin|>{"layer": 5}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
    ]
    text = kimi_tok.decode(ids)
    assert "<|im_system|>tool<|im_middle|>## Return of functions.count:0\n8 experts<|im_end|>" in text
    assert "8 experts" not in "".join(got), "a tool result is input, not a target"


def test_a_template_that_rewrites_earlier_turns_is_refused_with_what_to_do(kimi_tok):
    # Kimi's template drops the reasoning of turns before the last plain assistant answer, so
    # the render up to the tool call is not a prefix of the whole chat's.
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "reasoning_content": "think first", "tool_calls": [call(0, "f", {})]},
        {"role": "tool", "tool_call_id": "functions.f:0", "content": "r"},
        {"role": "assistant", "content": "done"},
    ]
    with pytest.raises(DatasetError, match="not a prefix") as e:
        tokenize_chat(kimi_tok, msgs, path="chat.jsonl", line=7)
    assert e.value.hint and "pre-tokenize" in e.value.hint and "chat.jsonl:7" in str(e.value)


def test_a_slow_tokenizer_that_merges_across_a_turn_boundary_is_refused(kimi_tok):
    tok = kimi_tok
    template = tok.chat_template
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}{% endif %}")
    try:
        with pytest.raises(DatasetError, match="merges tokens across"):
            tokenize_chat(tok, [{"role": "user", "content": "t"}, {"role": "assistant", "content": "he"}])
    finally:
        tok.chat_template = template


def test_piecewise_masks_equal_the_offset_masks_of_a_fast_tokenizer(fast_tok, tmp_path):
    path = make_chat_dataset(tmp_path / "chat.jsonl", rows=24, seed=3, max_turns=3)
    for line in path.read_text().splitlines():
        msgs = json.loads(line)["messages"]
        ids, mask = tokenize_chat(fast_tok, msgs)
        full, spans = target_spans(fast_tok, msgs)
        ref_ids, ref_mask = _tokenize_by_offsets(fast_tok, full, spans)
        assert np.array_equal(ids, ref_ids) and np.array_equal(mask, ref_mask)


def test_a_dataset_of_chat_rows_prepares_with_the_kimi_tokenizer_and_fingerprints_it(kimi_tok, fast_tok, tmp_path):
    path = make_chat_dataset(tmp_path / "chat.jsonl", rows=6, seed=1)
    kimi = prepare_dataset(path, load_tokenizer=lambda: kimi_tok, vocab_size=VOCAB, max_seq_len=4096)
    fast = prepare_dataset(path, load_tokenizer=lambda: fast_tok, vocab_size=VOCAB, max_seq_len=4096)
    assert len(kimi.samples) == 6 and all(s.loss_mask.any() for s in kimi.samples.values())
    assert kimi.tokenizer_hash and fast.tokenizer_hash and kimi.tokenizer_hash != fast.tokenizer_hash
    again = prepare_dataset(path, load_tokenizer=lambda: kimi_tok, vocab_size=VOCAB, max_seq_len=4096)
    assert again.tokenizer_hash == kimi.tokenizer_hash


@pytest.mark.parametrize("message, error", [
    ({"role": "user", "content": "hi", "tool_calls": []}, "unknown fields ['tool_calls']"),
    ({"role": "assistant", "content": "hi", "tool_calls": [{"id": 1}]}, "tool_calls must be a list"),
    ({"role": "assistant", "content": "hi", "reasoning_content": 3}, "reasoning_content must be a string"),
])
def test_malformed_optional_message_fields_are_refused(tmp_path, message, error):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [message]}) + "\n")
    with pytest.raises(DatasetError, match=error.replace("[", r"\[").replace("]", r"\]")):
        prepare_dataset(path, load_tokenizer=lambda: None, vocab_size=VOCAB, max_seq_len=64)
