"""`datagen regenerate` reads the dataset formats extraction reads, renders every prompt with the
row's tools (the real K2-Thinking template writes them), and keeps the tools in the chats it writes."""

from __future__ import annotations

import json

import pytest

from datagen import settings
from datagen.errors import DatasetError
from datagen.regeneration.chats import RowState
from datagen.regeneration.output import chat_line
from datagen.regeneration.rounds import ChunkRunner, _record
from datagen.regeneration.run import _read_chats
from datagen.regeneration.settings import RegenerationSettings, ToolRows
from tests.builders import write_jsonl
from tests.test_dataset_formats import CALL, WEATHER

REAL = settings.real_kimi_dir()

SHARE = {"tools": json.dumps([WEATHER]), "conversations": [
    {"from": "human", "value": "Weather in Paris?"},
    {"from": "gpt", "value": "Let me check.", "tool_calls": [CALL]},
    {"from": "tool", "value": "{\"temp\": 18}", "tool_call_id": CALL["id"]},
    {"from": "gpt", "value": "It is 18 degrees."}]}


def test_regenerate_reads_sharegpt_and_hugging_face_rows_with_their_tools(tmp_path):
    import datasets

    chats, sha = _read_chats(str(write_jsonl(tmp_path / "rows.jsonl", [SHARE, {"data": ["hi", "hello"]}])))
    (row, key, messages, tools), (_, _, plain, no_tools) = chats
    assert tools == [WEATHER] and no_tools is None and [m["role"] for m in messages] == ["user", "assistant", "tool",
                                                                                       "assistant"]
    assert plain == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    datasets.Dataset.from_list([SHARE]).save_to_disk(str(tmp_path / "hf"))
    (hf,), hf_sha = _read_chats(str(tmp_path / "hf"))
    assert hf[1:] == (key, messages, tools) and hf_sha != sha  # the same row, whatever holds it
    with pytest.raises(DatasetError, match="only chat rows can be regenerated"):
        _read_chats(str(write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [1, 2]}])))


@pytest.mark.skipif(not (REAL / "tiktoken.model").is_file(), reason=f"Moonshot's real Kimi files are not at {REAL}")
def test_prompts_are_rendered_with_the_rows_tools_and_the_written_chat_keeps_them(tmp_path):
    from datagen.models.kimi_tokenizer import write_slow_tokenizer
    from tests.test_kimi_tokenizer import _load

    tok = _load(write_slow_tokenizer(REAL, tmp_path / "kimi"))
    tok.chat_template = (REAL / "chat_template.kimi-k2-thinking.jinja").read_text()
    runner = ChunkRunner(RegenerationSettings(tool_rows=ToolRows.KEEP_TOOL_TURNS), tok, None, None, window=4096)
    chats, _ = _read_chats(str(write_jsonl(tmp_path / "rows.jsonl", [SHARE])))
    prepared = runner.prepare(chats)
    (state,) = prepared.going
    prompt = tok.decode(prepared.first_ids[0])
    assert state.tools == [WEATHER] and prompt.startswith("<|im_system|>tool_declare<|im_middle|>")
    assert json.dumps([WEATHER], separators=(",", ":"))[:20] in prompt.replace(", ", ",").replace(": ", ":")
    assert prepared.first_ids[0] == runner.prompt_ids(state.out, [WEATHER]) != runner.prompt_ids(state.out)
    state.out.append({"role": "assistant", "content": "18 degrees."})
    state.pos = len(state.steps)
    rec = _record([state], [], fp="f", k=0, rows_sha256="x")
    assert json.loads(chat_line(rec.chats[0]))["tools"] == [WEATHER]
    assert RowState(row=0, steps=[]).tools is None
