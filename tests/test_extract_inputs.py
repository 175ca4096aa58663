"""Bad input is refused before any weight is loaded, with a clear message, and leaves nothing."""

from __future__ import annotations

import json
import shutil

import pytest

from datagen.cli import main as datagen_main
from datagen.errors import EXIT_BAD_INPUT
from tests.builders import token_rows, write_jsonl


def _run(capsys, *args):
    code = datagen_main(list(args))
    return code, capsys.readouterr().err


@pytest.fixture
def good_rows(tmp_path):
    return write_jsonl(tmp_path / "rows.jsonl", token_rows([5, 9, 12]))


def _expect_refusal(capsys, tmp_path, model, data, *extra, message: str, code: int = EXIT_BAD_INPUT):
    out = tmp_path / "out"
    rc, err = _run(capsys, "extract", "--model", str(model), "--dataset", str(data), "--out", str(out),
                   "--engine", "hf", *extra)
    assert rc == code, err
    assert message in err, err
    assert "->" in err, "the error must say what to do"
    assert not out.exists(), "a refused run must leave no output"
    return err


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"input_ids": [1, 2', "malformed JSON"),
        ("[1, 2, 3]", "must be a JSON object"),
        ('{"messages": [{"role": "wizard", "content": "hi"}]}', "unknown role 'wizard'"),
        ('{"messages": [{"role": "user", "content": 5}]}', "content must be a string"),
        ('{"messages": [{"role": "user"}]}', "exactly 'role' and 'content'"),
        ('{"messages": "hello"}', "messages must be a list"),
        ('{"text": "hello"}', "row has none of the fields messages, conversations, data, input_ids"),
        ('{"input_ids": [1, "2"]}', "list of integers"),
        ('{"input_ids": [1, 2], "loss_mask": [1]}', "loss_mask has 1 entries"),
        ('{"input_ids": [1, 2], "loss_mask": [1, 2]}', "0/1 integers"),
        ('{"input_ids": [1, 99999]}', "outside the model's vocabulary"),
        ('{"input_ids": [-1, 2]}', "outside the model's vocabulary"),
        ('{"input_ids": [1], "extra": 1}', "unknown fields"),
        ("", "blank line"),
    ],
)
def test_a_bad_row_is_refused_with_its_line_number(capsys, tmp_path, tiny_llama, line, message):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n' + line + "\n")
    err = _expect_refusal(capsys, tmp_path, tiny_llama, data, message=message)
    assert f"{data}:2" in err


def test_invalid_utf8_is_refused(capsys, tmp_path, tiny_llama):
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b'{"input_ids": [1]}\n{"messages": [{"role": "user", "content": "\xff\xfe"}]}\n')
    _expect_refusal(capsys, tmp_path, tiny_llama, data, message="not valid UTF-8")


def test_an_empty_dataset_is_refused(capsys, tmp_path, tiny_llama):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    _expect_refusal(capsys, tmp_path, tiny_llama, data, message="dataset is empty")


@pytest.mark.parametrize(
    "layers, message",
    [
        ("2,3,7", "out of range"),
        ("2,2,6", "duplicates"),
        ("3,2,6", "not sorted"),
        ("-1,2", "negative"),
        ("2,x", "comma-separated list of integers"),
    ],
)
def test_bad_layer_ids_are_refused(capsys, tmp_path, tiny_llama, good_rows, layers, message):
    _expect_refusal(capsys, tmp_path, tiny_llama, good_rows, f"--layers={layers}", message=message)


def test_a_missing_model_is_refused(capsys, tmp_path, good_rows):
    _expect_refusal(capsys, tmp_path, tmp_path / "nope", good_rows, message="does not exist")


def test_an_unsupported_architecture_is_refused(capsys, tmp_path, tiny_llama, good_rows):
    model = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(cfg))
    _expect_refusal(capsys, tmp_path, model, good_rows, message="architecture GPT2LMHeadModel cannot be captured")


def test_a_missing_weight_file_is_refused(capsys, tmp_path, tiny_llama, good_rows):
    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    (model / "model.safetensors").unlink()
    _expect_refusal(capsys, tmp_path, model, good_rows, message="has no safetensors weights")


