"""The stored plan: a shard range reads its rows from the plan an earlier run stored in the output,
tokenizes nothing, and writes the same bytes as a run that tokenized the whole dataset; a stored
plan that is torn, tampered with or of another spec is never used."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from datagen.cli import RESULT_PREFIX
from datagen.cli import main as datagen_main
from datagen.data import chat_tokens
from datagen.data.contract import MANIFEST_NAME, Manifest
from datagen.specs.extraction import parse_spec
from datagen.extraction import stored
from tests.builders import chat_dataset

PER_SHARD = 3
ROWS = 12  # 4 shards
SHARDS = ROWS // PER_SHARD


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return chat_dataset(tmp_path_factory.mktemp("rows") / "chat.jsonl", rows=ROWS, seed=3)


@pytest.fixture
def tokenized(monkeypatch):
    """Counts the chat rows tokenized in this process (the hook is here, in the tests)."""
    calls = []
    real = chat_tokens.tokenize_chats

    def counting(tokenizer, chats, **kwargs):
        calls.extend(chat[1] for chat in chats)  # (messages, line, tools)
        return real(tokenizer, chats, **kwargs)

    monkeypatch.setattr(chat_tokens, "tokenize_chats", counting)
    return calls


def _plan_result(capsys, model, data, out) -> dict:
    """``datagen plan``'s result line for the tiny model, ``data`` and ``out``."""
    code = datagen_main(["plan", "--model", str(model), "--dataset", str(data), "--out", str(out),
                         "--engine", "hf", "--samples-per-shard", str(PER_SHARD)])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    return json.loads(captured.out.strip().splitlines()[-1].split(RESULT_PREFIX, 1)[1])


