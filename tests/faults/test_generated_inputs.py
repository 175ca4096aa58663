"""Bad inputs, generated: random JSON in every field of a row, random byte corruption and truncation
of a JSONL file, random layer lists, random spec files, random corruption of manifest.json and of a
model's safetensors header.

Each property: an input is accepted exactly when it is valid (an oracle written from the contract,
not from the code), and when it is refused, the step exits with its code, names the problem (the
line, the field), says what to do (``  -> ``), shows no traceback and writes nothing. Hypothesis is
derandomized (every run draws the same inputs) unless ``DATAGEN_FAULTS_SEED`` names another draw;
``DATAGEN_FAULTS_EXAMPLES_SCALE=N`` draws N times the examples.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st

from datagen.data.contract import MANIFEST_NAME
from datagen.data.row_checks import ROLES
from datagen.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_VALIDATION
from tests.builders import write_jsonl
from tests.faults._refusal import assert_refused, run_cli, tree
from tests.faults.conftest import examples_scale, faults_seed, full_campaign
from tests.support.extracted import extracted_dataset

VOCAB = 512  # the tiny Llama's vocabulary
MAX_SEQ_LEN = 64
# DATAGEN_FAULTS_EXAMPLES_SCALE multiplies every count here (a campaign that looks further)
EXAMPLES = (150 if full_campaign() else 40) * examples_scale()
SEED = faults_seed()  # DATAGEN_FAULTS_SEED: another draw; unset: derandomized, every run the same inputs
FAST = settings(max_examples=EXAMPLES, deadline=None, derandomize=SEED is None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
GOOD_ROW = {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}


def drawn(test):
    """The examples of DATAGEN_FAULTS_SEED's draw (outermost decorator of each property)."""
    return seed(SEED)(test) if SEED is not None else test
ABSENT = object()


# --- oracles: what the contract (README, datagen.data.dataset's docstring) says is a valid row ---------

def _ints(v) -> bool:
    return isinstance(v, list) and all(type(t) is int for t in v)


def tokens_row_valid(row: dict) -> bool:
    ids, mask = row.get("input_ids"), row.get("loss_mask")
    if set(row) - {"input_ids", "loss_mask"} or not _ints(ids) or not all(0 <= t < VOCAB for t in ids):
        return False
    return mask is None or (_ints(mask) and all(m in (0, 1) for m in mask) and len(mask) == len(ids))


def chat_row_valid(row: dict) -> bool:
    from datagen.data.row_formats import METADATA_FIELDS

    msgs = row.get("messages")
    if set(row) - METADATA_FIELDS != {"messages"} or not isinstance(msgs, list):
        return False
    # a message as the rows are read (datagen.data.row_formats): null fields absent, a null content empty
    msgs = [{**{k: v for k, v in m.items() if v is not None or k == "role"},
             **({"content": ""} if "content" in m and m["content"] is None else {})} if isinstance(m, dict) else m
            for m in msgs]
    # (no generated assistant turn calls a tool, so a tool turn has no call to answer)
    return all(isinstance(m, dict) and set(m) == {"role", "content"} and isinstance(m["role"], str)
               and m["role"] in ROLES and m["role"] != "tool" and isinstance(m["content"], str) for m in msgs)


# --- strategies --------------------------------------------------------------------------------

@st.composite
def token_rows(draw) -> dict:
    ids = draw(st.one_of(json_values, st.lists(st.integers(-3, VOCAB + 5), max_size=12),
                         st.lists(st.integers(3, 300), min_size=1, max_size=12)))
    choice = draw(st.sampled_from(["absent", "null", "aligned", "ints", "json"]))
    row = {"input_ids": ids}
    if choice == "null":
        row["loss_mask"] = None
    elif choice == "aligned" and isinstance(ids, list):
        row["loss_mask"] = draw(st.lists(st.integers(0, 1), min_size=len(ids), max_size=len(ids)))
    elif choice == "ints":
        row["loss_mask"] = draw(st.lists(st.integers(-1, 2), max_size=12))
    elif choice == "json":
        row["loss_mask"] = draw(json_values)
    if draw(st.integers(0, 9)) == 0:
        row[draw(st.text(min_size=1, max_size=6))] = draw(json_values)
    return row


roles = st.one_of(st.sampled_from(sorted(ROLES)), st.sampled_from(["wizard", "Assistant", "", "model"]), json_values)
messages = st.one_of(
    json_values,
    st.fixed_dictionaries({"role": roles, "content": st.one_of(st.text(max_size=20), json_values)}),
    st.fixed_dictionaries({"role": roles, "content": st.text(max_size=5)},
                          optional={"name": json_values, "contents": json_values}),
    st.fixed_dictionaries({"role": roles}),
)


