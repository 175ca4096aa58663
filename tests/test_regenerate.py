"""`datagen regenerate` with the real trained SmolLM2-135M-Instruct on the vLLM CPU engine.

Greedy regeneration is compared turn for turn with transformers' greedy ``generate`` (float32)
on the same prompts; a seeded sampled regeneration killed between chunks and resumed is compared
byte for byte with an uninterrupted one. Bad input is refused before the engine starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from datagen.data.checksums import sha256_file
from datagen.regeneration.chats import Generated, RowState, script
from datagen.regeneration.settings import OnLength, RegenerationSettings, ToolRows, row_seed
from tests.builders import REPO, result_of, run_datagen, write_jsonl
from tests.faults._refusal import assert_refused, run_cli
from tests.support.slow_regenerate import slow_regenerate_cmd

EAGER = {"DATAGEN_ENFORCE_EAGER": "1"}
WINDOW = 384  # max_model_len: the long row's prompt does not fit
PER_CHUNK = 3
# Greedy turns: vLLM bf16 and the float32 reference pick different tokens where the reference's
# two best logits are this close (SmolLM2's top logits are about 25): measured margins 0.10-0.25.
NEAR_TIE = 0.5

CALL = {"id": "c0", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}


def regen_rows() -> list[dict]:
    """Chats of every kind the step meets (row numbers matter: see the tests)."""
    u = lambda t: {"role": "user", "content": t}  # noqa: E731
    a = lambda t: {"role": "assistant", "content": t}  # noqa: E731
    return [
        {"messages": [u("What is the capital of France?"), a("Paris, obviously."), u("And of Italy?"), a("Rome.")]},
        {"messages": [{"role": "system", "content": "You answer in one sentence."}, u("Why is the sky blue?")]},
        {"messages": [u("Look it up."), {"role": "assistant", "content": "", "tool_calls": [CALL]},
                      {"role": "tool", "content": "42", "tool_call_id": "c0"}, a("It is 42.")]},
        {"messages": [u("Write a haiku about the sea."), a("Waves.")]},
        {"messages": [u("Summarize this text: " + "the quick brown fox jumps over the lazy dog " * 40)]},
        {"messages": [u("List three colors."), a("red, green, blue"), u("Two more, please."), a("pink")]},
        {"messages": [u("What is 2+2?")]},
        {"messages": [u("Name a fruit."), a("apple")]},
    ]


TOOL_ROW, LONG_ROW = 2, 4


def _regenerate(model: Path, data: Path, out: Path, *extra: str) -> dict:
    proc = run_datagen("regenerate", "--model", str(model), "--dataset", str(data), "--out", str(out),
                       "--max-model-len", str(WINDOW), "--rows-per-chunk", str(PER_CHUNK), *extra, env=EAGER)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return result_of(proc)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("regen") / "chats.jsonl", regen_rows())


@pytest.fixture(scope="module")
def greedy(smollm2, rows_file, tmp_path_factory):
    """One greedy regeneration of ``regen_rows`` (24 new tokens a turn): (out, result)."""
    out = tmp_path_factory.mktemp("greedy") / "out"
    return out, _regenerate(smollm2, rows_file, out, "--max-new-tokens", "24")


SAMPLED = ("--temperature", "0.8", "--top-p", "0.95", "--top-k", "40", "--seed", "7", "--max-new-tokens", "16",
           "--on-length", "drop")


@pytest.fixture(scope="module")
def sampled(smollm2, rows_file, tmp_path_factory):
    """A seeded sampled regeneration, uninterrupted, dropping turns that hit the limit."""
    out = tmp_path_factory.mktemp("sampled") / "out"
    return out, _regenerate(smollm2, rows_file, out, *SAMPLED)


# --- turn by turn (no engine) -------------------------------------------------------------------

def test_assistant_turns_are_generated_and_other_turns_kept_in_the_script():
    msgs = regen_rows()[0]["messages"]
    steps = script(msgs, ToolRows.SKIP)
    assert [s.action for s in steps] == ["keep", "generate", "keep", "generate"]
    assert [s.message for s in steps if s.action == "keep"] == [msgs[0], msgs[2]]
    prompt_only = script(regen_rows()[6]["messages"], ToolRows.SKIP)
    assert [s.action for s in prompt_only] == ["keep", "generate"]  # a chat ending on a user turn gets an answer


def test_tool_call_rows_are_skipped_or_keep_their_tool_turns():
    msgs = regen_rows()[TOOL_ROW]["messages"]
    assert script(msgs, ToolRows.SKIP) == "tool_calls"
    steps = script(msgs, ToolRows.KEEP_TOOL_TURNS)
    assert [(s.action, s.kept_because) for s in steps] == [
        ("keep", None), ("keep", "tool_calls"), ("keep", None), ("generate", None)]
    assert script([{"role": "system", "content": "x"}], ToolRows.SKIP) == "no_user_turn"
    assert script([], ToolRows.SKIP) == "empty"


def test_a_turn_that_hits_the_limit_is_dropped_by_cutting_the_chat_before_it():
    msgs = regen_rows()[5]["messages"]
    st = RowState(row=5, steps=script(msgs, ToolRows.SKIP))
    assert st.advance()
    st.add_turn({"role": "assistant", "content": "a"}, Generated((5,), "stop"), seed=None, on_length=OnLength.DROP)
    assert st.advance()
    st.add_turn({"role": "assistant", "content": "b"}, Generated((6, 7), "length"), seed=None, on_length=OnLength.DROP)
    assert not st.advance()
    assert st.out == [msgs[0], {"role": "assistant", "content": "a"}] and st.cut_at == 3 and st.skipped is None
    first = RowState(row=5, steps=script(msgs, ToolRows.SKIP))
    first.advance()
    first.add_turn({"role": "assistant", "content": "a"}, Generated((5,), "length"), seed=None,
                   on_length=OnLength.DROP)
    assert first.skipped == "length"


def test_each_turn_has_its_own_seed_from_the_run_seed_row_and_message():
    assert row_seed(7, 3, 1) == row_seed(7, 3, 1) < 2**63
    assert len({row_seed(7, 3, 1), row_seed(7, 3, 3), row_seed(7, 4, 1), row_seed(8, 3, 1)}) == 4


def test_greedy_settings_refuse_sampling_knobs():
    with pytest.raises(ValueError, match="greedy"):
        RegenerationSettings(top_p=0.9)
    assert RegenerationSettings(temperature=0.7, top_p=0.9).sampling()["method"] == "sample"


# --- bad input: refused before the engine starts, output left as found --------------------------

# Through `datagen`'s `main` in the test's process (tests/faults/_refusal.py: run_cli), where starting
# an engine fails the test (none of these is marked `engine`): a `datagen regenerate` program each
# took 16 s in the suite, most of it importing vLLM. That the program's exit code and error line reach
# its caller is tests/tasks/test_local_runner.py::test_runs_the_real_datagen_cli_and_reports_its_error's.

def test_pre_tokenized_rows_are_refused_with_their_line(smollm2, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", [regen_rows()[6], {"input_ids": [1, 2, 3]}])
    out = tmp_path / "out"
    o = run_cli("regenerate", "--model", smollm2, "--dataset", data, "--out", out)
    assert_refused(o, code=2, message="only chat rows can be regenerated")
    assert "in.jsonl:2" in o.err, o.err[-2000:]
    assert not out.exists()


def test_image_rows_are_refused_with_their_line(smollm2, tmp_path):
    image = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                                        {"type": "image_url", "image_url": {"url": "a.png"}}]}]}
    data = write_jsonl(tmp_path / "in.jsonl", [regen_rows()[6], image])
    out = tmp_path / "out"
    o = run_cli("regenerate", "--model", smollm2, "--dataset", data, "--out", out)
    assert_refused(o, code=2, message="regeneration takes text chats only")
    assert "in.jsonl:2" in o.err, o.err[-2000:]
    assert not out.exists()


def test_an_output_directory_of_something_else_is_left_as_found(smollm2, rows_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    o = run_cli("regenerate", "--model", smollm2, "--dataset", rows_file, "--out", out,
                "--temperature", "0", "--top-k", "5")
    assert o.code == 2 and "greedy" in o.err, o.err[-2000:]
    o = run_cli("regenerate", "--model", smollm2, "--dataset", rows_file, "--out", out)
    assert o.code == 2 and "not a regeneration's output" in o.err, o.err[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"


# --- the real model on the engine ---------------------------------------------------------------

@pytest.mark.engine
def test_greedy_regeneration_equals_transformers_generate_turn_for_turn(smollm2, greedy):
    """Every generated token is transformers' greedy choice (float32) after the same prompt and the
    turn's tokens before it, or a near-tie of the reference's two best tokens (counted, rare).

    One float32 forward pass over the prompt and the generated turn gives the reference's next-token
    logits at every position of the turn. Up to a turn's first near-tie flip this is transformers'
    ``generate`` of the prompt (it would have fed itself the same prefix): the same first different
    token and margin, without a decoding step per token. After a flip, the rest of the turn is checked
    too, as the greedy continuation of its own prefix (the engine's batching under load decides
    which near-ties flip, so the flips are counted per token, not per turn)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = greedy
    tok = AutoTokenizer.from_pretrained(smollm2)
    ref = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    turns, tokens, flips = 0, 0, []
    for chat, lin in zip(_jsonl(out / "chats.jsonl"), _jsonl(out / "lineage.jsonl")):
        for turn in lin["turns"]:
            text = tok.apply_chat_template(chat["messages"][: turn["message"]], tokenize=False,
                                           add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            ours = turn["token_ids"] + ([eos] if turn["finish"] == "stop" else [])
            with torch.no_grad():  # the logits of the reference's next token after ids + ours[:i], for every i
                logits = ref(torch.tensor([ids + ours[:-1]])).logits[0, len(ids) - 1:]
            best = logits.argmax(-1).tolist()
            assert len(best) == len(ours), (lin["source_row"], turn["message"])
            turns, tokens = turns + 1, tokens + len(ours)
            for i, (theirs, mine) in enumerate(zip(best, ours)):
                if theirs == mine:
                    continue
                margin = float(logits[i, theirs] - logits[i, mine])
                flips.append((lin["source_row"], turn["message"], i, round(margin, 3)))
                assert margin < NEAR_TIE, f"row {lin['source_row']} turn {turn['message']}: token {i} differs by {margin}"
    print(f"greedy parity: {tokens} tokens of {turns} turns, {len(flips)} near-tie flips "
          f"(row, message, token, margin): {flips}")
    assert turns >= 6 and tokens >= 100 and 20 * len(flips) <= tokens


@pytest.mark.engine
def test_assistant_turns_are_replaced_and_the_others_kept(greedy):
    out, result = greedy
    src = regen_rows()
    chats = _jsonl(out / "chats.jsonl")
    lineage = _jsonl(out / "lineage.jsonl")
    assert [e["source_row"] for e in lineage] == [0, 1, 3, 5, 6, 7]  # the tool row and the long one left out
    for chat, lin in zip(chats, lineage):
        before = src[lin["source_row"]]["messages"]
        after = chat["messages"]
        assert [m for m in after if m["role"] != "assistant"] == [m for m in before if m["role"] != "assistant"]
        assert [t["message"] for t in lin["turns"]] == [i for i, m in enumerate(after) if m["role"] == "assistant"]
        assert after[-1]["role"] == "assistant"  # prompt-only rows (1, 6) got their answer
        for t in lin["turns"]:
            assert t["finish"] in ("stop", "length") and t["tokens"] == len(t["token_ids"]) <= 24
            assert "seed" not in t  # greedy
    assert chats[0]["messages"][1]["content"] != "Paris, obviously."
    assert result["rows"] == 6 and result["skipped"] == 2 and result["chunks_generated"] == 3


@pytest.mark.engine
def test_the_manifest_records_the_lineage(smollm2, rows_file, greedy):
    out, result = greedy
    m = json.loads((out / "manifest.json").read_text())
    assert m["source"] == {"path": str(rows_file.resolve()), "sha256": sha256_file(rows_file), "rows": 8}
    assert m["model"]["revision"] == result["model_revision"] and m["model"]["architecture"] == "LlamaForCausalLM"
    assert m["engine"]["name"] == "vllm" and m["engine"]["version"] == result["engine_version"]
    assert m["sampling"] == {"method": "greedy", "max_new_tokens": 24} and m["seed"] == 0
    assert m["rows"] == [0, 1, 3, 5, 6, 7]
    skipped = {s["row"]: s for s in m["skipped"]}
    assert skipped[TOOL_ROW]["reason"] == "tool_calls"
    assert skipped[LONG_ROW]["reason"] == "prompt_too_long" and skipped[LONG_ROW]["window"] == WINDOW
    assert skipped[LONG_ROW]["prompt_tokens"] >= WINDOW
    for name in ("chats.jsonl", "lineage.jsonl"):
        assert m["files"][name]["sha256"] == sha256_file(out / name)
    turns = [t for e in _jsonl(out / "lineage.jsonl") for t in e["turns"]]
    assert m["totals"]["generated_tokens"] == sum(t["tokens"] for t in turns) == result["generated_tokens"]
    assert m["totals"]["length_turns"] == sum(t["finish"] == "length" for t in turns) > 0
    assert not (out / ".chunks").exists()


@pytest.mark.engine
def test_extraction_reads_the_regenerated_chats_with_the_generated_tokens_as_targets(smollm2, greedy):
    from transformers import AutoTokenizer

    from datagen.data.planning import prepare_dataset

    out, _ = greedy
    tok = AutoTokenizer.from_pretrained(smollm2)
    data = prepare_dataset(out / "chats.jsonl", load_tokenizer=lambda: tok, vocab_size=49152, max_seq_len=4096)
    assert sorted(data.samples) == list(range(6)) and not data.skipped
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    same = 0
    lineage = _jsonl(out / "lineage.jsonl")
    for i, lin in enumerate(lineage):
        s = data.samples[i]
        targets = s.input_ids[s.loss_mask.astype(bool)].tolist()
        generated = [x for t in lin["turns"] for x in t["token_ids"]]
        assert len(targets) >= len(generated)
        # each target span is the turn's text and the template's end of turn (<|im_end|>, newline)
        same += targets == [x for t in lin["turns"] for x in [*t["token_ids"], tok.eos_token_id, *newline]]
    assert same >= len(lineage) // 2  # decoded text tokenized again gives the generated ids back, mostly


@pytest.mark.engine
def test_a_finished_regeneration_is_not_generated_again(smollm2, rows_file, greedy, monkeypatch):
    """The same command again, in this process (no interpreter and imports to start, no engine to
    start: starting one fails the test)."""
    from types import SimpleNamespace

    from datagen.regeneration.generator import Generator

    out, first = greedy
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(Generator, "start", lambda self: pytest.fail("an engine started for a finished regeneration"))
    o = run_cli("regenerate", "--model", smollm2, "--dataset", rows_file, "--out", out, "--max-model-len", str(WINDOW),
                "--rows-per-chunk", str(PER_CHUNK), "--max-new-tokens", "24")
    assert o.code == 0, o.err[-4000:]
    again = result_of(SimpleNamespace(stdout=o.out, returncode=o.code, stderr=o.err))
    assert again["cached"] and again["fingerprint"] == first["fingerprint"] and again["chunks_generated"] == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.engine
def test_a_sampled_regeneration_drops_the_turns_that_hit_the_limit(sampled):
    out, result = sampled
    m = json.loads((out / "manifest.json").read_text())
    assert m["sampling"]["method"] == "sample" and m["sampling"]["seed"] == 7
    turns = [t for e in _jsonl(out / "lineage.jsonl") for t in e["turns"]]
    assert all(t["finish"] == "stop" for t in turns) and result["length_turns"] == 0
    assert m["cut"] or m["totals"]["skipped_by_reason"].get("length"), "16 tokens never hit: nothing dropped"
    for lin in _jsonl(out / "lineage.jsonl"):
        for t in lin["turns"]:
            assert t["seed"] == row_seed(7, lin["source_row"], t["message"])


@pytest.mark.engine
def test_a_killed_regeneration_resumes_to_the_same_bytes(smollm2, rows_file, sampled, tmp_path):
    ref, _ = sampled
    out = tmp_path / "out"
    cmd = slow_regenerate_cmd(
        120, "regenerate", "--model", str(smollm2), "--dataset", str(rows_file), "--out", str(out),
        "--max-model-len", str(WINDOW), "--rows-per-chunk", str(PER_CHUNK), *SAMPLED)
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **EAGER}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = out / ".chunks" / "chunk-000000.json"
    deadline = time.monotonic() + 500
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.exists(), "the run ended or timed out before writing its first chunk"
    os.killpg(proc.pid, signal.SIGKILL)  # the driver, the engine core and its workers
    proc.wait()
    assert not (out / "manifest.json").exists()
    assert sorted(p.name for p in (out / ".chunks").glob("chunk-*.json")) == ["chunk-000000.json"]
    resumed = _regenerate(smollm2, rows_file, out, *SAMPLED)
    assert resumed["chunks_reused"] == 1 and resumed["chunks_generated"] == 2
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())
    for p in ref.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name


