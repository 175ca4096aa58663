"""The project's Kimi tokenizer on Moonshot's real files (``shared/real-kimi`` beside the repository,
or DATAGEN_REAL_KIMI): the real special-token ids, round trips, exact chat masks under both real
templates (K2-Instruct, K2-Thinking), the fast tokenizer converted from the real ranks (id for id
the slow one's), and the diagnosis of shipped tokenizer code that cannot run under transformers 5."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from datagen import settings
from datagen.data.chat_tokens import tokenize_chat
from datagen.data.dataset import tokenizer_fingerprint
from datagen.errors import DatasetError, ModelError
from datagen.models import kimi_tokenizer
from datagen.models.kimi_tokenizer import ConversionMismatch, check_same_ids, write_slow_tokenizer
from datagen.models.tokenizer import load_tokenizer

REAL = settings.real_kimi_dir()
pytestmark = pytest.mark.skipif(not (REAL / "tiktoken.model").is_file(),
                                reason=f"Moonshot's real Kimi tokenizer files are not at {REAL} (set DATAGEN_REAL_KIMI)")

# The real tokenizer_config.json's named ids (Kimi-K2, K2-Thinking, K2.5 share them).
REAL_SPECIAL_IDS = {
    "[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587, "<|im_assistant|>": 163588,
    "<|start_header_id|>": 163590, "<|end_header_id|>": 163591, "[EOT]": 163593, "<|im_system|>": 163594,
    "<|tool_calls_section_begin|>": 163595, "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599, "<|im_middle|>": 163601,
    "[UNK]": 163838, "[PAD]": 163839,
}
INSTRUCT_SYSTEM = "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
THINKING_SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"


def _load(d: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d, trust_remote_code=True)


@pytest.fixture(scope="module")
def instruct(tmp_path_factory):
    """The project's slow tokenizer code over the real ranks and config (K2-Instruct's template)."""
    return _load(write_slow_tokenizer(REAL, tmp_path_factory.mktemp("k2-instruct")))


@pytest.fixture(scope="module")
def thinking(instruct):
    """The same tokenizer with K2-Thinking's template (a copy: loading the ranks costs seconds)."""
    import copy

    tok = copy.copy(instruct)
    tok.chat_template = (REAL / "chat_template.kimi-k2-thinking.jinja").read_text()
    return tok


@pytest.fixture(scope="module")
def fast_dir(tmp_path_factory, instruct):
    """The fast tokenizer converted from the real ranks, checked against the slow one."""
    from datagen.testmodels.tiny import _corpus

    out, n = kimi_tokenizer.convert_and_check(REAL, tmp_path_factory.mktemp("kimi-fast"), corpus=_corpus(300, seed=1),
                                              slow=instruct)
    assert n > 5000
    return out


def segments(tok, ids: np.ndarray, mask: np.ndarray) -> list[tuple[int, str]]:
    """(mask value, decoded text) of each run of equal mask values: the whole chat, exactly."""
    out: list[tuple[int, list[int]]] = []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return [(m, tok.decode(run)) for m, run in out]


def call(i: int, name: str, args: dict) -> dict:
    return {"id": f"functions.{name}:{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def exact(tok, msgs) -> list[tuple[int, str]]:
    ids, mask = tokenize_chat(tok, msgs)
    whole = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False), add_special_tokens=False)
    assert ids.tolist() == whole["input_ids"], "the masked ids are the whole render's tokenization"
    return segments(tok, ids, mask)


AGENT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me check.", "reasoning_content": "I need the weather tool.",
     "tool_calls": [call(0, "get_weather", {"city": "Paris"})]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"temp": 18}'},
    {"role": "assistant", "content": "", "reasoning_content": "Now the forecast.",
     "tool_calls": [call(1, "forecast", {"city": "Paris", "days": 2})]},
]


