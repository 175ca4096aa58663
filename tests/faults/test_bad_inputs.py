"""Bad inputs to every step, one case each: spec files, model directories, datasets, output
locations, validate / publish / download / env-check / export arguments, the flow's parameter.

tests/test_extract_inputs.py already covers single bad rows and layer lists of `datagen extract`;
these are the cases it does not. Each refusal: the step's exit code, the problem named, a
``  -> `` line saying what to do, no traceback, nothing written (tests/faults/_refusal.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from datagen.data.contract import MANIFEST_NAME
from datagen.errors import EXIT_BAD_INPUT, EXIT_CANNOT_RUN_HERE, EXIT_OK, EXIT_VALIDATION, SpecError
from tests.builders import REPO, token_rows, write_jsonl
from tests.support.slow_datagen import slow_datagen_cmd
from tests.faults._refusal import assert_refused, run_cli, tree
from tests.support.extracted import extracted_dataset

GOOD_ROWS = [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}, {"input_ids": [9, 10, 11]}]


@pytest.fixture
def rows(tmp_path) -> Path:
    return write_jsonl(tmp_path / "rows.jsonl", GOOD_ROWS)


@pytest.fixture
def dataset(tmp_path_factory, tmp_path) -> Path:
    """A copy of the session's extracted tiny dataset, with no validation record."""
    ds = shutil.copytree(extracted_dataset(tmp_path_factory), tmp_path / "ds")
    (ds / ".datagen" / "validation.json").unlink(missing_ok=True)
    return ds


def _record(case, step: str, name: str, outcome: str) -> None:
    case.category = "bad-input"
    case.case = f"{step}: {name}"
    case.attempts = 1
    case.outcome = outcome
    case.details["group"] = step


def _model_copy(src: Path, dst: Path, change) -> Path:
    shutil.copytree(src, dst)
    change(dst)
    return dst


def _edit_json(path: Path, change) -> None:
    obj = json.loads(path.read_text())
    change(obj)
    path.write_text(json.dumps(obj))


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


def _rewrite_header(path: Path, change) -> None:
    raw = path.read_bytes()
    n, header = _header(path)
    change(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new)) if len(new) <= n else b""
    assert len(new) == n, "the edit must keep the header's length"
    path.write_bytes(raw[:8] + new + raw[8 + n:])


def _first_tensor(h: dict) -> dict:
    return h[next(k for k in h if k != "__metadata__")]


# --- extract: spec files, models, datasets, output ----------------------------------------------

SPEC_CASES = {
    "spec file is not JSON": ("{model: x", "cannot read spec file"),
    "spec file is a JSON list": ([1, 2], "must hold a JSON object"),
    "engine is a string": ({"engine": "vllm"}, "engine must be an object"),
    "samples_per_shard is a string": ({"samples_per_shard": "ten"}, "samples_per_shard"),
    "max_seq_len below 2": ({"max_seq_len": 1}, "max_seq_len"),
    "unknown storage dtype": ({"engine": {"name": "hf", "dtype": "int8"}}, "engine.dtype"),
    "unknown engine": ({"engine": {"name": "tensorrt"}}, "engine.name"),
    "tensor_parallel_size 0": ({"engine": {"name": "hf", "tensor_parallel_size": 0}}, "tensor_parallel_size"),
    "max_num_seqs above the token budget": ({"engine": {"name": "vllm", "max_num_batched_tokens": 128,
                                                        "max_num_seqs": 300}}, "max_num_seqs 300 exceeds"),
    "layer_ids a string": ({"layer_ids": "2,3"}, "layer_ids"),
    "trust_remote_code a list": ({"engine": {"name": "hf", "trust_remote_code": [True]}}, "trust_remote_code"),
}


@pytest.mark.parametrize("name", list(SPEC_CASES))
def test_a_bad_extract_spec_file_is_refused_naming_the_field(tiny_llama, rows, tmp_path, case, name):
    content, message = SPEC_CASES[name]
    out = tmp_path / "out"
    spec = tmp_path / "spec.json"
    if isinstance(content, dict):
        content = {"model": str(tiny_llama), "dataset": str(rows), "out": str(out), "engine": {"name": "hf"}, **content}
    spec.write_text(content if isinstance(content, str) else json.dumps(content))
    o = run_cli("extract", "--spec", spec)
    assert_refused(o, code=EXIT_BAD_INPUT, message=message)
    assert not out.exists()
    _record(case, "extract", name, "refused, exit 2, field named")


def test_a_token_budget_below_the_default_sequence_count_is_accepted(tiny_llama, rows, tmp_path, case):
    """Regression: `--max-num-batched-tokens 128` alone used to fail at engine start (vLLM wants
    max_num_seqs <= max_num_batched_tokens and max_num_seqs defaulted to 256)."""
    o = run_cli("plan", "--model", tiny_llama, "--dataset", rows, "--out", tmp_path / "out",
                "--max-num-batched-tokens", "128")
    assert o.code == EXIT_OK, o.err
    assert json.loads(o.out.split("datagen-result: ")[1])["spec"]["engine"]["max_num_seqs"] == 128
    _record(case, "extract", "--max-num-batched-tokens 128 without max_num_seqs",
            "accepted: max_num_seqs defaults to the budget (was: vLLM error at engine start)")