@st.composite
def chat_rows(draw) -> dict:
    row = {"messages": draw(st.one_of(json_values, st.lists(messages, max_size=4)))}
    if draw(st.integers(0, 9)) == 0:
        row[draw(st.text(min_size=1, max_size=6))] = draw(json_values)
    return row


# --- helpers -------------------------------------------------------------------------------------

def _plan(model: Path, data: Path, out: Path, *extra: str):
    return run_cli("plan", "--model", model, "--dataset", data, "--out", out, "--engine", "hf",
                   "--max-seq-len", str(MAX_SEQ_LEN), *extra)


def _refused_everywhere(model: Path, data: Path, out: Path, *, line: int | None = None, lines=None):
    """`datagen plan` and `datagen extract` both refuse the input, clearly, writing nothing."""
    o = _plan(model, data, out)
    assert_refused(o, code=EXIT_BAD_INPUT)
    if lines is not None:
        assert o.line in lines, f"names line {o.line}, expected one of {lines}:\n{o.err}"
    x = run_cli("extract", "--model", model, "--dataset", data, "--out", out, "--engine", "hf",
                "--max-seq-len", str(MAX_SEQ_LEN))
    assert_refused(x, code=EXIT_BAD_INPUT)
    assert not out.exists(), f"a refused run left {tree(out)}"
    return o


def _record(case, name: str, counts: Counter, *, what: str) -> None:
    case.category = "bad-input"
    case.case = name
    case.attempts = sum(counts.values())
    case.outcome = what + ": " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    case.details["counts"] = dict(counts)
    case.details["group"] = "generated"


# --- dataset rows --------------------------------------------------------------------------------

def test_random_values_in_pre_tokenized_rows_are_accepted_exactly_when_valid(tiny_llama, tmp_path, case):
    counts: Counter = Counter()

    @drawn
    @FAST
    @given(row=token_rows())
    def check(row):
        data = write_jsonl(tmp_path / "rows.jsonl", [GOOD_ROW, row])
        out = tmp_path / "out"
        if tokens_row_valid(row):
            o = _plan(tiny_llama, data, out)
            assert o.code == EXIT_OK, f"a valid row was refused: {row}\n{o.err}"
            counts["valid, accepted"] += 1
        else:
            _refused_everywhere(tiny_llama, data, out, lines={2})
            counts["invalid, refused naming line 2"] += 1

    check()
    _record(case, "random JSON values in input_ids / loss_mask / extra fields (hypothesis)", counts,
            what="plan and extract agree with the contract")


def test_random_chat_rows_are_accepted_exactly_when_valid(tiny_llama, tmp_path, case):
    counts: Counter = Counter()

    @drawn
    @FAST
    @given(row=chat_rows())
    # a chat that opens with the assistant: its prompt is the render of an empty conversation
    @example(row={"messages": [{"role": "assistant", "content": "hello"}]})
    @example(row={"messages": [{"role": "assistant", "content": ""}]})
    @example(row={"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "q"}]})
    # found by 10x the examples: a message that is no object beside one whose content is a list of
    # parts (the row's image identity read it as one before the row was checked)
    @example(row={"messages": [None, {"role": "assistant", "content": []}], "0": None})
    def check(row):
        data = write_jsonl(tmp_path / "rows.jsonl", [GOOD_ROW, row])
        out = tmp_path / "out"
        if chat_row_valid(row):
            o = _plan(tiny_llama, data, out)
            # a structurally valid chat is only refused when the template cannot locate its turns
            if o.code != EXIT_OK:
                assert_refused(o, code=EXIT_BAD_INPUT, message="chat template")
                counts["valid, refused: template cannot locate turns"] += 1
            else:
                counts["valid, accepted"] += 1
        else:
            _refused_everywhere(tiny_llama, data, out, lines={2})
            counts["invalid, refused naming line 2"] += 1

    check()
    _record(case, "random chat rows: messages, roles, contents, extra keys (hypothesis)", counts,
            what="plan and extract agree with the contract")


BASE_ROWS = [
    {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 1]},
    {"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}]},
    {"input_ids": [11, 12, 13]},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why"},
                  {"role": "assistant", "content": "because"}]},
]


def _base_bytes() -> bytes:
    return "".join(json.dumps(r) + "\n" for r in BASE_ROWS).encode()


