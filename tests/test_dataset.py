"""Chat rows with any tokenizer: loss masks exact with a slow tiktoken tokenizer shaped like
Kimi-K2.5's (remote code, no character offsets) and with a fast one."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from datagen.data.chat_template import target_spans
from datagen.data.chat_tokens import _tokenize_by_offsets, tokenize_chat
from datagen.data.dataset import file_fingerprint, read_rows, tokenizer_fingerprint
from datagen.data.planning import prepare_dataset
from datagen.errors import DatasetError, ModelError
from datagen.models.modelinfo import has_tokenizer_files
from datagen.testmodels.tiny import make_chat_dataset, make_tokenizer
from datagen.testmodels.tiny_tiktoken import SPECIAL_OFFSETS, write_kimi_tokenizer

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


# --- reading rows and pre-tokenized rows, without a tokenizer -------------------------------------------

def _no_tokenizer():
    raise AssertionError("a dataset without chat rows must not load the tokenizer")


def prepare(path, *, vocab_size=VOCAB, max_seq_len=64, load_tokenizer=_no_tokenizer):
    return prepare_dataset(path, load_tokenizer=load_tokenizer, vocab_size=vocab_size, max_seq_len=max_seq_len)


@pytest.mark.parametrize("content, line, error", [
    (b'{"input_ids": [1]}\n\n{"input_ids": [2]}\n', 2, "blank line"),
    (b'{"input_ids": [1]}\n{"input_ids": [1, 2\n', 2, "malformed JSON"),
    (b'{"input_ids": [1]}\n\xff\xfe{}\n', 2, r"not valid UTF-8 \(byte 0\)"),
    (b'[1, 2, 3]\n', 1, "a row must be a JSON object, got list"),
    (b'{"text": "hello"}\n', 1, r"row has none of the fields messages, conversations, data, input_ids \(fields: \['text'\]\)"),
    (b'{"input_ids": [1, 2], "labels": [1, 2]}\n', 1, r"unknown fields \['labels'\] in a pre-tokenized row"),
    (b'{"input_ids": [1, 2.0]}\n', 1, "input_ids must be a list of integers"),
    (b'{"input_ids": [1, true]}\n', 1, "input_ids must be a list of integers"),
    (b'{"input_ids": "1 2"}\n', 1, "input_ids must be a list of integers"),
    (b'{"input_ids": [1, 1024]}\n', 1, r"token id 1024 is outside the model's vocabulary \[0, 1024\)"),
    (b'{"input_ids": [-1]}\n', 1, "token id -1 is outside"),
    (b'{"input_ids": [1, 2], "loss_mask": [1, 2]}\n', 1, "loss_mask must be a list of 0/1 integers"),
    (b'{"input_ids": [1, 2], "loss_mask": [1]}\n', 1, "loss_mask has 1 entries but input_ids has 2"),
    (b'{"messages": "hi"}\n', 1, "messages must be a list"),
    (b'{"messages": [{"role": "user"}]}\n', 1, "message 0 must be an object with exactly 'role' and 'content'"),
    (b'{"messages": [{"role": "narrator", "content": "x"}]}\n', 1, "message 0 has unknown role 'narrator'"),
    (b'{"messages": [{"role": "user", "content": ["x"]}]}\n', 1, "message 0 part 0 must be an object with type text or image_url"),
    (b'{"messages": [{"role": "user", "content": 3}]}\n', 1, "message 0 content must be a string, got int"),
    (b'{"messages": [], "labels": 3}\n', 1, r"unknown fields \['labels'\] in a messages row"),
])
def test_a_bad_row_is_refused_with_its_line_and_a_hint(tmp_path, content, line, error):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    with pytest.raises(DatasetError, match=error) as e:
        prepare(path)
    assert e.value.line == line and e.value.path == str(path) and e.value.hint
    assert str(e.value).startswith(f"{path}:{line}: ")


def test_a_missing_empty_or_directory_dataset_is_refused(tmp_path):
    with pytest.raises(DatasetError, match="dataset does not exist"):
        prepare(tmp_path / "absent.jsonl")
    with pytest.raises(DatasetError, match="the folder holds no .jsonl, .json, .parquet or .arrow file"):
        prepare(tmp_path)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(DatasetError, match="dataset is empty"):
        prepare(tmp_path / "empty.jsonl")


def test_pre_tokenized_rows_are_kept_skipped_or_truncated_and_fingerprinted(tmp_path):
    rows = [
        {"input_ids": [5, 6, 7]},  # mask defaults to all 1
        {"input_ids": [5, 6], "loss_mask": [0, 0]},  # no target
        {"input_ids": []},  # empty
        {"input_ids": list(range(10, 20)), "loss_mask": [0] * 8 + [1, 1]},  # truncated to 4: target gone
        {"input_ids": list(range(10, 20)), "loss_mask": [0, 1] + [0] * 8},  # truncated to 4, keeps a target
        {"messages": []},  # an empty chat: skipped, and no tokenizer is loaded for it
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\r\n" for r in rows))  # CRLF line ends
    ds = prepare(path, max_seq_len=4)
    assert sorted(ds.samples) == [0, 4] and ds.rows == 6 and ds.kinds == {"tokens", "chat"}
    s0, s4 = ds.samples[0], ds.samples[4]
    assert s0.input_ids.dtype == np.int32 and s0.loss_mask.dtype == np.uint8
    assert s0.input_ids.tolist() == [5, 6, 7] and s0.loss_mask.tolist() == [1, 1, 1]
    assert s4.input_ids.tolist() == [10, 11, 12, 13] and s4.loss_mask.tolist() == [0, 1, 0, 0]
    assert [(s.row, s.reason) for s in ds.skipped] == [(1, "no_target"), (2, "empty"), (3, "no_target"), (5, "empty")]
    assert [(t.row, t.original_tokens, t.kept_tokens) for t in ds.truncated] == [(3, 10, 4), (4, 10, 4)]
    assert ds.tokens == 7 and ds.chat_template_hash is None and ds.tokenizer_hash is None
    # the fingerprint is of the file's bytes; a row's identity is the sha256 of its canonical JSON
    assert ds.fingerprint == hashlib.sha256(path.read_bytes()).hexdigest() == file_fingerprint(path)
    canonical = [json.dumps(r, sort_keys=True, separators=(",", ":")).encode() for r in rows]
    assert ds.line_hashes == [hashlib.sha256(c).digest() for c in canonical]
    h = hashlib.sha256()
    for c in canonical[2:5]:
        h.update(hashlib.sha256(c).digest())
    assert ds.shard_rows_hash(2, 3) == h.hexdigest() != ds.shard_rows_hash(1, 3)


def test_a_dataset_whose_every_row_is_skipped_is_refused(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2], "loss_mask": [0, 0]}) + "\n" + json.dumps({"input_ids": []}) + "\n")
    with pytest.raises(DatasetError, match=r"no row has a target token: all 2 rows would be skipped \(empty, no_target\)"):
        prepare(path)


def test_the_tokenizer_is_loaded_once_for_chat_rows_and_its_ids_must_fit_the_model(fast_tok, tmp_path):
    path = make_chat_dataset(tmp_path / "chat.jsonl", rows=4, seed=2)
    loads = []

    def load():
        loads.append(1)
        return fast_tok

    ds = prepare(path, vocab_size=VOCAB, max_seq_len=4096, load_tokenizer=load)
    assert loads == [1] and ds.kinds == {"chat"} and len(ds.samples) == 4
    assert ds.chat_template_hash == hashlib.sha256(fast_tok.chat_template.encode()).hexdigest()
    assert ds.tokenizer_hash == tokenizer_fingerprint(fast_tok)
    largest = max(int(s.input_ids.max()) for s in ds.samples.values())
    with pytest.raises(ModelError, match=f"the tokenizer produced id {largest} but the model's vocabulary has {largest} entries"):
        prepare(path, vocab_size=largest, max_seq_len=4096, load_tokenizer=lambda: fast_tok)


def test_the_fingerprint_is_of_the_bytes_parsed(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2]}) + "\n")
    digest = hashlib.sha256()
    rows = read_rows(path, digest=digest)
    assert [(r, raw) for r, raw, _ in rows] == [(0, b'{"input_ids": [1, 2]}')]
    assert digest.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("content", ["hello", ""])
def test_a_chat_that_opens_with_the_assistant_is_a_target_after_the_render_of_nothing(fast_tok, content):
    ids, mask = tokenize_chat(fast_tok, [{"role": "assistant", "content": content}], path="chat.jsonl", line=1)
    # the prompt is the template's render of an empty conversation: its generation prompt
    assert fast_tok.decode(ids.tolist()) == f"<|im_start|>assistant\n{content}<|im_end|>\n"
    assert runs(fast_tok, ids, mask) == [f"{content}<|im_end|>\n"]


def test_an_opening_assistant_turn_and_a_later_one_are_both_masked_with_the_kimi_tokenizer(kimi_tok):
    msgs = [{"role": "assistant", "content": "welcome"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"}]
    ids, mask = tokenize_chat(kimi_tok, msgs, path="chat.jsonl", line=1)
    # the opening turn's target is what the same turn's target is after a user's question
    after_user = runs(kimi_tok, *tokenize_chat(kimi_tok, [{"role": "user", "content": "q"}, msgs[0]]))
    assert runs(kimi_tok, ids, mask) == [*after_user, after_user[0].replace("welcome", "a")]
    assert "welcome" in after_user[0]


@pytest.mark.parametrize("template, reason", [
    ("{{ raise_exception('Conversation roles must alternate user/assistant') }}", "roles must alternate"),
    # a template that reads messages[0] cannot render the empty prompt of an opening assistant turn
    ("{% if messages[0]['role'] == 'system' %}S{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
     "an empty conversation"),
])
def test_a_template_that_cannot_render_a_chat_refuses_its_row_with_its_reason(tmp_path, template, reason):
    tok = make_tokenizer(tmp_path / "tok")
    tok.chat_template = template
    with pytest.raises(DatasetError, match="chat template cannot render") as e:
        tokenize_chat(tok, [{"role": "assistant", "content": "hello"}], path="chat.jsonl", line=4)
    assert reason in str(e.value) and "chat.jsonl:4" in str(e.value) and "pre-tokenize" in e.value.hint
    assert e.value.__cause__ is not None


def test_the_models_media_placeholder_follows_the_tokenizers_media_pad_when_the_ranks_come_out_fewer(tmp_path):
    from transformers import AutoTokenizer

    (tmp_path / "config.json").write_text(json.dumps(
        {"media_placeholder_token_id": 163605, "text_config": {"media_placeholder_token_id": 163605}, "x": 1}))
    write_kimi_tokenizer(tmp_path, vocab_size=163840, corpus=["a small corpus, a few merges"] * 4)
    pad = AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=True).convert_tokens_to_ids("<|media_pad|>")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert pad < 163605, "the ranks came out fewer than asked"
    assert cfg["media_placeholder_token_id"] == cfg["text_config"]["media_placeholder_token_id"] == pad and cfg["x"] == 1