def _no_config(m: Path) -> None:
    (m / "config.json").unlink()


def _config_not_json(m: Path) -> None:
    (m / "config.json").write_text("{not json")


def _config_without_hidden_size(m: Path) -> None:
    _edit_json(m / "config.json", lambda c: c.pop("hidden_size"))


def _index_names_missing_file(m: Path) -> None:
    n, h = _header(m / "model.safetensors")
    weight_map = {k: "model-00002-of-00002.safetensors" for k in h if k != "__metadata__"}
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _index_map_a_list(m: Path) -> None:
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))


def _empty_weights(m: Path) -> None:
    (m / "model.safetensors").write_bytes(b"")


def _header_not_json(m: Path) -> None:
    w = m / "model.safetensors"
    raw = bytearray(w.read_bytes())
    raw[8] = ord("#")
    w.write_bytes(bytes(raw))


def _unknown_dtype(m: Path) -> None:
    _rewrite_header(m / "model.safetensors", lambda h: _first_tensor(h).update(dtype="BX16"))


def _offsets_disagree(m: Path) -> None:
    def change(h):
        t = _first_tensor(h)
        t["shape"] = [t["shape"][0] // 2] + t["shape"][1:]
    _rewrite_header(m / "model.safetensors", change)


def _byte_after_header(m: Path) -> None:
    w = m / "model.safetensors"
    raw = w.read_bytes()
    w.write_bytes(raw[:8] + b"\t" + raw[8:])  # found by hypothesis: the header still parses


def _overlapping_tensors(m: Path) -> None:
    def change(h):
        names = [k for k in h if k != "__metadata__"]
        h[names[1]]["data_offsets"] = list(h[names[0]]["data_offsets"])
        h[names[1]]["shape"], h[names[1]]["dtype"] = h[names[0]]["shape"], h[names[0]]["dtype"]
    _rewrite_header(m / "model.safetensors", change)


def _model_is_a_file(m: Path) -> None:
    shutil.rmtree(m)
    m.write_text("not a model")


MODEL_CASES = {
    "model without config.json": (_no_config, "has no config.json"),
    "config.json not JSON": (_config_not_json, "is not valid JSON"),
    "config.json without hidden_size": (_config_without_hidden_size, "hidden_size"),
    "weight index names a missing file": (_index_names_missing_file, "missing weight files"),
    "weight index whose weight_map is a list": (_index_map_a_list, "is corrupt"),
    "empty weight file": (_empty_weights, "is truncated"),
    "weight header not JSON": (_header_not_json, "corrupt header"),
    "weight header with an unknown dtype": (_unknown_dtype, "unknown dtype 'BX16'"),
    "weight header whose offsets disagree with the shape": (_offsets_disagree, "bytes for shape"),
    "model path is a file": (_model_is_a_file, "does not exist"),
    "weight file with a byte inserted after its length prefix": (_byte_after_header, "weight file model.safetensors"),
    "weight header with two tensors on the same bytes": (_overlapping_tensors, "overlaps"),
}


@pytest.mark.parametrize("name", list(MODEL_CASES))
def test_a_broken_model_is_refused_before_any_weight_is_loaded(tiny_llama, rows, tmp_path, case, name):
    change, message = MODEL_CASES[name]
    model = _model_copy(tiny_llama, tmp_path / "model", change)
    out = tmp_path / "out"
    o = run_cli("extract", "--model", model, "--dataset", rows, "--out", out, "--engine", "hf")
    assert_refused(o, code=EXIT_BAD_INPUT, message=message)
    assert not out.exists()
    _record(case, "extract", name, "refused before loading, exit 2, file named")


DATASET_CASES = {
    "no row has an assistant turn": ([{"messages": [{"role": "user", "content": "hi"}]},
                                      {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]}],
                                     "no row has a target token"),
    "every row empty": ([{"messages": []}, {"input_ids": []}], "no row has a target token"),
    "every loss mask zero": ([{"input_ids": [5, 6], "loss_mask": [0, 0]}], "no row has a target token"),
}


@pytest.mark.parametrize("name", list(DATASET_CASES))
def test_a_dataset_with_nothing_to_extract_is_refused(tiny_llama, tmp_path, case, name):
    """Regression: such a dataset used to give a 'complete' dataset of 0 samples (after starting
    the engine)."""
    content, message = DATASET_CASES[name]
    data = write_jsonl(tmp_path / "rows.jsonl", content)
    out = tmp_path / "out"
    o = run_cli("extract", "--model", tiny_llama, "--dataset", data, "--out", out, "--engine", "hf")
    assert_refused(o, code=EXIT_BAD_INPUT, message=message)
    assert not out.exists()
    _record(case, "extract", name, "refused, exit 2 (was: a 0-sample dataset, exit 0)")


@pytest.mark.parametrize("role", [[], {}, 5, None])
def test_a_chat_role_that_is_not_a_string_is_refused(tiny_llama, tmp_path, case, role):
    """Regression (found by hypothesis): a list or object as a role ended in 'unhashable type'."""
    data = write_jsonl(tmp_path / "rows.jsonl", [GOOD_ROWS[0], {"messages": [{"role": role, "content": "x"}]}])
    out = tmp_path / "out"
    o = run_cli("extract", "--model", tiny_llama, "--dataset", data, "--out", out, "--engine", "hf")
    assert_refused(o, code=EXIT_BAD_INPUT, message=f"{data}:2: message 0 has unknown role")
    assert not out.exists()
    _record(case, "extract", f"chat role {json.dumps(role)}", "refused naming line 2 (was: TypeError traceback for "
            "a list or object)")