def _lines_valid(data: bytes) -> bool:
    """The contract, applied to raw bytes: UTF-8 JSON objects, one per line, each a valid row."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    lines = text.split("\n")
    if lines[-1] == "":
        lines = lines[:-1]
    if not lines:
        return False
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            return False
        if not isinstance(row, dict):
            return False
        if "messages" in row:
            if not chat_row_valid(row):
                return False
        elif "input_ids" in row:
            if not tokens_row_valid(row):
                return False
        else:
            return False
    return True


@st.composite
def corruptions(draw):
    base = _base_bytes()
    starts = [0] + [i + 1 for i, b in enumerate(base) if b == ord("\n")][:-1]
    line = draw(st.integers(0, len(BASE_ROWS) - 1))
    end = base.index(b"\n", starts[line])
    pos = draw(st.integers(starts[line], end))  # the line's bytes and its newline
    op = draw(st.sampled_from(["replace", "delete", "insert", "swap"]))
    byte = draw(st.integers(0, 255) | st.sampled_from(list(b'{}[]",:\n \\0a\xff\xc3')))
    b = bytearray(base)
    if op == "replace":
        b[pos] = byte
    elif op == "delete":
        del b[pos]
    elif op == "insert":
        b.insert(pos, byte)
    elif pos + 1 < len(b):
        b[pos], b[pos + 1] = b[pos + 1], b[pos]
    return line, bytes(b)


def test_random_byte_corruption_of_a_jsonl_line_is_refused_at_that_line(tiny_llama, tmp_path, case):
    counts: Counter = Counter()

    @drawn
    @FAST
    @given(c=corruptions())
    def check(c):
        line, data_bytes = c
        data = tmp_path / "rows.jsonl"
        data.write_bytes(data_bytes)
        out = tmp_path / "out"
        if _lines_valid(data_bytes):
            o = _plan(tiny_llama, data, out)
            if o.code != EXIT_OK:  # a changed chat can still defeat the template, clearly
                assert_refused(o, code=EXIT_BAD_INPUT, message="chat template")
            counts["still valid, accepted" if o.code == EXIT_OK else "still valid, template refused"] += 1
        else:
            # 1-based: the corrupted line, or the next one when a newline was inserted
            _refused_everywhere(tiny_llama, data, out, lines={line + 1, line + 2})
            counts["refused naming the corrupted line"] += 1

    check()
    _record(case, "random byte corruption of one JSONL line: replace, delete, insert, swap (hypothesis)", counts,
            what="refused at the corrupted line unless still valid")


def test_a_dataset_truncated_anywhere_is_refused_at_its_last_line(tiny_llama, tmp_path, case):
    base = _base_bytes()
    counts: Counter = Counter()

    @drawn
    @FAST
    @given(cut=st.integers(0, len(base) - 1))
    def check(cut):
        data = tmp_path / "rows.jsonl"
        data.write_bytes(base[:cut])
        out = tmp_path / "out"
        kept = base[:cut]
        if cut == 0:
            _refused_everywhere(tiny_llama, data, out)
            counts["empty, refused"] += 1
        elif kept.endswith(b"\n") or base[cut:cut + 1] == b"\n":
            assert _plan(tiny_llama, data, out).code == EXIT_OK
            counts["cut at a line end, accepted"] += 1
        else:
            _refused_everywhere(tiny_llama, data, out, lines={kept.count(b"\n") + 1})
            counts["cut inside a line, refused naming it"] += 1

    check()
    _record(case, "dataset file truncated at a random byte (hypothesis)", counts,
            what="refused at the cut line unless cut at a line end")


# --- layer ids and spec files ----------------------------------------------------------------------

def test_random_layer_lists_are_accepted_exactly_when_sorted_unique_and_in_range(tiny_llama, tmp_path, case):
    data = write_jsonl(tmp_path / "rows.jsonl", [GOOD_ROW])
    counts: Counter = Counter()

    @drawn
    @FAST
    @given(layers=st.lists(st.integers(-3, 9), max_size=6))
    def check(layers):
        valid = bool(layers) and layers == sorted(set(layers)) and all(0 <= i <= 6 for i in layers)
        arg = "--layers=" + ",".join(map(str, layers))
        o = _plan(tiny_llama, data, tmp_path / "out", arg)
        if valid:
            assert o.code == EXIT_OK, o.err
            counts["valid, accepted"] += 1
        else:
            assert_refused(o, code=EXIT_BAD_INPUT, message="layer")
            counts["invalid, refused"] += 1

    check()
    _record(case, "random layer id lists: empty, negative, duplicated, unsorted, beyond N (hypothesis)", counts,
            what="accepted exactly when sorted, unique and in [0, N]")


EXTRACT_FIELDS = {"model", "model_revision", "dataset", "out", "layer_ids", "max_seq_len", "samples_per_shard", "engine"}


@st.composite
def spec_mutations(draw, base: dict, fields: set[str]):
    spec = json.loads(json.dumps(base))
    op = draw(st.sampled_from(["unknown", "unknown-engine", "replace", "replace-engine", "delete"]))
    key = None
    if op == "unknown":
        key = draw(st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8).filter(lambda k: k not in fields))
        spec[key] = draw(json_values)
    elif op == "unknown-engine":
        key = draw(st.sampled_from(["gpus", "backend", "dtypes", "quantization"]))
        spec.setdefault("engine", {})[key] = draw(json_values)
    elif op == "replace":
        spec[draw(st.sampled_from(sorted(spec)))] = draw(json_values)
    elif op == "replace-engine":
        field = draw(st.sampled_from(["name", "dtype", "tensor_parallel_size", "max_num_batched_tokens",
                                      "trust_remote_code"]))
        spec.setdefault("engine", {})[field] = draw(json_values)
    else:
        del spec[draw(st.sampled_from(sorted(spec)))]
    return op, key, spec


def _spec_case(case, tmp_path, monkeypatch, base: dict, fields: set[str], argv, name: str, ok_codes: set[int]):
    monkeypatch.chdir(tmp_path)  # a random relative path stays inside the test's directory
    counts: Counter = Counter()

    @drawn
    @FAST
    @given(m=spec_mutations(base, fields))
    def check(m):
        op, key, spec = m
        f = tmp_path / "spec.json"
        f.write_text(json.dumps(spec))
        o = run_cli(*argv(f))
        if op.startswith("unknown"):
            assert_refused(o, code=EXIT_BAD_INPUT, message=key)
            counts["unknown field, refused naming it"] += 1
        elif o.code in ok_codes:
            counts["still valid, accepted"] += 1
        else:
            assert_refused(o, code=EXIT_BAD_INPUT)
            counts["refused"] += 1

    check()
    _record(case, name, counts, what="refused with the field named, or accepted when still valid")


def test_random_extract_spec_files_are_refused_naming_the_field(tiny_llama, tmp_path, monkeypatch, case):
    data = write_jsonl(tmp_path / "rows.jsonl", [GOOD_ROW])
    base = {"model": str(tiny_llama), "dataset": str(data), "out": str(tmp_path / "out"), "samples_per_shard": 4,
            "max_seq_len": MAX_SEQ_LEN, "engine": {"name": "hf"}}
    _spec_case(case, tmp_path, monkeypatch, base, EXTRACT_FIELDS, lambda f: ("plan", "--spec", f),
               "random extract spec files: unknown fields, wrong types, missing fields (hypothesis)", {EXIT_OK})


def test_random_download_spec_files_are_refused_naming_the_field(tiny_llama, tmp_path, monkeypatch, case):
    base = {"model": str(tiny_llama), "out": str(tmp_path / "out"), "engine": {"name": "hf"},
            "model_cache": str(tmp_path / "cache")}
    fields = {"model", "out", "engine", "layer_ids", "expected_tokens", "model_cache"}
    _spec_case(case, tmp_path, monkeypatch, base, fields, lambda f: ("download", "--spec", f),
               "random download spec files (hypothesis)", {EXIT_OK})


# --- manifest.json and model headers -----------------------------------------------------------------

# What validation cannot and need not bind (the oracle's harmless edits): when the manifest was
# written, and where the sources were then (they move: ``validate --model/--source``; what they hold
# is bound by spec.model.revision and spec.dataset.sha256, checked wherever they are read).
UNBOUND = {("created_at",), ("spec", "model", "source"), ("spec", "dataset", "source")}


def _equivalent(a, b, path: tuple = ()) -> bool:
    """Equal but for the UNBOUND fields and float digits within the validator's statistics tolerance."""
    if path in UNBOUND:
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equivalent(a[k], b[k], (*path, k)) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equivalent(x, y, path) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-4)
    return type(a) is type(b) and a == b