def test_a_thinking_models_reasoning_goes_to_reasoning_content(tmp_path):
    from transformers import AutoTokenizer

    from datagen.data.row_checks import _check_messages
    from datagen.errors import SpecError
    from datagen.testmodels.tiny_tiktoken import write_kimi_tokenizer
    from datagen.regeneration.reasoning import ReasoningSplitter, assistant_message

    write_kimi_tokenizer(tmp_path, vocab_size=1024)
    tok = AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=True)
    splitter = ReasoningSplitter("kimi_k2", tok)  # Kimi-K2.5's generation prompt opens <think>
    turn = assistant_message("two and two make four</think>It is 4.", splitter)
    assert turn == {"role": "assistant", "content": "It is 4.", "reasoning_content": "two and two make four"}
    _check_messages({"messages": [{"role": "user", "content": "2+2?"}, turn]}, path="chats.jsonl", line=1)
    assert assistant_message("It is 4.", None) == {"role": "assistant", "content": "It is 4."}
    with pytest.raises(SpecError, match="kimi_k2"):
        ReasoningSplitter("no-such-parser", tok)


@pytest.mark.engine
def test_the_as_generated_rows_are_the_engines_prompts_and_generated_ids(smollm2, greedy):
    from transformers import AutoTokenizer

    from datagen.data.planning import prepare_dataset

    out, _ = greedy
    tok = AutoTokenizer.from_pretrained(smollm2)
    m = json.loads((out / "manifest.json").read_text())
    assert m["dataset"] == "chats.jsonl" and m["files"]["turns.jsonl"]["sha256"] == sha256_file(out / "turns.jsonl")
    chats, lineage, rows = _jsonl(out / "chats.jsonl"), _jsonl(out / "lineage.jsonl"), _jsonl(out / "turns.jsonl")
    assert len(rows) == len(m["turn_rows"]) == sum(len(e["turns"]) for e in lineage) == m["totals"]["generated_turns"]
    for row, (chat, message) in zip(rows, m["turn_rows"]):
        turn = next(t for t in lineage[chat]["turns"] if t["message"] == message)
        prompt = tok(tok.apply_chat_template(chats[chat]["messages"][:message], tokenize=False,
                                             add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        ends = [turn["stop_token"]] if turn["finish"] == "stop" else []
        assert row["input_ids"] == prompt + turn["token_ids"] + ends
        assert row["loss_mask"] == [0] * len(prompt) + [1] * (len(turn["token_ids"]) + len(ends))
    # extraction reads them as pre-tokenized rows, every one kept
    data = prepare_dataset(out / "turns.jsonl", load_tokenizer=lambda: tok, vocab_size=49152, max_seq_len=4096)
    assert len(data.samples) == len(rows) and not data.skipped
