"""Planning on every core gives what planning in one process gave before, byte for byte: the same
samples, skipped and truncated rows, hashes (so the same fingerprints and shard keys), and on a bad
row the same error. The oracle is the former code path, kept in tests/support/planning_reference.py."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from datagen.data.chat_tokens import SplitTokens
from datagen.data.planning import prepare_dataset
from datagen.errors import DatasetError, ModelError
from datagen.testmodels.tiny_tiktoken import write_kimi_tokenizer
from tests.builders import write_jsonl
from tests.test_dataset import VOCAB, fast_tok, kimi_tok  # noqa: F401 - the same tokenizers, as fixtures
from tests.support.planning_reference import reference_prepare_dataset

WORDS = "the model reads tokens and writes states 中文 分词 x=1+2 don't HTTPServer 🎉 \n\n  spaces".split(" ")


def varied_rows(n: int, *, seed: int = 0) -> list[dict]:
    """Chats of every shape the planner meets: system prompts or none, several turns, tool calls
    and results, reasoning, empty chats, chats without a target, long chats (truncated), and
    pre-tokenized rows with and without masks."""
    rng = random.Random(seed)

    def text(lo=1, hi=12):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    rows = []
    for i in range(n):
        kind = i % 10
        if kind == 0:
            rows.append({"messages": []})
        elif kind == 1:
            rows.append({"messages": [{"role": "user", "content": text()}]})
        elif kind == 2:
            ids = [rng.randrange(3, 400) for _ in range(rng.randint(1, 40))]
            rows.append({"input_ids": ids, **({"loss_mask": [rng.randint(0, 1) for _ in ids]} if i % 3 else {})})
        elif kind == 3:
            rows.append({"messages": [{"role": "user", "content": text(30, 50)},
                                      {"role": "assistant", "content": text(30, 50)}]})
        elif kind == 4:
            call = {"id": f"functions.f:{i}", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}
            rows.append({"messages": [{"role": "user", "content": text()},
                                      {"role": "assistant", "content": text(), "reasoning_content": text(),
                                       "tool_calls": [call]},
                                      {"role": "tool", "tool_call_id": call["id"], "content": text()}]})
        else:
            msgs = [{"role": "system", "content": text()}] if kind % 2 else []
            for _ in range(rng.randint(1, 3)):
                msgs += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
            rows.append({"messages": msgs})
    return rows


def assert_same(got, want) -> None:
    assert (got.path, got.rows, got.fingerprint) == (want.path, want.rows, want.fingerprint)
    assert got.line_hashes == want.line_hashes and got.kinds == want.kinds
    assert (got.chat_template_hash, got.tokenizer_hash) == (want.chat_template_hash, want.tokenizer_hash)
    assert got.skipped == want.skipped and got.truncated == want.truncated
    assert sorted(got.samples) == sorted(want.samples)
    for r, s in want.samples.items():
        g = got.samples[r]
        assert g.row == r and g.input_ids.dtype == np.int32 and g.loss_mask.dtype == np.uint8
        assert np.array_equal(g.input_ids, s.input_ids) and np.array_equal(g.loss_mask, s.loss_mask), r
    assert got.tokens == want.tokens
    assert got.shard_rows_hash(0, got.rows) == want.shard_rows_hash(0, want.rows)


@pytest.mark.parametrize("which", ["kimi_tok", "fast_tok"])
def test_planning_in_workers_gives_the_former_single_process_plan_byte_for_byte(which, request, tmp_path):
    tok = request.getfixturevalue(which)
    path = write_jsonl(tmp_path / "rows.jsonl", varied_rows(300))
    kw = dict(load_tokenizer=lambda: tok, vocab_size=VOCAB, max_seq_len=100)
    want = reference_prepare_dataset(path, **kw)
    assert want.truncated and {s.reason for s in want.skipped} == {"empty", "no_target"}
    for workers in (1, 2) if which == "fast_tok" else (2,):  # (the slow tokenizer: seconds per pass)
        assert_same(prepare_dataset(path, workers=workers, **kw), want)


def test_cuts_next_to_kimis_turn_tokens_need_no_second_tokenization_and_others_do(kimi_tok, fast_tok):
    split = SplitTokens(kimi_tok)
    text = "<|im_assistant|>assistant<|im_middle|>hi there<|im_end|>"
    assert split.at(text, text.index("hi")) and split.at(text, len(text)) and not split.at(text, text.index("there"))
    chatml = "<|im_start|>assistant\nhi<|im_end|>\n"
    assert not SplitTokens(fast_tok).at(chatml, chatml.index("hi")), "after a newline: compared with the whole"


def _rows_with(bad: dict[int, str], n: int = 260) -> list:
    rows = varied_rows(n, seed=5)
    for i, raw in bad.items():
        rows[i] = raw
    return rows


@pytest.mark.parametrize("bad", [
    {250: '{"messages": [{"role": "robot", "content": "x"}]}', 180: json.dumps({"input_ids": [1, 2, 5000]})},
    {70: '{"messages": [{"role": "user", "content": 3}]}', 240: "{not json"},  # the JSON error is found first
    {200: json.dumps({"text": "neither"})},
])
def test_a_bad_row_in_any_batch_raises_the_former_error(bad, kimi_tok, tmp_path):
    assert_same_error(write_jsonl(tmp_path / "bad.jsonl", _rows_with(bad)), kimi_tok)


def assert_same_error(path, tok) -> None:
    kw = dict(load_tokenizer=lambda: tok, vocab_size=VOCAB, max_seq_len=100)
    with pytest.raises(DatasetError) as want:
        reference_prepare_dataset(path, **kw)
    with pytest.raises(DatasetError) as got:
        prepare_dataset(path, workers=2, **kw)
    assert str(got.value) == str(want.value) and got.value.line == want.value.line


def test_a_tokenizer_that_does_not_load_fails_at_the_first_chat_row_as_before(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"input_ids": [1, 2]}] * 5 + varied_rows(200))

    def no_tokenizer():
        raise ModelError("the dataset has chat rows but model m has no tokenizer", hint="add one")

    with pytest.raises(ModelError, match="has no tokenizer"):
        prepare_dataset(path, load_tokenizer=no_tokenizer, vocab_size=VOCAB, max_seq_len=64, workers=2)
    tokens_only = write_jsonl(tmp_path / "tokens.jsonl", [{"input_ids": [1, 2]}] * 300)
    data = prepare_dataset(tokens_only, load_tokenizer=no_tokenizer, vocab_size=VOCAB, max_seq_len=64, workers=2)
    assert len(data.samples) == 300 and data.tokenizer_hash is None


def test_a_tokenizer_named_in_the_spec_tokenizes_the_chats_and_is_in_the_fingerprint(tiny_llama, tmp_path):
    from datagen.specs.extraction import parse_spec
    from datagen.extraction.plan import plan
    from datagen.testmodels.tiny import make_chat_dataset

    data = make_chat_dataset(tmp_path / "chat.jsonl", rows=6, seed=1)
    (tmp_path / "tok").mkdir()
    other = write_kimi_tokenizer(tmp_path / "tok", vocab_size=512)
    base = {"model": str(tiny_llama), "dataset": str(data), "out": str(tmp_path / "out"),
            "engine": {"name": "hf", "trust_remote_code": True}}
    own, named = plan(parse_spec(base)), plan(parse_spec({**base, "tokenizer": str(other)}))
    assert named.data.tokenizer_hash != own.data.tokenizer_hash and named.fingerprint != own.fingerprint
    from transformers import AutoTokenizer

    kimi = AutoTokenizer.from_pretrained(other, trust_remote_code=True)
    assert kimi.convert_ids_to_tokens(int(named.data.samples[0].input_ids[0])) == "<|im_system|>"


@pytest.fixture
def small_ranges(monkeypatch):
    """Ranges of about 1 KiB: a few hundred rows make dozens of ranges, so that every rule about
    where a range starts, ends and what it raises is crossed many times."""
    from datagen.data import planning

    monkeypatch.setattr(planning, "MIN_RANGE", 1 << 10)


def test_ranges_cut_anywhere_give_the_former_plan_crlf_a_last_line_without_its_end_and_an_escaped_key(
        fast_tok, small_ranges, tmp_path):
    lines = [json.dumps(r) for r in varied_rows(200, seed=3)]
    lines[7] = lines[7].replace('"messages"', '"\\u006dessages"')  # a chat key the byte search cannot see
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"".join(line.encode() + (b"\r\n" if i % 3 else b"\n") for i, line in enumerate(lines))[:-1])
    kw = dict(load_tokenizer=lambda: fast_tok, vocab_size=VOCAB, max_seq_len=100)
    want = reference_prepare_dataset(path, **kw)
    assert want.rows == 200 and want.tokenizer_hash is not None
    for workers in (1, 2):
        assert_same(prepare_dataset(path, workers=workers, **kw), want)
    only_escaped = tmp_path / "escaped.jsonl"
    only_escaped.write_text(lines[7] + "\n" + json.dumps({"input_ids": [1, 2]}) + "\n")
    assert_same(prepare_dataset(only_escaped, workers=2, **kw), reference_prepare_dataset(only_escaped, **kw))


@pytest.mark.parametrize("bad", [
    {3: "", 150: "{not json"},  # a blank line
    {120: '{"messages": [{"role": "user", "content": 3}]}', 199: "[1, 2]"},  # the last line, no object
    {60: b'{"input_ids": [1, 2, \xff]}'},  # not UTF-8
    {90: '{"messages": [{"role": "robot", "content": "x"}]}', 91: json.dumps({"input_ids": [1, 2, 5000]})},
])
def test_a_bad_row_in_any_of_many_ranges_raises_the_former_error(bad, fast_tok, small_ranges, tmp_path):
    lines = [json.dumps(r).encode() for r in varied_rows(200, seed=4)]
    for i, raw in bad.items():
        lines[i] = raw if isinstance(raw, bytes) else raw.encode()
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines))  # (no line end after the last line)
    assert_same_error(path, fast_tok)


def test_a_file_edited_between_its_hash_and_its_workers_read_is_refused(fast_tok, small_ranges, tmp_path,
                                                                        monkeypatch):
    """The fingerprint is of the bytes the workers parse: a range whose bytes are not those hashed
    stops the plan (an append after the hash is not read, as a whole-file read did not read it)."""
    from datagen.data import planning

    path = write_jsonl(tmp_path / "rows.jsonl", varied_rows(200, seed=6))
    original = path.read_bytes()
    scan = planning._scan

    def scan_then_edit(p, target):
        out = scan(p, target)
        edited = bytearray(original)
        at = edited.index(b"the", len(edited) // 2)
        edited[at : at + 3] = b"THE"  # the same length: only the bytes differ
        path.write_bytes(bytes(edited))
        return out

    monkeypatch.setattr(planning, "_scan", scan_then_edit)
    kw = dict(load_tokenizer=lambda: fast_tok, vocab_size=VOCAB, max_seq_len=100, workers=2)
    with pytest.raises(DatasetError, match="changed while it was read") as e:
        prepare_dataset(path, **kw)
    assert "again once nothing writes to it" in e.value.hint
    path.write_bytes(original)

    def scan_then_append(p, target):
        out = scan(p, target)
        path.write_bytes(original + json.dumps({"input_ids": [1, 2]}).encode() + b"\n")
        return out

    monkeypatch.setattr(planning, "_scan", scan_then_append)
    got = prepare_dataset(path, **kw)
    path.write_bytes(original)
    assert_same(got, reference_prepare_dataset(path, **{k: v for k, v in kw.items() if k != "workers"}))


def test_a_rows_identity_is_its_one_function_called_in_the_workers(fast_tok, tmp_path, monkeypatch):
    """The row's identity (the shard keys, the reuse of a stored plan) comes from ``row_identity``
    alone, called with the row's normal form in the worker that plans it."""
    import hashlib

    from datagen.data import planning_rows
    from datagen.data.row_formats import normalise

    rows = varied_rows(50, seed=7)
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    seen = []

    def identity(normal, *_):
        seen.append(normal)
        return hashlib.sha256(b"salt" + json.dumps(normal, sort_keys=True).encode()).digest()

    monkeypatch.setattr(planning_rows, "row_identity", identity)
    got = prepare_dataset(path, load_tokenizer=lambda: fast_tok, vocab_size=VOCAB, max_seq_len=100, workers=1)
    normals = [normalise(r, path="", line=0)[1] for r in rows]
    assert seen == normals
    assert got.line_hashes == [hashlib.sha256(b"salt" + json.dumps(n, sort_keys=True).encode()).digest()
                               for n in normals]


