"""Datasets as users have them: ShareGPT, UltraChat, OpenAI chats with their tools, text content
lists; a JSONL or JSON file, a folder of them, a Hugging Face dataset on disk. Each is recognised
with nothing to pass, recorded, identified by its normalised content, and masked exactly as an
independent rendering of the template masks it (the real K2-Thinking template with tools, SmolLM2's
ChatML); bad rows are refused with the row, the field and the fix."""

from __future__ import annotations

import json

import numpy as np
import pytest

from datagen import settings
from datagen.data.dataset import file_fingerprint
from datagen.data.planning import prepare_dataset
from datagen.errors import DatasetError
from tests.builders import write_jsonl
from tests.test_dataset import VOCAB, fast_tok  # noqa: F401 - the same tokenizer, as a fixture

REAL = settings.real_kimi_dir()
needs_real_kimi = pytest.mark.skipif(not (REAL / "tiktoken.model").is_file(),
                                     reason=f"Moonshot's real Kimi tokenizer files are not at {REAL}")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = {"id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
TOOL_CHAT = [
    {"role": "system", "content": "You answer with tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "{\"temp\": 18}"},
    {"role": "assistant", "content": "It is 18 degrees.", "reasoning_content": "The tool said 18."},
]


def chat_row(**overrides) -> dict:
    """A plain chat in messages form."""
    return {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello!"}],
            **overrides}


def sharegpt_row(**overrides) -> dict:
    """The same chat as ``chat_row``, written as ShareGPT."""
    return {"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "hello!"}], **overrides}


def plan(path, tok, **kw):
    return prepare_dataset(path, load_tokenizer=lambda: tok, vocab_size=kw.pop("vocab_size", VOCAB),
                           max_seq_len=kw.pop("max_seq_len", 4096), workers=kw.pop("workers", 1), **kw)


# --- formats and their identity -------------------------------------------------------------------

def test_the_same_chat_in_every_format_is_the_same_row_with_the_same_tokens(fast_tok, tmp_path):
    rows = [
        chat_row(),
        sharegpt_row(),
        {"conversations": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello!"}]},
        {"data": ["hi there", "hello!"]},  # UltraChat
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi there"}]},  # a text content list
                      {"role": "assistant", "content": "hello!"}], "prompt_id": "ab12", "prompt": "hi there"},
    ]
    got = plan(write_jsonl(tmp_path / "rows.jsonl", rows), fast_tok)
    assert got.format == "jsonl/messages+sharegpt+ultrachat" and len(set(got.line_hashes)) == 1
    first = got.samples[0]
    for r in range(1, len(rows)):
        assert np.array_equal(got.samples[r].input_ids, first.input_ids)
        assert np.array_equal(got.samples[r].loss_mask, first.loss_mask)
    # the identity is content, not bytes: the same rows in another order of keys and spacing
    again = plan(write_jsonl(tmp_path / "again.jsonl", [json.dumps(chat_row(), indent=None, sort_keys=True)]), fast_tok)
    assert again.line_hashes[0] == got.line_hashes[0]


def test_a_changed_tool_schema_is_a_changed_row_and_changes_its_shards_key(fast_tok, tmp_path):
    other = json.loads(json.dumps(WEATHER))
    other["function"]["parameters"]["properties"]["units"] = {"type": "string"}
    a = plan(write_jsonl(tmp_path / "a.jsonl", [chat_row(), chat_row(tools=[WEATHER])]), fast_tok)
    b = plan(write_jsonl(tmp_path / "b.jsonl", [chat_row(), chat_row(tools=json.dumps([other]))]), fast_tok)
    c = plan(write_jsonl(tmp_path / "c.jsonl", [chat_row(), chat_row(tools=json.dumps([WEATHER]))]), fast_tok)
    assert a.line_hashes[0] == b.line_hashes[0] and a.line_hashes[1] != b.line_hashes[1]
    assert a.shard_rows_hash(0, 1) == b.shard_rows_hash(0, 1) and a.shard_rows_hash(1, 1) != b.shard_rows_hash(1, 1)
    assert c.line_hashes == a.line_hashes  # tools as a JSON string are the same tools


def test_sharegpt_tool_chats_with_a_system_field_become_the_openai_chat(fast_tok, tmp_path):
    share = {"system": "You answer with tools.", "tools": json.dumps([WEATHER]), "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "gpt", "value": "Let me check.", "tool_calls": [CALL]},
        {"from": "tool", "value": "{\"temp\": 18}", "tool_call_id": "functions.get_weather:0"},
        {"from": "gpt", "value": "It is 18 degrees.", "thinking": "The tool said 18."}]}
    # (as OpenAI exports write them: fields that do not apply are null)
    openai = {"messages": [{**m, "name": None} for m in TOOL_CHAT], "tools": [WEATHER]}
    got = plan(write_jsonl(tmp_path / "rows.jsonl", [share, openai]), fast_tok)
    assert got.line_hashes[0] == got.line_hashes[1] and got.format == "jsonl/messages+sharegpt"


def test_json_arrays_folders_and_hugging_face_datasets_are_read_where_they_are(fast_tok, tmp_path):
    import datasets

    rows = [sharegpt_row(id=str(i)) for i in range(3)] + [chat_row(tools=[WEATHER])]
    plain = plan(write_jsonl(tmp_path / "rows.jsonl", rows), fast_tok)
    (tmp_path / "rows.json").write_text(json.dumps(rows, indent=2))
    folder = tmp_path / "folder"
    write_jsonl(folder / "a" / "part-0.jsonl", rows[:2])
    (folder / "b.json").write_text(json.dumps(rows[2:]))
    hf = datasets.Dataset.from_list([{"conversations": r["conversations"], "id": r["id"]} for r in rows[:3]])
    hf.save_to_disk(str(tmp_path / "hf"))
    datasets.DatasetDict({"train": hf, "test": hf.select([0])}).save_to_disk(str(tmp_path / "hf-splits"))
    (tmp_path / "pq").mkdir()
    hf.to_parquet(str(tmp_path / "pq" / "train-00000.parquet"))
    cases = {tmp_path / "rows.json": ("json/messages+sharegpt", 4), folder: ("folder/messages+sharegpt", 4),
             tmp_path / "hf": ("hf-disk/sharegpt", 3), f"{tmp_path / 'hf-splits'}#split=train": ("hf-disk/sharegpt", 3),
             tmp_path / "pq": ("parquet/sharegpt", 3)}
    for path, (fmt, n) in cases.items():
        got = plan(path, fast_tok, workers=2)
        assert (got.format, got.rows) == (fmt, n), path
        assert got.line_hashes == plain.line_hashes[:n], path
        assert all(np.array_equal(got.samples[r].input_ids, plain.samples[r].input_ids) for r in range(n))
        assert got.fingerprint == file_fingerprint(path), path
    # a changed file of a folder changes the dataset's fingerprint
    before = file_fingerprint(folder)
    (folder / "b.json").write_text(json.dumps(rows[2:3]))
    assert file_fingerprint(folder) != before
    # a named column of any name
    named = datasets.Dataset.from_list([{"dialog": r["conversations"]} for r in rows[:3]])
    named.save_to_disk(str(tmp_path / "named"))
    got = plan(f"{tmp_path / 'named'}#column=dialog", fast_tok)
    assert got.line_hashes == plain.line_hashes[:3] and got.format == "hf-disk/sharegpt"


# --- refusals --------------------------------------------------------------------------------------

@pytest.mark.parametrize("row, error, field", [
    ({"conversations": [{"from": "bot", "value": "x"}]}, r"conversations\[0\] has unknown from 'bot'", "gpt"),
    (chat_row(messages=[{"role": "narrator", "content": "x"}]), "message 0 has unknown role 'narrator'", "roles are"),
    (chat_row(messages=[{"role": "user", "content": "x"}, {"role": "tool", "content": "18"}]),
     "message 1 is a tool turn without its call", "tool_calls"),
    (chat_row(messages=TOOL_CHAT[:3] + [{**TOOL_CHAT[3], "tool_call_id": "functions.other:1"}]),
     "tool_call_id 'functions.other:1' names no call", "tool_call_id"),
    (chat_row(tools="[{\"type\": \"function\", "), r"tools is a string but not valid JSON", "JSON list"),
    (chat_row(tools={"name": "f"}), "tools must be a list of tools, got dict", "e.g."),
    (chat_row(tools=[{"type": "function"}]), r"tools\[0\] is not a tool with a name", "name"),
    (chat_row(labels=[1]), r"unknown fields \['labels'\] in a messages row", "rename or remove"),
    ({"text": "hi"}, "row has none of the fields messages, conversations, data, input_ids", "conversations"),
])
def test_a_bad_row_is_refused_with_its_line_its_field_and_the_fix(fast_tok, tmp_path, row, error, field):
    path = write_jsonl(tmp_path / "rows.jsonl", [chat_row(), row])
    with pytest.raises(DatasetError, match=error) as e:
        plan(path, fast_tok, workers=2)
    assert e.value.line == 2 and e.value.path == str(path) and field in e.value.hint


def test_a_bad_row_of_a_folder_or_a_json_array_names_its_file_and_line(fast_tok, tmp_path):
    folder = tmp_path / "folder"
    write_jsonl(folder / "a.jsonl", [chat_row(), chat_row()])
    text = json.dumps([chat_row(), {"data": ["hi", 3]}], indent=1)
    (folder / "b.json").write_text(text)
    with pytest.raises(DatasetError, match=r"data\[1\] must be a string") as e:
        plan(folder, fast_tok)
    # the line its object starts on: the line before its first key's
    assert e.value.path == str(folder / "b.json") and e.value.line == text[: text.index('"data"')].count("\n")


def test_a_column_split_or_option_that_is_not_there_is_refused_with_the_fix(fast_tok, tmp_path):
    import datasets

    hf = datasets.Dataset.from_list([sharegpt_row()])
    datasets.DatasetDict({"train": hf, "test": hf}).save_to_disk(str(tmp_path / "hf"))
    for name, error, hint in [
        (str(tmp_path / "hf"), r"the dataset has the splits \['test', 'train'\]", "#split=test"),
        (f"{tmp_path / 'hf'}#split=dev", r"the dataset has the splits \['test', 'train'\], not 'dev'", "#split="),
        (f"{tmp_path / 'hf'}#split=train&column=chat", "the dataset has no column 'chat'", "#column=NAME"),
        (f"{tmp_path / 'hf'}#splt=train", r"unknown dataset options \['splt'\]", "split, column, format"),
        (f"{tmp_path / 'hf'}#split=train&format=alpaca", "unknown row format 'alpaca'", "sharegpt"),
    ]:
        with pytest.raises(DatasetError, match=error) as e:
            plan(name, fast_tok)
        assert hint in e.value.hint, name


def test_a_named_format_refuses_rows_of_another(fast_tok, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [sharegpt_row(), chat_row()])
    with pytest.raises(DatasetError, match="row is a messages row, and the dataset's options name sharegpt") as e:
        plan(f"{path}#format=sharegpt", fast_tok)
    assert e.value.line == 2


# --- masks against an independent rendering ---------------------------------------------------------

def independent_mask(tok, messages: list[dict], tools) -> tuple[list[int], list[int]]:
    """The whole chat's ids and the mask that marks, token by token, what each assistant turn adds
    after its generation prompt: renders by transformers' apply_chat_template, one prefix at a time,
    and each token's characters found by decoding the ids before it (no offsets, no code under test)."""
    def render(msgs, gen):
        return tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)

    whole = render(messages, False)
    spans = [(len(render(messages[:i], True)), len(render(messages[: i + 1], False)))
             for i, m in enumerate(messages) if m["role"] == "assistant"]
    ids = tok(whole, add_special_tokens=False)["input_ids"]
    mask = []
    for k in range(len(ids)):
        start = len(tok.decode(ids[:k]))
        mask.append(int(any(a <= start < b for a, b in spans)))
    return ids, mask