def test_an_output_path_that_is_a_file_is_refused(tiny_llama, rows, tmp_path, case):
    """Regression: this used to end in a FileExistsError traceback."""
    out = tmp_path / "out"
    out.write_text("mine")
    o = run_cli("extract", "--model", tiny_llama, "--dataset", rows, "--out", out, "--engine", "hf")
    assert_refused(o, code=EXIT_BAD_INPUT, message="exists and is not a directory")
    assert out.read_text() == "mine"
    _record(case, "extract", "--out is an existing file", "refused, exit 2 (was: FileExistsError traceback)")


@pytest.mark.parametrize("name, argv, message", [
    ("dataset folder holds no data file", lambda t, r: ("--dataset", (t / "empty").mkdir() or t / "empty"),
     "holds no .jsonl, .json, .parquet or .arrow file"),
    ("dataset file missing", lambda t, r: ("--dataset", t / "nope.jsonl"), "does not exist"),
    ("--shards beyond the dataset", lambda t, r: ("--dataset", r, "--shards", "5:99"), "outside 0:1"),
    ("--shards not A:B", lambda t, r: ("--dataset", r, "--shards", "3"), "is not A:B"),
])
def test_bad_extract_arguments_are_refused(tiny_llama, rows, tmp_path, case, name, argv, message):
    out = tmp_path / "out"
    o = run_cli("extract", "--model", tiny_llama, "--out", out, "--engine", "hf", *argv(tmp_path, rows))
    assert_refused(o, code=EXIT_BAD_INPUT, message=message)
    assert not out.exists()
    _record(case, "extract", name, "refused, exit 2")


def test_an_enormous_row_is_truncated_and_recorded_not_refused(tiny_llama, tmp_path, case):
    """A 1-million-token row (7 MB of JSON) is cut to max_seq_len, and the manifest says so."""
    huge = {"input_ids": [7] * 1_000_000}
    data = write_jsonl(tmp_path / "rows.jsonl", [GOOD_ROWS[0], huge])
    out = tmp_path / "out"
    o = run_cli("extract", "--model", tiny_llama, "--dataset", data, "--out", out, "--engine", "hf",
                "--max-seq-len", "64")
    assert o.code == EXIT_OK, o.err
    m = json.loads((out / MANIFEST_NAME).read_text())
    assert m["truncated"] == [{"row": 1, "original_tokens": 1_000_000, "kept_tokens": 64}]
    assert m["totals"]["tokens"] == 4 + 64
    _record(case, "extract", "a 1,000,000-token row", "accepted: truncated to max_seq_len, recorded in the manifest")