def test_the_one_read_cuts_at_line_ends_counts_rows_and_sees_the_chat_key_whatever_the_block_size(
        tmp_path, monkeypatch):
    import hashlib

    from datagen.data import planning

    rng = random.Random(0)
    path = tmp_path / "rows.jsonl"
    for trial in range(200):
        lines = [b"x" * rng.randint(0, 40) for _ in range(rng.randint(1, 30))]  # blank ones too
        lines[-1] += b"y"  # (an empty last line would be no line)
        key = trial % 2 == 0
        lines[rng.randrange(len(lines))] += b'"messages"' if key else b'"messagez"'
        raw = b"\n".join(lines) + (b"\n" if rng.random() < 0.5 else b"")
        path.write_bytes(raw)
        monkeypatch.setattr(planning, "READ_BLOCK", rng.randint(1, 50))
        scan = planning._scan(path, rng.randint(1, 60))
        assert scan.fingerprint == hashlib.sha256(raw).hexdigest() and scan.chats == key
        assert scan.rows == len(lines) and scan.ranges[0].start == 0 and scan.ranges[-1].stop == len(raw)
        row = 0
        for r in scan.ranges:
            part = raw[r.start : r.stop]
            assert r.first == row and hashlib.sha256(part).digest() == r.sha256
            assert part.endswith(b"\n") or r.stop == len(raw)
            row += part.count(b"\n") + (not part.endswith(b"\n"))
        assert row == len(lines)