def test_the_real_ranks_give_the_real_special_token_ids_and_vocabulary_size(instruct):
    assert not instruct.is_fast and type(instruct).__name__ == "TikTokenTokenizer"
    assert {t: instruct.convert_tokens_to_ids(t) for t in REAL_SPECIAL_IDS} == REAL_SPECIAL_IDS
    assert (instruct.bos_token_id, instruct.eos_token_id, instruct.pad_token_id, instruct.unk_token_id) == \
        (163584, 163585, 163839, 163838)
    assert instruct.vocab_size == 163840 and instruct.convert_tokens_to_ids("<|reserved_token_163700|>") == 163700
    ids = instruct("<|im_user|>user<|im_middle|>hi<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == 163587 and ids[2] == 163601 and ids[-1] == 163586 and max(ids[1:2] + ids[3:-1]) < 163584


def test_text_round_trips_through_the_real_ranks(instruct):
    for text in kimi_tokenizer.check_corpus(instruct):
        ids = instruct(text, add_special_tokens=False)["input_ids"]
        assert instruct.decode(ids) == text, text
    # the real ranks merge common words into single tokens (a reconstruction with other ranks would not)
    assert len(instruct("Hello world", add_special_tokens=False)["input_ids"]) == 2


def test_instruct_template_injects_its_system_prompt_and_masks_each_assistant_turn(instruct):
    msgs = [{"role": "user", "content": "What is BPE?"}, {"role": "assistant", "content": "Byte pair encoding."},
            {"role": "user", "content": "中文呢？"}, {"role": "assistant", "content": "也一样。"}]
    assert exact(instruct, msgs) == [
        (0, INSTRUCT_SYSTEM + "<|im_user|>user<|im_middle|>What is BPE?<|im_end|><|im_assistant|>assistant<|im_middle|>"),
        (1, "Byte pair encoding.<|im_end|>"),
        (0, "<|im_user|>user<|im_middle|>中文呢？<|im_end|><|im_assistant|>assistant<|im_middle|>"),
        (1, "也一样。<|im_end|>"),
    ]
    own = [{"role": "system", "content": "Be brief."}, *msgs[:2]]
    assert exact(instruct, own)[0] == (0, "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user"
                                          "<|im_middle|>What is BPE?<|im_end|><|im_assistant|>assistant<|im_middle|>")


def test_instruct_template_renders_tool_results_as_system_turns_and_drops_tool_calls(instruct):
    assert exact(instruct, AGENT) == [
        (0, INSTRUCT_SYSTEM + "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|><|im_assistant|>assistant<|im_middle|>"),
        (1, "Let me check.<|im_end|>"),
        (0, '<|im_system|>tool<|im_middle|>{"temp": 18}<|im_end|><|im_assistant|>assistant<|im_middle|>'),
        (1, "<|im_end|>"),
    ]


def test_thinking_template_masks_reasoning_and_tool_calls_and_leaves_tool_results_out(thinking):
    assert exact(thinking, AGENT) == [
        (0, THINKING_SYSTEM + "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|><|im_assistant|>assistant<|im_middle|>"),
        (1, "<think>I need the weather tool.</think>Let me check.<|tool_calls_section_begin|><|tool_call_begin|>"
            'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
            "<|tool_calls_section_end|><|im_end|>"),
        (0, '<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n{"temp": 18}<|im_end|>'
            "<|im_assistant|>assistant<|im_middle|>"),
        (1, "<think>Now the forecast.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.forecast:1"
            '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'),
    ]


def test_thinking_template_keeps_history_turns_with_an_empty_think_block(thinking):
    # The last assistant turn without tool calls and everything before it are history: the template
    # writes <think></think> for them, whatever their reasoning_content (the target is what it renders).
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4.", "reasoning_content": "add"},
            {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6."}]
    assert exact(thinking, msgs) == [
        (0, THINKING_SYSTEM + "<|im_user|>user<|im_middle|>2+2?<|im_end|><|im_assistant|>assistant<|im_middle|>"),
        (1, "<think></think>4.<|im_end|>"),
        (0, "<|im_user|>user<|im_middle|>3+3?<|im_end|><|im_assistant|>assistant<|im_middle|>"),
        (1, "<think></think>6.<|im_end|>"),
    ]


def test_a_chat_whose_thinking_template_rewrites_an_earlier_turn_is_refused(thinking):
    # The final answer makes the tool-calling turn history: the whole chat drops its reasoning,
    # the render up to it keeps it, so its tokens have no place in the whole chat.
    msgs = [*AGENT[:3], {"role": "assistant", "content": "18 degrees."}]
    with pytest.raises(DatasetError, match="rewrites earlier turns") as e:
        tokenize_chat(thinking, msgs, path="tools.jsonl", line=3)
    assert "tools.jsonl:3" in str(e.value) and "pre-tokenize" in e.value.hint


@pytest.fixture(scope="module")
def fast(fast_dir, tmp_path_factory):
    """The converted tokenizer named in a spec for a model directory without a loadable one."""
    return load_tokenizer(tmp_path_factory.mktemp("model-without-tokenizer"), tokenizer=fast_dir)


def test_the_converted_fast_tokenizer_has_the_slow_ones_ids_masks_and_its_own_fingerprint(fast, instruct, thinking):
    assert fast.is_fast and {t: fast.convert_tokens_to_ids(t) for t in REAL_SPECIAL_IDS} == REAL_SPECIAL_IDS
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id) == (163584, 163585, 163839)
    assert len(fast) == 163840 and fast.chat_template == instruct.chat_template
    msgs = [{"role": "user", "content": "What is BPE?"}, {"role": "assistant", "content": "Byte pair encoding."}]
    own = fast.chat_template
    try:
        for slow in (instruct, thinking):
            fast.chat_template = slow.chat_template
            for chat in (AGENT, msgs):
                assert all(np.array_equal(a, b) for a, b in zip(tokenize_chat(slow, chat), tokenize_chat(fast, chat)))
    finally:
        fast.chat_template = own
    assert tokenizer_fingerprint(fast) != tokenizer_fingerprint(instruct), "the tokenizer that ran is fingerprinted"


def test_a_conversion_that_tokenizes_differently_is_caught_and_names_the_text(instruct):
    def one_token_short(text, **kw):
        return {"input_ids": instruct(text, **kw)["input_ids"][:-1]}

    with pytest.raises(ConversionMismatch, match="differs from the slow one at token 6 of .Hello world, it's a test.*slow \\[13\\], fast \\[\\]"):
        check_same_ids(instruct, one_token_short, ["Hello world, it's a test."])


def test_converting_a_directory_without_ranks_says_what_it_needs(tmp_path, capsys):
    assert kimi_tokenizer.main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert "has no tiktoken.model" in capsys.readouterr().err and not (tmp_path / "out").exists()


# The released tokenization_kimi.py's first import (July 2025); transformers 5 has no such function.
RELEASED_IMPORT = "from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode\n"


def test_shipped_tokenizer_code_that_cannot_run_is_diagnosed_with_the_way_on(tmp_path):
    model = write_slow_tokenizer(REAL, tmp_path / "kimi")
    code = (model / "tokenization_kimi.py").read_text().replace("from __future__ import annotations\n", "")
    (model / "tokenization_kimi.py").write_text(RELEASED_IMPORT + code)
    with pytest.raises(ModelError) as e:
        load_tokenizer(model, trust_remote_code=True)
    msg = str(e.value)
    assert "shipped as code (tokenization_kimi.py)" in msg and "cannot run under the installed transformers" in msg
    assert "bytes_to_unicode" in msg and "trust_remote_code" not in e.value.hint
    assert "python -m datagen.models.kimi_tokenizer" in e.value.hint and '"tokenizer"' in e.value.hint


def test_a_tokenizer_named_in_the_spec_must_exist(tmp_path, fast_dir):
    with pytest.raises(ModelError, match="has no tokenizer files") as e:
        load_tokenizer(fast_dir, tokenizer=tmp_path / "missing")
    assert "named in the spec" in str(e.value)


@pytest.mark.parametrize("which", ["instruct", "thinking"])
def test_planning_in_workers_on_the_real_ranks_gives_the_former_plan_byte_for_byte(which, request, tmp_path):
    from datagen.data.planning import prepare_dataset
    from tests.builders import write_jsonl
    from tests.support.planning_reference import reference_prepare_dataset
    from tests.test_planning import assert_same, varied_rows

    tok = request.getfixturevalue(which)
    path = write_jsonl(tmp_path / "rows.jsonl", varied_rows(200, seed=2))
    kw = dict(load_tokenizer=lambda: tok, vocab_size=163840, max_seq_len=100)
    assert_same(prepare_dataset(path, workers=2, **kw), reference_prepare_dataset(path, **kw))


def test_the_slow_tokenizers_ids_come_from_tiktoken_in_one_step_only_where_they_are_the_same(instruct, fast):
    """Planning with the slow tokenizer asks tiktoken for the ids of a text directly (the slow call
    goes through Python token strings); the shortcut gives the slow call's ids, and is not taken for
    a tokenizer whose tokenization is not the project's own or whose added tokens strip spaces."""
    import copy

    from tokenizers import AddedToken

    from datagen.data.tiktoken_ids import tiktoken_encoder
    from tests.test_planning import WORDS

    encode = tiktoken_encoder(instruct)
    assert encode is not None and tiktoken_encoder(fast) is None
    names = sorted(REAL_SPECIAL_IDS)
    texts = [" ".join(WORDS[i % len(WORDS):] + [names[i % len(names)]] * (i % 3)) + names[i % 5] for i in range(40)]
    texts += ["<|im_end|><|im_user|>", "<|reserved_token_300|> [BOS]x", "<|im_end", "a<|im_middle|>\n\n  b"]
    assert encode(texts) == [instruct(t, add_special_tokens=False)["input_ids"] for t in texts]

    class Other(type(instruct)):
        def tokenize(self, text, **kwargs):
            return super().tokenize(text.lower(), **kwargs)

    other = copy.copy(instruct)
    other.__class__ = Other
    assert tiktoken_encoder(other) is None
    stripping = copy.deepcopy(instruct)
    stripping.add_tokens([AddedToken("<|im_end|>", lstrip=True, special=True)], special_tokens=True)
    assert tiktoken_encoder(stripping) is None