@st.composite
def byte_edits(draw, size: int, lo: int = 0):
    edits = draw(st.lists(st.tuples(st.integers(lo, size - 1), st.sampled_from(["replace", "delete", "insert"]),
                                    st.integers(0, 255)), min_size=1, max_size=3))
    return edits


def _apply(data: bytes, edits) -> bytes:
    b = bytearray(data)
    for pos, op, byte in edits:
        pos = min(pos, len(b) - 1)
        if op == "replace":
            b[pos] = byte
        elif op == "delete":
            del b[pos]
        else:
            b.insert(pos, byte)
    return bytes(b)


def test_random_corruption_of_manifest_json_fails_validation_and_export(tmp_path_factory, tmp_path, case):
    pristine = extracted_dataset(tmp_path_factory)
    raw = (pristine / MANIFEST_NAME).read_bytes()
    original = json.loads(raw)
    ds = tmp_path / "ds"
    shutil.copytree(pristine, ds)
    counts: Counter = Counter()

    @drawn
    @settings(FAST, max_examples=max(EXAMPLES // 3, 20))
    @given(edits=byte_edits(len(raw)))
    @example(edits=[(430, "delete", 0)])  # a digit of the first layer's sumsq in the dataset statistics
    def check(edits):
        bad = _apply(raw, edits)
        (ds / MANIFEST_NAME).write_bytes(bad)
        (ds / ".datagen" / "validation.json").unlink(missing_ok=True)
        o = run_cli("validate", ds, "--golden", "0")
        try:
            same = _equivalent(json.loads(bad), original)
        except ValueError:
            same = False
        if o.code == EXIT_OK:
            assert same, f"validation passed a changed manifest: {edits}"
            counts["harmless (whitespace, created_at, source locations, float digits within tolerance), passed"] += 1
        else:
            assert_refused(o, code=EXIT_VALIDATION)
            assert not (ds / ".datagen" / "validation.json").exists()
            counts["failed validation, no approval written"] += 1
        x = run_cli("export", "--format", "speculators", ds, tmp_path / "export")
        assert x.code != 1, f"export crashed on a corrupt manifest ({edits}):\n{x.err[-3000:]}"
        shutil.rmtree(tmp_path / "export", ignore_errors=True)

    check()
    _record(case, "random byte corruption of manifest.json, then validate and export (hypothesis)", counts,
            what="refused by validation, never approved")


def test_random_corruption_of_a_model_header_is_refused_before_loading(tiny_llama, tmp_path, case):
    from safetensors import safe_open

    weights = (Path(tiny_llama) / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", weights[:8])
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    data = write_jsonl(tmp_path / "rows.jsonl", [GOOD_ROW])
    counts: Counter = Counter()

    @drawn
    @FAST
    @given(edits=byte_edits(8 + n))
    def check(edits):
        (model / "model.safetensors").write_bytes(_apply(weights[:8 + n], edits) + weights[8 + n:])
        o = _plan(model, data, tmp_path / "out")
        if o.code == EXIT_OK:
            # accepted only if the header still parses: a changed tensor name or metadata, or an
            # edit in the padding (the download's checksums catch those)
            with safe_open(str(model / "model.safetensors"), "pt") as f:
                f.keys()
            counts["header still well-formed, accepted"] += 1
        else:
            assert_refused(o, code=EXIT_BAD_INPUT, message="model.safetensors")
            counts["refused naming the weight file"] += 1

    check()
    _record(case, "random byte corruption of a model's safetensors header (hypothesis)", counts,
            what="refused before any weight is loaded unless the header is still well-formed")


def test_random_publish_destinations_are_refused_or_need_validation(tmp_path_factory, tmp_path, case):
    ds = tmp_path / "ds"
    shutil.copytree(extracted_dataset(tmp_path_factory), ds)
    (ds / ".datagen" / "validation.json").unlink(missing_ok=True)
    counts: Counter = Counter()

    @drawn
    @FAST
    @given(uri=st.one_of(st.text(max_size=30), st.builds(lambda b, p: f"s3://{b}/{p}", st.text(max_size=12),
                                                          st.text(max_size=12))))
    def check(uri):
        o = run_cli("publish", ds, f"--to={uri}")
        # an unvalidated dataset is refused before S3 is contacted; a bad URI even before that
        assert o.code in (EXIT_BAD_INPUT, EXIT_VALIDATION), o.err
        assert_refused(o, code=o.code)
        counts["bad URI, refused" if o.code == EXIT_BAD_INPUT else "URI fine, refused: not validated"] += 1

    check()
    _record(case, "random publish destinations (hypothesis)", counts, what="nothing uploaded")
