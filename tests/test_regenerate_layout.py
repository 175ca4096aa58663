"""The as-generated layout of a regeneration (``turns.jsonl``) under Kimi-K2-Thinking's real template.

The template renders every finished assistant turn with an empty think block: a regenerated chat's
reasoning is in its ``reasoning_content`` but not in what extraction renders. The as-generated rows
hold, per generated turn, the prompt the engine was given and the ids it generated, reasoning
included: the tokens the target computes when it serves the conversation.
"""

from __future__ import annotations

import copy

import pytest

from datagen import settings
from datagen.data.chat_tokens import tokenize_chat
from datagen.models.kimi_tokenizer import write_slow_tokenizer
from datagen.regeneration.rounds import ChunkRunner
from datagen.regeneration.settings import RegenerationSettings
from datagen.regeneration.turns import turn_rows

REAL = settings.real_kimi_dir()
pytestmark = pytest.mark.skipif(not (REAL / "tiktoken.model").is_file(),
                                reason=f"Moonshot's real Kimi tokenizer files are not at {REAL} (set DATAGEN_REAL_KIMI)")
IM_END = 163586


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(write_slow_tokenizer(REAL, tmp_path_factory.mktemp("k2")), trust_remote_code=True)
    tok = copy.copy(tok)
    tok.chat_template = (REAL / "chat_template.kimi-k2-thinking.jinja").read_text()
    return tok


def generated(tok, reasoning: str, answer: str) -> list[int]:
    """The ids a thinking model generates for a turn (the stop token apart)."""
    return tok(f"<think>{reasoning}</think>{answer}", add_special_tokens=False)["input_ids"]


def test_as_generated_rows_keep_the_reasoning_that_the_thinking_template_drops_from_finished_turns(thinking):
    runner = ChunkRunner(RegenerationSettings(), thinking, None, None, window=4096)
    chat = [{"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4.", "reasoning_content": "Two and two make four."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6.", "reasoning_content": "Three and three make six."}]
    first, second = generated(thinking, "Two and two make four.", "4."), generated(thinking, "Three and three make six.", "6.")
    lineage = [{"message": 1, "finish": "stop", "token_ids": first, "stop_token": IM_END},
               {"message": 3, "finish": "length", "token_ids": second}]  # no stop token: it hit the limit
    rows = turn_rows(lambda m: runner.prompt_ids(chat[:m]), lineage)

    assert [r["message"] for r in rows] == [1, 3]
    for r, turn, ids in zip(rows, lineage, (first + [IM_END], second)):
        prompt = runner.prompt_ids(chat[: turn["message"]])
        assert r["input_ids"] == prompt + ids  # the exact prompt the engine was given, then what it generated
        assert r["loss_mask"] == [0] * len(prompt) + [1] * len(ids)
    assert "Three and three make six." in thinking.decode(rows[1]["input_ids"])
    # The second turn's prompt holds the first turn as the template renders history: an empty think.
    assert "<think></think>4.<|im_end|>" in thinking.decode(rows[1]["input_ids"])
    assert "Two and two make four." not in thinking.decode(rows[1]["input_ids"])

    # Extraction of the chat itself renders both finished turns with an empty think block: the
    # generated reasoning is not among its tokens, and the last turn's targets differ from the
    # tokens the model generated.
    ids, mask = tokenize_chat(thinking, chat)
    text = thinking.decode(ids.tolist())
    assert "make four" not in text and "make six" not in text
    assert text.count("<think></think>") == 2
    targets = [int(i) for i, m in zip(ids, mask) if m]
    assert targets[-len(second) - 1:] != second + [IM_END]