def _extract(capsys, model, data, out, *extra) -> dict:
    code = datagen_main(["extract", "--model", str(model), "--dataset", str(data), "--out", str(out),
                         "--engine", "hf", "--samples-per-shard", str(PER_SHARD), *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    return json.loads(captured.out.strip().splitlines()[-1].split(RESULT_PREFIX, 1)[1])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_llama, rows):
    """A whole run on a fresh output: every row tokenized, no stored plan read."""
    out = tmp_path_factory.mktemp("ref") / "ds"
    code = datagen_main(["extract", "--model", str(tiny_llama), "--dataset", str(rows), "--out", str(out),
                         "--engine", "hf", "--samples-per-shard", str(PER_SHARD)])
    assert code == 0
    return out


def _shard_bytes(out, indices) -> dict[int, bytes]:
    return {k: (out / "shards" / f"shard-{k:06d}.safetensors").read_bytes() for k in indices}


def _plan_log(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("plan: ")]


def test_a_range_reads_its_rows_from_the_stored_plan_and_writes_the_same_shards(
        capsys, caplog, tmp_path, tiny_llama, rows, reference, tokenized):
    caplog.set_level(logging.INFO, logger="datagen")
    out = tmp_path / "ds"
    _extract(capsys, tiny_llama, rows, out, "--shards", "0:1")
    assert len(tokenized) == ROWS, "the first range plans: every row is tokenized"
    assert "no stored plan" in " ".join(_plan_log(caplog))
    assert (stored.plan_dir(out, _fingerprint(tiny_llama, rows, out)) / stored.INDEX).is_file()

    tokenized.clear()
    caplog.clear()
    result = _extract(capsys, tiny_llama, rows, out, "--shards", "1:3")
    assert tokenized == [], "a range with a stored plan tokenizes no row"
    assert any(m.startswith("plan: loaded from .datagen/plan/") for m in _plan_log(caplog)), _plan_log(caplog)
    assert result["shards_extracted"] == [1, 2]

    # The whole run (the manifest: skipped and truncated rows, totals) from the stored plan too.
    result = _extract(capsys, tiny_llama, rows, out)
    assert tokenized == [] and result["shards_extracted"] == [3]
    assert _shard_bytes(out, range(SHARDS)) == _shard_bytes(reference, range(SHARDS))
    mine = Manifest.model_validate_json((out / MANIFEST_NAME).read_text())
    ref = Manifest.model_validate_json((reference / MANIFEST_NAME).read_text())
    assert mine.model_dump(exclude={"created_at"}) == ref.model_dump(exclude={"created_at"})


def _fingerprint(model, data, out) -> str:
    from datagen.extraction.plan import plan

    return plan(_spec(model, data, out)).fingerprint


def _spec(model, data, out):
    return parse_spec({"model": str(model), "dataset": str(data), "out": str(out), "samples_per_shard": PER_SHARD,
                       "engine": {"name": "hf"}})


def _flip_a_token(path):
    """Change one token id in a stored shard: a valid file, with other samples."""
    from safetensors.numpy import load, save

    t = load(path.read_bytes())
    t["input_ids"][0] += 1
    path.write_bytes(save(t))


def _tamper_index(path):
    index = json.loads(path.read_text())
    index["tokens"] += 1
    path.write_text(json.dumps(index))


def _tear_index(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage, why", [
    (lambda d: _flip_a_token(d / "shard-000001.safetensors"), "does not have the sha256"),
    (lambda d: (d / "shard-000001.safetensors").unlink(), "cannot be read"),
    (lambda d: _tamper_index(d / stored.INDEX), "incomplete, damaged"),
    (lambda d: _tear_index(d / stored.INDEX), "incomplete, damaged"),
], ids=["a-token-changed", "a-shard-missing", "index-edited", "index-torn"])
def test_a_damaged_stored_plan_is_not_used(capsys, caplog, tmp_path, tiny_llama, rows, reference, tokenized,
                                           damage, why):
    caplog.set_level(logging.INFO, logger="datagen")
    out = tmp_path / "ds"
    _extract(capsys, tiny_llama, rows, out, "--shards", "0:1")
    d = stored.plan_dir(out, _fingerprint(tiny_llama, rows, out))
    damage(d)
    tokenized.clear()
    caplog.clear()
    _extract(capsys, tiny_llama, rows, out, "--shards", "1:2")
    assert len(tokenized) == ROWS, "a damaged stored plan is not read: the range tokenizes the dataset"
    assert any(why in m and "tokenizing the whole dataset" in m for m in _plan_log(caplog)), _plan_log(caplog)
    assert _shard_bytes(out, [1]) == _shard_bytes(reference, [1])
    # the range stored its plan again: the next range reads it
    tokenized.clear()
    _extract(capsys, tiny_llama, rows, out, "--shards", "2:3")
    assert tokenized == [] and _shard_bytes(out, [2]) == _shard_bytes(reference, [2])


def test_a_stored_plan_is_used_only_for_its_own_dataset_tokenizer_and_settings(capsys, tmp_path, tiny_llama, rows):
    out = tmp_path / "ds"
    _extract(capsys, tiny_llama, rows, out, "--shards", "0:1")
    p, how = stored.load_plan(_spec(tiny_llama, rows, out), (1, 2))
    assert p is not None and p.fingerprint == _fingerprint(tiny_llama, rows, out), how

    other_template = tmp_path / "model"
    shutil.copytree(tiny_llama, other_template)
    jinja = other_template / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text(jinja.read_text() + " ")
    else:
        cfg_path = other_template / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] += " "
        cfg_path.write_text(json.dumps(cfg))
    edited = tmp_path / "edited.jsonl"
    lines = rows.read_text().splitlines(keepends=True)
    edited.write_text("".join(lines[:-1] + [lines[0]]))  # same rows count, other content
    for spec in (_spec(other_template, rows, out),  # another chat template (the model's content too)
                 _spec(tiny_llama, edited, out),  # another dataset
                 _spec(tiny_llama, rows, out).model_copy(update={"max_seq_len": 64})):  # other truncation
        p, how = stored.load_plan(spec, (1, 2))
        assert p is None, spec


def test_a_range_loads_only_its_own_rows(capsys, tmp_path, tiny_llama, rows):
    out = tmp_path / "ds"
    _extract(capsys, tiny_llama, rows, out, "--shards", "0:1")
    p, _ = stored.load_plan(_spec(tiny_llama, rows, out), (1, 2))
    assert 3 in p.data.samples or 3 in {s.row for s in p.data.skipped}
    with pytest.raises(RuntimeError, match="outside the stored plan's loaded rows"):
        _ = 0 in p.data.samples  # a row of shard 0 is never mistaken for a skipped row
    assert p.data.tokens == _plan_tokens(tiny_llama, rows, out)