def masked_text(tok, ids, mask, value: int) -> str:
    return "".join(tok.decode([t]) for t, m in zip(ids, mask) if m == value)


@needs_real_kimi
def test_tool_chats_mask_exactly_under_the_real_k2_thinking_template(tmp_path):
    from tests.test_kimi_tokenizer import _load
    from datagen.models.kimi_tokenizer import write_slow_tokenizer

    tok = _load(write_slow_tokenizer(REAL, tmp_path / "kimi"))
    tok.chat_template = (REAL / "chat_template.kimi-k2-thinking.jinja").read_text()
    share = {"tools": json.dumps([WEATHER]), "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "gpt", "value": "Let me check.", "tool_calls": [CALL], "thinking": "I need the tool."},
        {"from": "tool", "value": "{\"temp\": 18}", "tool_call_id": "functions.get_weather:0"}]}
    final = {"messages": TOOL_CHAT, "tools": [WEATHER]}
    got = plan(write_jsonl(tmp_path / "rows.jsonl", [share, final]), tok, vocab_size=163840)
    for row, (messages, tools) in enumerate([
            ([{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL], "reasoning_content": "I need the tool."},
              {"role": "tool", "content": "{\"temp\": 18}", "tool_call_id": "functions.get_weather:0"}], [WEATHER]),
            (TOOL_CHAT, [WEATHER])]):
        ids, mask = independent_mask(tok, messages, tools)
        s = got.samples[row]
        assert s.input_ids.tolist() == ids and s.loss_mask.tolist() == mask, row
        unmasked, masked = masked_text(tok, ids, mask, 0), masked_text(tok, ids, mask, 1)
        assert "<|im_system|>tool_declare<|im_middle|>" in unmasked and "get_weather" in unmasked
        assert "## Return of functions.get_weather:0" in unmasked and "tool_declare" not in masked
        assert "<|tool_call_begin|>functions.get_weather:0" in masked and "Let me check." in masked
    assert "<think>I need the tool.</think>" in masked_text(tok, got.samples[0].input_ids.tolist(),
                                                            got.samples[0].loss_mask.tolist(), 1)
    assert "You answer with tools." in masked_text(tok, got.samples[1].input_ids.tolist(),
                                                  got.samples[1].loss_mask.tolist(), 0)


def test_sharegpt_and_ultrachat_mask_exactly_under_smollm2s_chatml(smollm2, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    turns = ["What is 2+2?", "4.", "And 3+3?", "6, of course."]
    rows = [{"data": turns},
            {"system": "Be brief.", "conversations": [{"from": "human" if j % 2 == 0 else "gpt", "value": t}
                                                      for j, t in enumerate(turns)]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}]},
                          {"role": "assistant", "content": "4."}]}]
    got = plan(write_jsonl(tmp_path / "rows.jsonl", rows), tok, vocab_size=len(tok))
    expected = [[{"role": "user" if j % 2 == 0 else "assistant", "content": t} for j, t in enumerate(turns)]]
    expected.append([{"role": "system", "content": "Be brief."}, *expected[0]])
    expected.append([{"role": "user", "content": "What is\n2+2?"}, {"role": "assistant", "content": "4."}])
    for row, messages in enumerate(expected):
        ids, mask = independent_mask(tok, messages, None)
        assert got.samples[row].input_ids.tolist() == ids and got.samples[row].loss_mask.tolist() == mask, row
        assert masked_text(tok, ids, mask, 1).count("<|im_end|>") == sum(m["role"] == "assistant" for m in messages)
