"""`datagen validate`: each corruption is caught and named with its shard and row.

Every test copies one real dataset (extracted once per session with the reference
engine, see tests/support/extracted.py) and changes one thing. Where a corruption
would also be caught by a cheaper check than the one under test, the helpers repair
that evidence first (checksums, or checksums and statistics), so the test shows the
intended check catches it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch

from datagen import cli
from datagen.errors import EXIT_VALIDATION, ValidationFailed
from datagen.data.contract import validation_path
from datagen.validation.dataset import validate as run
from datagen.validation.settings import ValidationSettings
from datagen.validation.golden import draw_rows
from datagen.validation.shardfile import read_header
from tests.support.extracted import (
    EQUAL_LENGTH_ROWS, SKIPPED_ROWS, copy_dataset, extracted_dataset, fix_checksums, fix_records, foreign_shard,
    manifest, rewrite_shard, sample_span, shard_path, write_manifest,
)


@pytest.fixture(scope="session")
def pristine(tmp_path_factory) -> Path:
    return extracted_dataset(tmp_path_factory)


@pytest.fixture
def ds(pristine, tmp_path) -> Path:
    return copy_dataset(pristine, tmp_path / "ds")


def validate(ds: Path, **kw) -> dict:
    """``datagen validate``'s work; settings (``ValidationSettings``' fields) and the rest by keyword."""
    kw.setdefault("golden_samples", 0)
    settings = ValidationSettings(**{k: kw.pop(k) for k in list(kw) if k in ValidationSettings.model_fields})
    return run(ds, settings, **kw)


def kinds(report: dict) -> set[str]:
    return {p["kind"] for p in report["problems"]}


def problems_of(report: dict, kind: str) -> list[dict]:
    return [p for p in report["problems"] if p["kind"] == kind]


def stored_rows(ds: Path) -> list[int]:
    rows = manifest(ds)["spec"]["dataset"]["rows"]
    return [r for r in range(rows) if r not in SKIPPED_ROWS]


def seed_drawing_any_of(ds: Path, wanted, n: int) -> int:
    """A seed whose golden draw of ``n`` rows includes one of ``wanted``."""
    pool = stored_rows(ds)
    return next(s for s in range(1000) if set(draw_rows(pool, n, s)) & set(wanted))


# --- a clean dataset ----------------------------------------------------------------------------

def test_a_clean_dataset_passes_and_records_it_for_publish(ds):
    report = validate(ds, golden_samples=2, seed=0)

    assert report["ok"], report["problems"]
    marker = json.loads(validation_path(ds).read_text())
    assert marker["ok"] is True
    assert marker["manifest_sha256"] == hashlib.sha256((ds / "manifest.json").read_bytes()).hexdigest()
    assert {name for name, c in report["checks"].items() if c["status"] != "passed"} == {"drift"}
    assert report["golden"]["rows"] == list(draw_rows(stored_rows(ds), 2, 0))
    errors = [e for per_layer in report["golden"]["max_rel_error"].values() for e in per_layer.values()]
    assert errors and max(errors) <= 0.01  # same engine, same math: exact or within rounding


def test_the_command_exits_with_the_validation_code_and_writes_the_report(ds, tmp_path):
    shard_path(ds, 0).unlink()
    report_file = tmp_path / "report.json"

    code = cli.main(["validate", str(ds), "--golden", "0", "--report", str(report_file)])

    assert code == EXIT_VALIDATION
    report = json.loads(report_file.read_text())
    assert report["ok"] is False and kinds(report) == {"shard_missing"}


def test_a_stale_validation_record_is_removed_when_validation_fails(ds):
    assert validate(ds)["ok"]
    assert validation_path(ds).exists()
    shard_path(ds, 1).unlink()

    assert not validate(ds)["ok"]
    assert not validation_path(ds).exists()


# --- shard files --------------------------------------------------------------------------------

def test_a_flipped_byte_in_a_shard_is_a_checksum_problem(ds):
    p = shard_path(ds, 1)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside hidden_states
    p.write_bytes(bytes(data))

    report = validate(ds)

    assert kinds(report) == {"shard_checksum"}
    (prob,) = report["problems"]
    assert prob["shard"] == 1 and prob["path"] == "shards/shard-000001.safetensors"


def test_a_truncated_shard_is_named(ds):
    p = shard_path(ds, 2)
    os.truncate(p, p.stat().st_size // 2)

    report = validate(ds)

    assert "shard_size" in kinds(report)
    assert all(p["shard"] == 2 for p in report["problems"])
    assert any("truncated" in p["message"] for p in problems_of(report, "shard_size"))


def test_a_missing_shard_is_named_once_not_row_by_row(ds):
    shard_path(ds, 0).unlink()

    report = validate(ds)

    assert kinds(report) == {"shard_missing"}
    assert report["problems"][0]["shard"] == 0


def test_a_shard_from_another_spec_is_named_even_with_a_matching_checksum(ds, tmp_path_factory):
    other = foreign_shard(tmp_path_factory)  # same rows and shapes, layers 0,2,4 instead of 1,2,4
    shard_path(ds, 0).write_bytes(other.read_bytes())
    fix_checksums(ds)

    report = validate(ds)

    foreign = problems_of(report, "shard_foreign")
    assert foreign and all(p["shard"] == 0 for p in foreign)
    assert "shard_checksum" not in kinds(report)


@pytest.mark.parametrize("how", ["parent", "absolute", "symlink"])
def test_shard_paths_that_escape_the_dataset_are_refused(ds, tmp_path, how):
    m = manifest(ds)
    src = ds / m["shards"][0]["path"]
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(src.read_bytes())
    if how == "parent":
        m["shards"][0]["path"] = "../outside.safetensors"
    elif how == "absolute":
        m["shards"][0]["path"] = str(outside)
    else:
        src.unlink()
        src.symlink_to(outside)
    write_manifest(ds, m)

    report = validate(ds)

    unsafe = problems_of(report, "unsafe_path")
    assert len(unsafe) == 1 and unsafe[0]["shard"] == 0


def test_an_oversized_header_is_refused_without_reading_it(tmp_path):
    claimed = 512 << 20
    p = tmp_path / "hostile.safetensors"
    with p.open("wb") as f:
        f.write(struct.pack("<Q", claimed))
    os.truncate(p, claimed + 4096)  # sparse: the claimed header "exists" on disk

    tracemalloc.start()
    try:
        with pytest.raises(ValidationFailed) as e:
            read_header(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert e.value.problems[0].kind.value == "shard_header" and "limit" in e.value.problems[0].message
    assert peak < 1 << 20


def test_a_hostile_header_in_a_dataset_is_a_named_problem(ds):
    p = shard_path(ds, 1)
    p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    fix_checksums(ds)

    report = validate(ds)

    assert kinds(report) == {"shard_header"}
    assert report["problems"][0]["shard"] == 1


# --- rows and tokens ----------------------------------------------------------------------------

def drop_row(tensors: dict, row: int) -> dict:
    a, b = sample_span(tensors, row)
    keep = [i for i in range(len(tensors["input_ids"])) if not a <= i < b]
    lengths = torch.diff(tensors["sample_offsets"])
    s = tensors["sample_index"].tolist().index(row)
    lengths = torch.cat([lengths[:s], lengths[s + 1:]])
    return {
        "input_ids": tensors["input_ids"][keep],
        "loss_mask": tensors["loss_mask"][keep],
        "hidden_states": tensors["hidden_states"][keep],
        "sample_index": torch.cat([tensors["sample_index"][:s], tensors["sample_index"][s + 1:]]),
        "sample_offsets": torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)]),
    }


def test_a_row_missing_from_every_shard_is_named(ds):
    rewrite_shard(ds, 2, lambda t: drop_row(t, 19))
    fix_records(ds)  # the manifest agrees with the smaller shard: only coverage can tell

    report = validate(ds)

    assert kinds(report) == {"row_missing"}
    (prob,) = report["problems"]
    assert prob["row"] == 19 and prob["shard"] == 2


def test_changed_token_ids_differ_from_a_fresh_tokenization(ds):
    def change(t):
        a, _ = sample_span(t, 2)
        t["input_ids"][a + 3] = (t["input_ids"][a + 3] + 1) % 400
        return t

    rewrite_shard(ds, 0, change)
    fix_checksums(ds)

    report = validate(ds)

    assert kinds(report) == {"tokens"}
    assert [(p["shard"], p["row"]) for p in report["problems"]] == [(0, 2)]


def test_skipped_rows_are_recorded_with_their_reasons_and_checked(ds):
    m = manifest(ds)
    assert {s["row"]: s["reason"] for s in m["skipped"]} == SKIPPED_ROWS
    m["skipped"] = [s for s in m["skipped"] if s["row"] != 27]
    m["totals"]["skipped"] -= 1
    write_manifest(ds, m)

    report = validate(ds)

    # row 27 is now neither stored nor skipped, and a fresh read of the source skips it
    assert {(p["kind"], p.get("row")) for p in report["problems"]} == {("row_missing", 27), ("skipped", 27)}


# --- manifest -----------------------------------------------------------------------------------

def test_a_missing_manifest_is_named(ds):
    (ds / "manifest.json").unlink()

    report = validate(ds)

    assert kinds(report) == {"manifest_missing"}
    assert report["checks"]["shard_files"]["status"] == "not_run"


def test_an_edited_spec_no_longer_matches_its_fingerprint(ds):
    m = manifest(ds)
    m["spec"]["preprocessing"]["max_seq_len"] = 4000
    write_manifest(ds, m)

    assert "fingerprint" in kinds(validate(ds))


def test_moved_sources_are_reported_as_not_checked_and_can_be_pointed_at(ds, pristine):
    m = manifest(ds)
    model, rows = m["spec"]["model"]["source"], m["spec"]["dataset"]["source"]
    m["spec"]["model"]["source"] = "/nonexistent/model"  # not part of any fingerprint
    m["spec"]["dataset"]["source"] = "/nonexistent/rows.jsonl"
    write_manifest(ds, m)

    without = validate(ds)
    assert without["ok"] and without["checks"]["tokenization"]["status"] == "not_run"
    assert kinds(validate(ds, golden_samples=1)) == {"golden_unavailable"}
    pointed = validate(ds, model=model, source_rows=rows)
    assert pointed["ok"] and pointed["checks"]["tokenization"]["status"] == "passed"


# --- numerics -----------------------------------------------------------------------------------

def test_a_nan_in_hidden_states_is_named_with_its_row_and_layer(ds):
    def change(t):
        a, _ = sample_span(t, 11)
        t["hidden_states"][a + 5, 1, 7] = float("nan")
        return t

    rewrite_shard(ds, 1, change)
    fix_checksums(ds)  # the checksum no longer tells: only the values do

    report = validate(ds)

    assert kinds(report) == {"non_finite"}
    (prob,) = report["problems"]
    layer_ids = manifest(ds)["spec"]["layer_ids"]
    assert (prob["shard"], prob["row"], prob["layer_id"]) == (1, 11, layer_ids[1])
    assert "position 5" in prob["message"]


def test_statistics_that_disagree_with_the_data_are_named(ds):
    m = manifest(ds)
    st = m["shards"][1]["layer_stats"][0]
    st["sum"] += 1000.0
    st["mean"] = st["sum"] / st["count"]
    write_manifest(ds, m)

    report = validate(ds)

    assert kinds(report) == {"stats"}
    assert {p.get("shard") for p in report["problems"]} == {1, None}  # the shard's and the dataset's
    assert all(p["layer_id"] == m["spec"]["layer_ids"][0] for p in report["problems"])


def test_drift_from_the_previous_dataset_is_reported(ds, pristine, tmp_path):
    same = validate(ds, previous=str(pristine))
    assert same["ok"] and set(same["drift"]["layers"]) == {str(i) for i in manifest(ds)["spec"]["layer_ids"]}

    previous = copy_dataset(pristine, tmp_path / "previous")
    m = manifest(previous)
    m["layer_stats"][-1]["std"] *= 2.0
    write_manifest(previous, m)
    drifted = validate(ds, previous=str(previous))
    assert kinds(drifted) == {"drift"}
    assert drifted["problems"][0]["layer_id"] == m["spec"]["layer_ids"][-1]

    m["spec"]["layer_ids"] = [0, 2, 4]
    write_manifest(previous, m)
    assert kinds(validate(ds, previous=str(previous))) == {"previous_incompatible"}


# --- golden samples -----------------------------------------------------------------------------

def test_swapped_hidden_states_of_two_samples_fail_the_golden_check(ds):
    a_row, b_row = EQUAL_LENGTH_ROWS  # same length, same shard: shapes and statistics unchanged

    def swap(t):
        a0, a1 = sample_span(t, a_row)
        b0, b1 = sample_span(t, b_row)
        hs = t["hidden_states"].clone()
        hs[a0:a1], hs[b0:b1] = t["hidden_states"][b0:b1], t["hidden_states"][a0:a1]
        t["hidden_states"] = hs
        return t

    k = a_row // 8
    rewrite_shard(ds, k, swap)
    fix_records(ds)
    assert validate(ds)["ok"]  # nothing but a re-extraction can see it

    seed = seed_drawing_any_of(ds, EQUAL_LENGTH_ROWS, 2)
    report = validate(ds, golden_samples=2, seed=seed)

    assert kinds(report) == {"golden_mismatch"}
    assert {p["row"] for p in report["problems"]} <= set(EQUAL_LENGTH_ROWS)
    assert all(p["shard"] == k for p in report["problems"])


def test_the_golden_check_fails_on_an_off_by_one_layer(ds):
    from datagen.engines.hf import HFReference

    m = manifest(ds)
    layer_ids = tuple(m["spec"]["layer_ids"])  # (1, 2, 4)
    shifted = tuple(i + 1 for i in layer_ids[:-1]) + layer_ids[-1:]  # aux layers one too deep
    ref = HFReference(m["spec"]["model"]["source"], layer_ids=shifted, num_hidden_layers=4)

    def off_by_one(t):
        hs = t["hidden_states"].clone()
        off = t["sample_offsets"].tolist()
        for s in range(len(off) - 1):
            hs[off[s]:off[s + 1]] = ref.states(t["input_ids"][off[s]:off[s + 1]])
        t["hidden_states"] = hs
        return t

    rewrite_shard(ds, 0, off_by_one)
    fix_records(ds)
    seed = seed_drawing_any_of(ds, range(8), 2)

    report = validate(ds, golden_samples=2, seed=seed)

    assert kinds(report) == {"golden_mismatch"}
    assert {p["layer_id"] for p in report["problems"]} == set(layer_ids[:-1])
    worst = [e for per in report["golden"]["max_rel_error"].values() for lid, e in per.items()
             if int(lid) in layer_ids[:-1] and e > 0]
    assert worst and min(worst) > 0.3


def test_statistics_survive_float32_overflow_and_skip_only_non_finite_values():
    from datagen.validation.layer_sums import LayerSums as _LayerSums

    x = torch.randn(40, 2, 64).to(torch.bfloat16)
    x[3, 0, 5] = 1e30  # finite in bf16, but its square overflows a float32 sum
    x64 = x[:, 0].double()
    x[17, 1, 2] = float("inf")
    acc = _LayerSums(40, 2, 64)
    acc.add(x[:25], 0)
    acc.add(x[25:], 25)
    acc.finish(lambda t: x[t])

    got = acc.stats((7, 9))

    assert acc.bad == {1: [17]}
    assert (got[0].sum, got[0].sumsq) == pytest.approx((float(x64.sum()), float((x64 * x64).sum())), rel=1e-6)
    assert got[0].absmax == float(x[3, 0, 5])
    assert got[1].count == 40 * 64 - 1 and got[1].absmax < 10


def test_a_dataset_planned_with_a_spec_tokenizer_validates_against_that_tokenizer(tiny_llama, tmp_path):
    """A spec's `tokenizer` (used instead of the model's) is what validation tokenizes the rows with
    again: without it the fresh tokenization is of another tokenizer and is named as such."""
    import shutil

    from datagen.specs.extraction import parse_spec
    from datagen.extraction.run import extract
    from datagen.testmodels.tiny import make_chat_dataset

    tok = tmp_path / "tokenizer"
    tok.mkdir()
    for f in tiny_llama.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, tok / f.name)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    template = config.get("chat_template") or (tok / "chat_template.jinja").read_text()
    (tok / "chat_template.jinja").write_text("{#- this dataset's own template -#}\n" + template)
    config.pop("chat_template", None)
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    rows = make_chat_dataset(tmp_path / "chat.jsonl", rows=4, seed=3)
    out = tmp_path / "ds"
    extract(parse_spec({"model": str(tiny_llama), "dataset": str(rows), "out": str(out), "tokenizer": str(tok),
                        "layer_ids": [1, 2], "engine": {"name": "hf"}}))

    without = validate(out)
    assert not without["ok"] and kinds(without) == {"source_changed"}
    assert "--tokenizer" in problems_of(without, "source_changed")[0]["message"]
    named = validate(out, tokenizer=str(tok))
    assert named["ok"] and named["checks"]["tokenization"]["status"] == "passed", named["problems"]


def test_a_dataset_read_from_a_folder_or_with_options_is_tokenized_again_where_the_manifest_says(tiny_llama,
                                                                                                 tmp_path):
    """The recorded source of a JSONL folder, or of a Hugging Face dataset with ``#split=..``, is found
    (as the loader finds it: a file or a folder, the options after ``#`` not part of the path) and
    its rows are tokenized again; a moved one is reported as not reachable."""
    import datasets

    from datagen.specs.extraction import parse_spec
    from datagen.extraction.run import extract
    from datagen.testmodels.tiny import make_chat_dataset

    rows = [json.loads(line) for line in make_chat_dataset(tmp_path / "chat.jsonl", rows=4, seed=3).read_text()
            .splitlines()]
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "part-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    (folder / "part-1.json").write_text(json.dumps(rows[2:]))
    hf = datasets.Dataset.from_list([{"messages": r["messages"]} for r in rows])
    datasets.DatasetDict({"train": hf, "test": hf.select([0])}).save_to_disk(str(tmp_path / "hf"))
    for name, data in (("folder", str(folder)), ("hf", f"{tmp_path / 'hf'}#split=train&format=messages")):
        out = tmp_path / f"ds-{name}"
        extract(parse_spec({"model": str(tiny_llama), "dataset": data, "out": str(out), "layer_ids": [1, 2],
                            "engine": {"name": "hf"}}))
        report = validate(out)
        assert report["sources"]["dataset_found"], (name, report["sources"])
        assert report["ok"] and report["checks"]["tokenization"]["status"] == "passed", (name, report["problems"])

    m = manifest(out)
    m["spec"]["dataset"]["source"] = f"{tmp_path / 'gone'}#split=train"  # not part of any fingerprint
    write_manifest(out, m)
    moved = validate(out)
    assert not moved["sources"]["dataset_found"] and moved["checks"]["tokenization"]["status"] == "not_run"


# --- the manifest checked whole --------------------------------------------------------------------

# Fields validation cannot and need not bind: when the manifest was written, and where the sources
# were then (they move; what they hold is bound by spec.model.revision and spec.dataset.sha256,
# checked wherever they are read: test_moved_sources_are_reported_as_not_checked_and_can_be_pointed_at).
# The dataset's format says how its rows were written: what they hold is bound by spec.dataset.sha256.
UNBOUND_FIELDS = {("created_at",), ("spec", "model", "source"), ("spec", "dataset", "source"),
                  ("spec", "dataset", "format")}


def _leaves(value, path=()):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(value, list) and value:
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, i))
    else:
        yield path, value


def _changed(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, float):
        return v * 1.001 + 1e-3
    if isinstance(v, str):
        return v[:-1] + ("y" if v.endswith("x") else "x") if v else "x"
    return 1 if v is None else [1]


def test_an_edit_of_any_field_of_the_manifest_fails_validation(ds):
    """Each field of each kind of record (the first shard's, the first layer's, ...) changed alone:
    validation fails for every one that training, export, publish or the reader rely on."""
    original = manifest(ds)
    tried, passed, seen = 0, [], set()
    for path, value in _leaves(original):
        shape = tuple("*" if isinstance(p, int) else p for p in path)
        if shape in seen:
            continue
        seen.add(shape)
        m = json.loads(json.dumps(original))
        at = m
        for p in path[:-1]:
            at = at[p]
        at[path[-1]] = _changed(value)
        write_manifest(ds, m)
        tried += 1
        if validate(ds)["ok"]:
            passed.append(path)
    assert tried > 60
    assert {tuple(p) for p in passed} == UNBOUND_FIELDS


@pytest.mark.parametrize("field", ["sum", "sumsq", "mean", "std"])
def test_a_dataset_statistic_edited_by_a_thousandth_fails_validation(ds, field):
    m = manifest(ds)
    m["layer_stats"][0][field] *= 1.001
    write_manifest(ds, m)
    report = validate(ds)
    assert not report["ok"] and kinds(report) == {"stats"}, report["problems"]


def test_a_shard_statistic_edited_within_the_recompute_tolerance_fails_on_the_dataset_sums(ds):
    # recomputed from the values a shard's sum may differ by rounding; the dataset's sums add up exactly
    m = manifest(ds)
    m["shards"][0]["layer_stats"][0]["sum"] += 1.0
    write_manifest(ds, m)
    problems = problems_of(validate(ds), "stats")
    assert problems and any("combine from the shard records" in p["message"] for p in problems), problems


def test_a_shard_written_by_a_rank_the_engine_did_not_have_fails_validation(ds):
    m = manifest(ds)
    m["shards"][1]["written_by"] = 1  # the reference engine has one rank
    write_manifest(ds, m)
    assert kinds(validate(ds)) == {"shard_ranges"}