def test_a_truncated_weight_file_is_refused(capsys, tmp_path, tiny_llama, good_rows):
    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    w = model / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-1000])
    _expect_refusal(capsys, tmp_path, model, good_rows, message="is truncated")


def test_an_oversized_safetensors_header_is_refused(capsys, tmp_path, tiny_llama, good_rows):
    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    w = model / "model.safetensors"
    w.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    _expect_refusal(capsys, tmp_path, model, good_rows, message="header")


def test_remote_code_is_refused_unless_the_spec_allows_it(capsys, tmp_path, tiny_llama, good_rows):
    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["EvilForCausalLM"]
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil.EvilForCausalLM"}
    (model / "config.json").write_text(json.dumps(cfg))
    _expect_refusal(capsys, tmp_path, model, good_rows, message="asks to run its own Python code")


def test_chat_rows_without_a_tokenizer_are_refused(capsys, tmp_path, tiny_llama):
    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    (model / "tokenizer.json").unlink()
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                                {"role": "assistant", "content": "yo"}]}])
    _expect_refusal(capsys, tmp_path, model, data, message="has no tokenizer")


def test_unknown_spec_fields_are_refused(capsys, tmp_path, tiny_llama, good_rows):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": str(tiny_llama), "dataset": str(good_rows), "out": str(tmp_path / "out"),
                                "layerz": [1, 2]}))
    rc, err = _run(capsys, "extract", "--spec", str(spec))
    assert rc == EXIT_BAD_INPUT and "layerz" in err and not (tmp_path / "out").exists()


def test_a_max_seq_len_beyond_the_models_positions_is_refused(capsys, tmp_path, tiny_llama, good_rows):
    _expect_refusal(capsys, tmp_path, tiny_llama, good_rows, "--max-seq-len", "100000", message="does not fit")


def test_an_output_directory_of_another_spec_is_refused(capsys, tmp_path, tiny_llama, good_rows):
    out = tmp_path / "out"
    rc, err = _run(capsys, "extract", "--model", str(tiny_llama), "--dataset", str(good_rows), "--out", str(out),
                   "--engine", "hf", "--layers", "2,3,6")
    assert rc == 0, err
    before = sorted(p.name for p in out.rglob("*"))
    rc, err = _run(capsys, "extract", "--model", str(tiny_llama), "--dataset", str(good_rows), "--out", str(out),
                   "--engine", "hf", "--layers", "1,3,6")
    assert rc == EXIT_BAD_INPUT and "holds a dataset of another spec" in err
    assert sorted(p.name for p in out.rglob("*")) == before


def test_a_non_empty_foreign_directory_is_refused(capsys, tmp_path, tiny_llama, good_rows):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    rc, err = _run(capsys, "extract", "--model", str(tiny_llama), "--dataset", str(good_rows), "--out", str(out),
                   "--engine", "hf")
    assert rc == EXIT_BAD_INPUT and "not empty" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def _with_positions(src, dst, positions: int):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = positions
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_the_default_max_seq_len_adapts_to_a_model_with_fewer_positions(capsys, tmp_path, tiny_llama, good_rows):
    model = _with_positions(tiny_llama, tmp_path / "short", 2048)
    out = tmp_path / "out"
    rc, err = _run(capsys, "extract", "--model", str(model), "--dataset", str(good_rows), "--out", str(out),
                   "--engine", "hf")
    assert rc == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["spec"]["preprocessing"]["max_seq_len"] == 2047


def test_the_default_max_seq_len_is_4096_where_the_model_has_more_positions(capsys, tmp_path, tiny_llama, good_rows):
    rc = datagen_main(["plan", "--model", str(tiny_llama), "--dataset", str(good_rows), "--out",
                       str(tmp_path / "out"), "--engine", "hf"])
    out = capsys.readouterr().out
    assert rc == 0
    assert json.loads(out.split("datagen-result: ")[1])["spec"]["preprocessing"]["max_seq_len"] == 4096


def test_an_explicit_max_seq_len_beyond_a_short_models_positions_is_still_refused(capsys, tmp_path, tiny_llama,
                                                                                 good_rows):
    model = _with_positions(tiny_llama, tmp_path / "short", 2048)
    _expect_refusal(capsys, tmp_path, model, good_rows, "--max-seq-len", "4096",
                    message="max_seq_len 4096 does not fit the model's 2048 positions")