def test_chats_that_open_with_the_assistant_plan_in_workers_as_in_one_process(fast_tok, small_ranges, tmp_path):
    rows = varied_rows(300, seed=9)
    rows[17] = {"messages": [{"role": "assistant", "content": "hello"}]}
    rows[211] = {"messages": [{"role": "assistant", "content": ""}, {"role": "user", "content": "q"}]}
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    kw = dict(load_tokenizer=lambda: fast_tok, vocab_size=VOCAB, max_seq_len=100)
    got = prepare_dataset(path, workers=2, **kw)
    assert_same(got, prepare_dataset(path, workers=1, **kw))
    assert got.samples[17].loss_mask.sum() > 0 and got.samples[211].loss_mask.sum() > 0


def test_a_template_that_raises_in_a_worker_is_the_rows_error_not_a_traceback(tmp_path, small_ranges):
    from datagen.testmodels.tiny import make_tokenizer

    tok = make_tokenizer(tmp_path / "tok")
    tok.chat_template = "{% if messages[0]['role'] == 'user' %}U{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    rows = [{"input_ids": [1, 2]}] * 150 + [{"messages": [{"role": "assistant", "content": "hi"}]}] + varied_rows(100)
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(DatasetError, match="chat template cannot render") as e:
        prepare_dataset(path, workers=2, load_tokenizer=lambda: tok, vocab_size=VOCAB, max_seq_len=100)
    assert e.value.line == 151