@pytest.mark.slow
def test_a_dataset_changed_during_extraction_gets_no_manifest_and_the_rerun_redoes_only_its_shard(
        tiny_llama, tmp_path, case):
    """The shards hold the rows as read at the start; a dataset edited meanwhile is detected before
    the manifest (its sha256 is re-checked), the run fails naming it, and the re-run re-plans: the
    shards whose rows did not change are kept, the changed one is extracted again."""
    lengths = [5, 6, 7, 8, 9, 10]
    data = write_jsonl(tmp_path / "rows.jsonl", token_rows(lengths, seed=3))
    out = tmp_path / "out"
    args = ["extract", "--model", str(tiny_llama), "--dataset", str(data), "--out", str(out), "--engine", "hf",
            "--samples-per-shard", "2"]
    proc = subprocess.Popen(slow_datagen_cmd(1.5, *args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first = out / "shards" / "shard-000000.safetensors"
    deadline = time.monotonic() + 300
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert first.exists(), proc.communicate()[1][-3000:]
    changed = token_rows(lengths, seed=3)
    changed[5] = {"input_ids": [42] * 12}  # a row of the last shard
    write_jsonl(data, changed)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_BAD_INPUT, err[-3000:]
    assert "the dataset changed while it was extracted" in err and "\n  -> " in err and "Traceback" not in err
    assert not (out / MANIFEST_NAME).exists()

    again = run_cli(*args)  # in this process: the re-run's planning and resume, without a program's imports
    assert again.code == EXIT_OK, again.err[-3000:]
    result = next(json.loads(line[len("datagen-result: "):]) for line in reversed(again.out.splitlines())
                  if line.startswith("datagen-result: "))
    assert result["shards_cached"] == [0, 1] and result["shards_extracted"] == [2]
    m = json.loads((out / MANIFEST_NAME).read_text())
    assert m["spec"]["dataset"]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    _record(case, "extract", "dataset file edited while it is extracted",
            "refused before the manifest (exit 2); re-run kept 2 shards, redid the changed one")


def test_a_dataset_changed_while_it_is_read_gets_the_fingerprint_of_what_was_read(tiny_llama, tmp_path, monkeypatch,
                                                                                 case):
    """Regression: the fingerprint used to come from a second read of the file, so a change
    between the two reads gave the manifest the sha256 of content no shard was made from."""
    from datagen.data import planning

    data = write_jsonl(tmp_path / "rows.jsonl", GOOD_ROWS)
    original = data.read_bytes()
    scan = planning._scan  # the one read that hashes the file (the workers then read its ranges)

    def read_then_change(path, *args):
        out = scan(path, *args)
        write_jsonl(data, GOOD_ROWS + [{"input_ids": [1, 2, 3]}])
        return out

    monkeypatch.setattr(planning, "_scan", read_then_change)
    from datagen.data.planning import prepare_dataset

    prepared = prepare_dataset(data, load_tokenizer=lambda: None, vocab_size=512, max_seq_len=64)
    assert prepared.rows == 2
    assert prepared.fingerprint == hashlib.sha256(original).hexdigest()
    _record(case, "extract", "dataset file changed between its read and its hash",
            "the fingerprint is of the bytes parsed (was: of a second read)")


# --- the output directory after a crash -----------------------------------------------------------

def test_an_output_left_by_a_crash_during_its_claim_is_resumed(tiny_llama, rows, tmp_path, case):
    """Regression: a run killed after creating shards/ and .datagen/ but before writing run.json
    left an output that every later run refused as 'not empty and holds no datagen dataset'."""
    out = tmp_path / "out"
    (out / "shards").mkdir(parents=True)
    (out / ".datagen" / "shards").mkdir(parents=True)
    (out / ".datagen" / ".run.json.tmp-4242").write_text("{")
    o = run_cli("extract", "--model", tiny_llama, "--dataset", rows, "--out", out, "--engine", "hf")
    assert o.code == EXIT_OK, o.err
    assert (out / MANIFEST_NAME).exists() and not list(out.rglob(".*.tmp-*"))
    case.category = "crash"
    case.case = "killed between creating the output's directories and recording its claim"
    case.attempts = 1
    case.outcome = "resumed (was: refused as a foreign directory forever)"
    case.data_lost = "0"


def test_a_foreign_file_in_shards_still_makes_the_output_foreign(tiny_llama, rows, tmp_path, case):
    out = tmp_path / "out"
    (out / "shards").mkdir(parents=True)
    (out / "shards" / "notes.txt").write_text("mine")
    o = run_cli("extract", "--model", tiny_llama, "--dataset", rows, "--out", out, "--engine", "hf")
    assert_refused(o, code=EXIT_BAD_INPUT, message="not empty")
    assert tree(out) == ["shards", "shards/notes.txt"]
    _record(case, "extract", "an --out holding someone else's files under shards/", "refused, exit 2, untouched")


def test_a_claimed_output_without_shards_can_be_taken_over_by_a_fixed_spec(tiny_llama, rows, tmp_path, case):
    """Regression: a run that failed before its first shard (a corrupt model, say) left its claim,
    and the run with the repaired model (another content hash) was refused: 'holds a dataset of
    another spec', although that dataset held nothing."""
    out = tmp_path / "out"
    (out / ".datagen").mkdir(parents=True)
    (out / "shards").mkdir()
    (out / ".datagen" / "run.json").write_text(json.dumps({"extraction_fingerprint": "0" * 64, "spec": {}}))
    o = run_cli("extract", "--model", tiny_llama, "--dataset", rows, "--out", out, "--engine", "hf")
    assert o.code == EXIT_OK, o.err
    _record(case, "extract", "an output claimed by a run that wrote no shard, re-run with a repaired model",
            "accepted (was: refused as another spec's dataset)")


def test_an_unreadable_claim_record_is_treated_as_another_specs(tiny_llama, rows, tmp_path, case):
    """Regression: a corrupt .datagen/run.json ended in a JSONDecodeError traceback. It is now another
    spec's claim: taken over when the output holds no shard, refused when it does."""
    out = tmp_path / "out"
    (out / ".datagen").mkdir(parents=True)
    (out / ".datagen" / "run.json").write_text("{not json")
    args = ("extract", "--model", tiny_llama, "--dataset", rows, "--out", out, "--engine", "hf")
    assert run_cli(*args).code == EXIT_OK
    (out / MANIFEST_NAME).unlink()
    (out / ".datagen" / "run.json").write_text("{not json")
    assert_refused(run_cli(*args), code=EXIT_BAD_INPUT, message="holds a dataset of another spec")
    _record(case, "extract", "an output whose .datagen/run.json is not JSON",
            "no shards: taken over; with shards: refused, exit 2 (was: JSONDecodeError traceback)")


# --- extract: every refusal leaves the output location as it was found ----------------------------
# Each exit-2 and exit-3 path of `datagen extract`, into each state an output location can be in
# before a run. The refusals at engine start come after the output was checked: they must leave
# no claim, no directory and no lock behind, and a later run with other arguments must be able to
# use the location.

class _RefusingEngine:
    """A stand-in engine whose start() raises a given refusal: the clean-up is under test here, not
    the engine (the real refusals at start are the cases that follow it in OUTPUT_REFUSALS)."""

    name = "refusing"

    def __init__(self, error: Exception):
        self.error = error

    def start(self) -> None:
        raise self.error

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _prior_absent(out: Path) -> None:
    """Nothing there: the output and its parent are created by the run."""


def _prior_empty(out: Path) -> None:
    out.mkdir(parents=True)


def _prior_claimed_without_shards(out: Path) -> None:
    """A claim of another spec that wrote no shard (a run refused by an older datagen)."""
    (out / ".datagen" / "shards").mkdir(parents=True)
    (out / "shards").mkdir()
    (out / ".datagen" / "run.json").write_text(json.dumps({"extraction_fingerprint": "0" * 64, "spec": {}}))


PRIOR_STATES = {"absent": _prior_absent, "empty": _prior_empty, "claimed without shards": _prior_claimed_without_shards}


def _amx_here() -> bool:
    from datagen.engines.vllm_attention import cpu_has_amx

    return cpu_has_amx()


@dataclass(frozen=True)
class Refusal:
    args: tuple = ()  # extra `datagen extract` arguments
    engine: dict = field(default_factory=lambda: {"name": "hf"})  # the spec file's engine block
    code: int = EXIT_BAD_INPUT
    message: str = ""
    deepseek: bool = False  # the tiny DeepSeek-V3 (MLA) instead of the tiny Llama
    row: dict | None = None  # a second dataset row, after a good one
    change: str | None = None  # what _apply patches in


VLLM = {"name": "vllm"}
OUTPUT_REFUSALS = {
    "invalid spec field": Refusal(("--samples-per-shard", "0"), message="samples_per_shard"),
    "layer id beyond the model": Refusal(("--layers", "2,9"), message="layer"),
    "max_seq_len beyond the model's positions": Refusal(("--max-seq-len", "100000"), message="does not fit"),
    "bad dataset row": Refusal(row={"input_ids": [1, "x"]}, message="list of integers"),
    "mla_backend for a model without MLA": Refusal(engine={**VLLM, "mla_backend": "CPU_MLA"},
                                                   message="has no MLA attention"),
    "AMX_MLA in float32": Refusal(engine={**VLLM, "mla_backend": "AMX_MLA", "dtype": "float32"}, deepseek=True,
                                  message="bfloat16 only"),
    "no row with a target token": Refusal(row={"input_ids": [5, 6], "loss_mask": [0, 0]}, change="no_target",
                                          message="no row has a target token"),
    "--shards beyond the dataset": Refusal(("--shards", "3:5"), message="is outside 0:1"),
    "vLLM not installed (exit 3)": Refusal(engine=VLLM, change="no_vllm", code=EXIT_CANNOT_RUN_HERE,
                                           message="vLLM is not installed"),
    "vLLM outside the tested range (exit 3)": Refusal(engine=VLLM, change="vllm_0.99", code=EXIT_CANNOT_RUN_HERE,
                                                      message="outside the tested range"),
    "engine start: tensor parallel 3 on a CPU (exit 3)": Refusal(engine={**VLLM, "tensor_parallel_size": 3},
                                                                 code=EXIT_CANNOT_RUN_HERE, message="on the CPU engine"),
    "engine start: AMX_MLA on a CPU without AMX (exit 3)": Refusal(engine={**VLLM, "mla_backend": "AMX_MLA"},
                                                                   deepseek=True, change="no_amx",
                                                                   code=EXIT_CANNOT_RUN_HERE,
                                                                   message="needs a CPU with AMX"),
    "engine start: any exit-3 refusal": Refusal(engine=VLLM, change="refuse_3", code=EXIT_CANNOT_RUN_HERE,
                                                message="a refusal at start"),
    "engine start: any exit-2 refusal": Refusal(engine=VLLM, change="refuse_2", message="a refusal at start"),
}


def _apply(monkeypatch, change: str | None) -> None:
    from datagen.engines import patches
    from datagen.errors import EngineUnsupportedError, ModelError
    from datagen.extraction import run as extract

    if change == "vllm_0.99":
        monkeypatch.setattr(patches, "installed_vllm_version", lambda: "0.99.0")
    elif change == "no_vllm":
        monkeypatch.setattr(patches, "installed_vllm_version", lambda: None)
    elif change == "no_amx" and _amx_here():
        pytest.skip("this CPU has AMX: AMX_MLA runs here (tests/test_extract_vllm.py runs it)")
    elif change == "refuse_3":
        error = EngineUnsupportedError("a refusal at start (stand-in)", hint="nothing to do: a test")
        monkeypatch.setattr(extract, "make_engine", lambda p: _RefusingEngine(error))
    elif change == "refuse_2":
        error = ModelError("a refusal at start (stand-in)", hint="nothing to do: a test")
        monkeypatch.setattr(extract, "make_engine", lambda p: _RefusingEngine(error))


def _refused_run(r: Refusal, *, llama: Path, deepseek: Path, rows: Path, out: Path, tmp_path: Path):
    if r.row is not None:  # after a good row, or alone where the case is a dataset without targets
        rows = write_jsonl(tmp_path / "bad.jsonl", [r.row] if r.change == "no_target" else [GOOD_ROWS[0], r.row])
    spec = tmp_path / "engine.json"
    spec.write_text(json.dumps({"engine": r.engine}))
    return run_cli("extract", "--spec", spec, "--model", deepseek if r.deepseek else llama, "--dataset", rows,
                   "--out", out, *r.args)


@pytest.mark.engine
def test_a_setting_vllm_refuses_is_named_with_vllms_reason(tiny_llama, rows, tmp_path, monkeypatch, case):
    """vLLM's own refusal of a setting (Model Runner V2 on the CPU engine, which has no Triton) names
    the setting and vLLM's reason, not the model, and leaves the output location as found."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU the capture refuses Model Runner V2 itself, before vLLM does")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    out = tmp_path / "place" / "out"
    r = Refusal(engine=VLLM)
    o = _refused_run(r, llama=tiny_llama, deepseek=tiny_llama, rows=rows, out=out, tmp_path=tmp_path)
    assert_refused(o, code=EXIT_BAD_INPUT, message="refuses the setting VLLM_USE_V2_MODEL_RUNNER=1")
    assert "Triton" in o.err and "cannot load" not in o.err, o.err[-2000:]
    assert not (tmp_path / "place").exists()
    _record(case, "extract", "a VLLM_* setting vLLM refuses (Model Runner V2 on the CPU engine)",
            "refused, exit 2, the setting and vLLM's reason named, nothing written")


@pytest.mark.parametrize("prior", list(PRIOR_STATES))
@pytest.mark.parametrize("name", list(OUTPUT_REFUSALS))
def test_a_refused_extract_leaves_the_output_location_as_found(tiny_llama, tiny_deepseek, rows, tmp_path, monkeypatch,
                                                               case, name, prior):
    r = OUTPUT_REFUSALS[name]
    _apply(monkeypatch, r.change)
    parent = tmp_path / "place"
    out = parent / "out"
    PRIOR_STATES[prior](out)
    before = tree(tmp_path / "place")
    o = _refused_run(r, llama=tiny_llama, deepseek=tiny_deepseek, rows=rows, out=out, tmp_path=tmp_path)
    assert_refused(o, code=r.code, message=r.message)
    assert tree(tmp_path / "place") == before, f"left behind: {sorted(set(tree(tmp_path / 'place')) - set(before))}"
    assert parent.exists() == (prior != "absent")
    if prior == "claimed without shards":
        assert json.loads((out / ".datagen" / "run.json").read_text())["extraction_fingerprint"] == "0" * 64
    _record(case, "extract", f"{name}, into an output that is {prior}",
            f"refused, exit {r.code}, the output location as found")


@pytest.mark.parametrize("name", [n for n in OUTPUT_REFUSALS if n.startswith("engine start")])
def test_after_a_refusal_at_engine_start_another_run_may_use_the_output(tiny_llama, tiny_deepseek, rows, tmp_path,
                                                                        monkeypatch, case, name):
    """Regression: a refusal at engine start (vLLM 0.24.0's layer-id refusal, exit 3) left
    .datagen/run.json, .datagen/shards/ and shards/ in the output."""
    r = OUTPUT_REFUSALS[name]
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        _apply(m, r.change)
        o = _refused_run(r, llama=tiny_llama, deepseek=tiny_deepseek, rows=rows, out=out, tmp_path=tmp_path)
        assert_refused(o, code=r.code, message=r.message)
    assert not out.exists() and not list(tmp_path.glob(".out.lock"))
    o = run_cli("extract", "--model", tiny_llama, "--dataset", rows, "--out", out, "--engine", "hf", "--layers", "1,2")
    assert o.code == EXIT_OK, o.err
    _record(case, "extract", f"{name}, then a run with other arguments into the same --out",
            "refused leaving nothing (was: a claim left behind); the next run succeeds")


def test_a_refusal_at_engine_start_keeps_a_finished_dataset_of_fewer_rows(tiny_llama, tmp_path, monkeypatch, case):
    """The manifest of a dataset the run would extend is dropped only once the engine runs: a
    refusal before keeps the finished dataset as it was."""
    data = write_jsonl(tmp_path / "rows.jsonl", token_rows([5, 6, 7], seed=2))
    out = tmp_path / "out"
    args = ("extract", "--model", tiny_llama, "--dataset", data, "--out", out, "--engine", "hf",
            "--samples-per-shard", "2")
    assert run_cli(*args).code == EXIT_OK
    write_jsonl(data, token_rows([5, 6, 7, 8], seed=2))  # one more row: shard 1 changes
    before = {str(f.relative_to(out)): f.read_bytes() for f in out.rglob("*") if f.is_file()}
    with monkeypatch.context() as m:
        _apply(m, "refuse_3")
        assert_refused(run_cli(*args), code=EXIT_CANNOT_RUN_HERE)
    assert {str(f.relative_to(out)): f.read_bytes() for f in out.rglob("*") if f.is_file()} == before
    assert run_cli(*args).code == EXIT_OK
    _record(case, "extract", "refused at engine start over a finished dataset of fewer rows",
            "refused, exit 3; manifest, shards and records untouched")


# --- validate ---------------------------------------------------------------------------------------

def _manifest_format_99(ds: Path) -> None:
    _edit_json(ds / MANIFEST_NAME, lambda m: m.update(format_version=99))


def _manifest_a_list(ds: Path) -> None:
    (ds / MANIFEST_NAME).write_text("[]")


def _manifest_empty(ds: Path) -> None:
    (ds / MANIFEST_NAME).write_text("")


VALIDATE_CASES = {
    "manifest of a future format version": (_manifest_format_99, (), EXIT_VALIDATION, "format version 99"),
    "manifest.json is a JSON list": (_manifest_a_list, (), EXIT_VALIDATION, "does not match the contract"),
    "manifest.json is empty": (_manifest_empty, (), EXIT_VALIDATION, "does not match the contract"),
    "--previous names no dataset": (lambda ds: None, ("--previous", "/nonexistent/previous"), EXIT_VALIDATION,
                                    "previous"),
    "--golden -1": (lambda ds: None, ("--golden", "-1"), EXIT_BAD_INPUT, "--golden"),
    "--workers 0": (lambda ds: None, ("--workers", "0"), EXIT_BAD_INPUT, "--workers"),
}


@pytest.mark.parametrize("name", list(VALIDATE_CASES))
def test_bad_validate_inputs_are_refused_and_approve_nothing(dataset, case, name):
    change, extra, code, message = VALIDATE_CASES[name]
    change(dataset)
    o = run_cli("validate", dataset, "--golden", "0", *extra) if "--golden" not in extra else \
        run_cli("validate", dataset, *extra)
    assert_refused(o, code=code, message=message)
    assert not (dataset / ".datagen" / "validation.json").exists()
    _record(case, "validate", name, f"refused, exit {code}, no approval written")


@pytest.mark.parametrize("name, path", [("dataset directory missing", "nope"), ("dataset is a file", "file")])
def test_validate_of_something_not_a_dataset_is_refused(tmp_path, case, name, path):
    (tmp_path / "file").write_text("x")
    assert_refused(run_cli("validate", tmp_path / path), code=EXIT_BAD_INPUT, message="is not a directory")
    _record(case, "validate", name, "refused, exit 2")


# --- publish ------------------------------------------------------------------------------------------

def _validated(ds: Path, **overrides) -> None:
    sha = hashlib.sha256((ds / MANIFEST_NAME).read_bytes()).hexdigest()
    (ds / ".datagen" / "validation.json").write_text(json.dumps({"ok": True, "manifest_sha256": sha, **overrides}))


PUBLISH_CASES = {
    "destination not s3://": (lambda ds: _validated(ds), "http://bucket/x", EXIT_BAD_INPUT, "not an S3 URI"),
    "bucket name not DNS-valid": (lambda ds: _validated(ds), "s3://Bad_Bucket/x", EXIT_BAD_INPUT, "bucket name"),
    "prefix with ..": (lambda ds: _validated(ds), "s3://bucket/a/../b", EXIT_BAD_INPUT, "'..'"),
    "no manifest": (lambda ds: (ds / MANIFEST_NAME).unlink(), "s3://bucket/x", EXIT_VALIDATION, "no manifest.json"),
    "never validated": (lambda ds: None, "s3://bucket/x", EXIT_VALIDATION, "has not been validated"),
    "validation record not JSON": (lambda ds: (ds / ".datagen" / "validation.json").write_text("{"), "s3://bucket/x",
                                   EXIT_VALIDATION, "not valid JSON"),
    "validation failed": (lambda ds: _validated(ds, ok=False), "s3://bucket/x", EXIT_VALIDATION, "failed validation"),
    "validation approved another manifest": (lambda ds: _validated(ds, manifest_sha256="0" * 64), "s3://bucket/x",
                                             EXIT_VALIDATION, "changed after it was validated"),
}


@pytest.mark.parametrize("name", list(PUBLISH_CASES))
def test_bad_publish_inputs_are_refused_before_anything_is_uploaded(dataset, case, name):
    """Every refusal comes before an S3 client exists: no server is needed, nothing can be sent."""
    change, dest, code, message = PUBLISH_CASES[name]
    change(dataset)
    assert_refused(run_cli("publish", dataset, f"--to={dest}"), code=code, message=message)
    _record(case, "publish", name, f"refused, exit {code}, before any upload")


# --- download and env-check spec files ------------------------------------------------------------------

def _sources(tiny_llama: Path, tmp_path: Path, **changes) -> dict:
    return {"model": str(tiny_llama), "out": str(tmp_path / "out"), "model_cache": str(tmp_path / "cache"), **changes}


SOURCES_CASES = {
    "spec file missing": (None, "does not exist"),
    "spec file not JSON": ("{", "not valid JSON"),
    "spec file a JSON list": ("[1]", "must hold a JSON object"),
    "unknown field": ({"revison": "main"}, "revison"),
    "model with an unknown scheme": ({"model": "ftp://host/model"}, "unknown scheme"),
    "malformed Hub reference": ({"model": "hf://not a repo"}, "is not a Hub reference"),
    "S3 bucket not DNS-valid": ({"model": "s3://UPPER/model"}, "bucket name"),
    "output with an unknown scheme": ({"out": "gs://bucket/x"}, "unknown scheme"),
    "tensor_parallel_size a word": ({"engine": {"tensor_parallel_size": "eight"}}, "tensor_parallel_size"),
    "layer_ids unsorted": ({"layer_ids": [3, 2]}, "sorted"),
    "expected_tokens 0": ({"expected_tokens": 0}, "expected_tokens"),
}


@pytest.mark.parametrize("step", ["download", "env-check"])
@pytest.mark.parametrize("name", list(SOURCES_CASES))
def test_a_bad_sources_spec_is_refused_by_download_and_env_check(tiny_llama, tmp_path, case, step, name):
    content, message = SOURCES_CASES[name]
    spec = tmp_path / "spec.json"
    if content is not None:
        spec.write_text(content if isinstance(content, str) else json.dumps(_sources(tiny_llama, tmp_path, **content)))
    assert_refused(run_cli(step, "--spec", spec), code=EXIT_BAD_INPUT, message=message)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()
    _record(case, step, name, "refused, exit 2, nothing fetched or written")


# --- export ---------------------------------------------------------------------------------------------

def test_export_into_a_foreign_directory_is_refused(dataset, tmp_path, case):
    out = tmp_path / "export"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert_refused(run_cli("export", "--format", "speculators", dataset, out), code=EXIT_BAD_INPUT,
                   message="exists and is not an export")
    assert tree(out) == ["notes.txt"]
    _record(case, "export", "output directory holding other files", "refused, exit 2, untouched")


def test_export_of_a_manifest_without_a_spec_is_refused(dataset, tmp_path, case):
    _edit_json(dataset / MANIFEST_NAME, lambda m: m.update(spec={}))
    o = run_cli("export", "--format", "speculators", dataset, tmp_path / "export")
    _record(case, "export", "manifest whose spec lacks layer_ids",
            "refused, exit 2 (was: KeyError traceback, exit 1)" if o.code == EXIT_BAD_INPUT else
            f"exit {o.code}, {o.err.strip().splitlines()[-1]}")
    assert_refused(o, code=EXIT_BAD_INPUT, message="manifest")
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("step", ["export", "train"])
def test_a_manifest_changed_after_its_validation_is_refused_by_export_and_train(dataset, tmp_path, case, step):
    """The validation record binds the bytes it approved: one byte of the manifest changed after it
    (a digit of a statistic, which still parses) and export and train refuse it, writing nothing."""
    assert run_cli("validate", dataset, "--golden", "0").code == 0
    raw = (dataset / MANIFEST_NAME).read_bytes()
    at = raw.index(b'"sumsq": ') + len(b'"sumsq": ')
    (dataset / MANIFEST_NAME).write_bytes(raw[:at] + (b"2" if raw[at:at + 1] != b"2" else b"3") + raw[at + 1:])
    out = tmp_path / "out"
    argv = (("export", "--format", "speculators", dataset, out) if step == "export" else
            ("train", dataset, "--out", out, "--steps", "0"))
    assert_refused(run_cli(*argv), code=EXIT_VALIDATION, message="changed after it was validated")
    assert not out.exists()
    _record(case, step, "manifest changed after it was validated", "refused, exit 4, nothing written")


# --- the flow's parameter (the pipeline spec the Prefect UI validates) --------------------------------------

PIPELINE_CASES = {
    "remote dataset": ({"dataset": "s3://bucket/rows.jsonl"}, "not a local file"),
    "remote output": ({"output": "s3://bucket/out"}, "not a local directory"),
    "publish_to not s3://": ({"publish_to": "/mnt/out"}, "publish_to"),
    "shards_per_task 0": ({"shards_per_task": 0}, "shards_per_task"),
    "unknown device": ({"device": "tpu"}, "device"),
    "unknown field": ({"gpus": 8}, "gpus"),
}


@pytest.mark.parametrize("name", list(PIPELINE_CASES))
def test_a_bad_pipeline_spec_is_refused_naming_the_field(tiny_llama, rows, tmp_path, case, name):
    from tasks.pipeline_spec import parse_pipeline_spec

    changes, message = PIPELINE_CASES[name]
    raw = {"model": str(tiny_llama), "dataset": str(rows), "output": str(tmp_path / "out"), **changes}
    with pytest.raises(SpecError) as e:
        parse_pipeline_spec(raw)
    assert message in str(e.value) and e.value.hint
    _record(case, "flow parameter", name, "refused by the spec's validation (SpecError with a hint)")


# --- regeneration's prompts (the chat template, rendered after the engine started) ---------------------------

def test_regeneration_renders_an_opening_assistant_turn_and_names_the_row_a_template_cannot_render(tmp_path, case):
    """A chat that opens with the assistant is generated from the render of an empty conversation,
    as extraction masks it; a template that cannot render a prompt refuses that row by its line
    (a DatasetError: exit 2 with a hint), never a traceback from transformers."""
    from datagen.errors import DatasetError
    from datagen.testmodels.tiny import make_tokenizer
    from datagen.regeneration.rounds import ChunkRunner
    from datagen.regeneration.settings import RegenerationSettings

    tok = make_tokenizer(tmp_path / "tok")
    runner = ChunkRunner(RegenerationSettings(), tok, None, None, window=4096, source="chats.jsonl")
    chat = [{"role": "assistant", "content": "welcome"}, {"role": "user", "content": "q"}]
    prepared = runner.prepare([(6, b"", chat, None)])
    assert prepared.first_ids == [tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]]

    tok.chat_template = "{% if messages[0]['role'] == 'user' %}U{% endif %}{{ messages[-1]['content'] }}"
    with pytest.raises(DatasetError, match="chat template cannot render") as e:
        runner.prepare([(6, b"", chat, None)])
    assert "chats.jsonl:7" in str(e.value) and e.value.hint and e.value.exit_code == EXIT_BAD_INPUT
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(DatasetError, match="renders nothing before assistant message 0"):
        runner.prepare([(6, b"", chat, None)])
    _record(case, "regenerate", "a chat opening with the assistant; a template that cannot render its prompt",
            "generated from the render of nothing; else refused naming the row, exit 2")