def _plan_tokens(model, data, out) -> int:
    from datagen.extraction.plan import plan

    return plan(_spec(model, data, out)).data.tokens


def test_datagen_plan_reads_the_stored_plan_and_says_the_same(capsys, tmp_path, tiny_llama, rows, tokenized):
    out = tmp_path / "ds"
    _extract(capsys, tiny_llama, rows, out, "--shards", "0:1")

    def plan_result() -> dict:
        return _plan_result(capsys, tiny_llama, rows, out)

    tokenized.clear()
    from_store = plan_result()
    assert tokenized == [], "datagen plan reads the stored plan"
    shutil.rmtree(out / ".datagen" / "plan")
    computed = plan_result()
    assert len(tokenized) == ROWS
    assert from_store == computed and computed["shards_complete"] == [0]
    # the output is this extraction's: the plan computed there is stored again
    tokenized.clear()
    assert plan_result() == computed and tokenized == []


def test_a_plan_write_cut_by_a_crash_leaves_no_temporary_file(capsys, tmp_path, tiny_llama, rows):
    out = tmp_path / "ds"
    _extract(capsys, tiny_llama, rows, out, "--shards", "0:1")
    d = stored.plan_dir(out, _fingerprint(tiny_llama, rows, out))
    (d / stored.INDEX).unlink()  # as a kill before the index was renamed into place
    leftover = d / f".{stored.INDEX}.tmp-99999"
    leftover.write_text("{")
    _extract(capsys, tiny_llama, rows, out, "--shards", "1:2")
    assert not leftover.exists() and (d / stored.INDEX).is_file()


def test_an_appended_dataset_tokenizes_only_its_new_rows_and_plans_as_a_fresh_plan(capsys, tmp_path, tiny_llama,
                                                                                   rows, tokenized):
    out = tmp_path / "ds"
    _extract(capsys, tiny_llama, rows, out, "--shards", "0:1")  # last night: claimed, plan stored
    last_night = _plan_result(capsys, tiny_llama, rows, out)
    nightly = tmp_path / "nightly.jsonl"
    new = chat_dataset(tmp_path / "new.jsonl", rows=5, seed=11).read_bytes()
    nightly.write_bytes(rows.read_bytes() + new)

    def plan_result() -> dict:
        return _plan_result(capsys, tiny_llama, nightly, out)

    tokenized.clear()
    reused = plan_result()
    assert sorted(tokenized) == list(range(ROWS + 1, ROWS + 6)), "only the appended rows are tokenized"
    # the shards whose rows did not change keep their cache keys, and so do their ranges' keys
    # (tasks/extract.py: range_cache_key): the extract flow serves them from the cache
    assert reused["shard_keys"][:SHARDS] == last_night["shard_keys"] and len(reused["shard_keys"]) > SHARDS
    # an edited row is tokenized again, its neighbours are not (the appended night's plan is the stored one now)
    lines = nightly.read_bytes().splitlines(keepends=True)
    edited = json.loads(lines[4])
    edited["messages"][-1]["content"] += " and one more word"
    lines[4] = (json.dumps(edited) + "\n").encode()
    nightly.write_bytes(b"".join(lines))
    tokenized.clear()
    edited_plan = plan_result()
    assert tokenized == [5]
    for name in sorted(p.name for p in (out / ".datagen" / "plan").iterdir()):
        shutil.rmtree(out / ".datagen" / "plan" / name)
    tokenized.clear()
    fresh = plan_result()
    assert len(tokenized) == ROWS + 5 and fresh == edited_plan
    keys = [k for i, k in enumerate(fresh["shard_keys"]) if i != 4 // PER_SHARD]  # all but the edited row's shard
    assert reused["rows"] == ROWS + 5 and [k for i, k in enumerate(reused["shard_keys"]) if i != 4 // PER_SHARD] == keys
