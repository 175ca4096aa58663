"""`datagen plan`: the output-size check from the plan's own token count, and shards sized by bytes."""

from __future__ import annotations

import subprocess

import pytest

from datagen.cli import main as datagen_main
from datagen.errors import EXIT_CANNOT_RUN_HERE
from tests.builders import token_rows, write_jsonl


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs: it holds a few hundred tokens of the tiny Llama's states, not more."""
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], check=True, capture_output=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {e}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def _plan(capsys, model, rows, out):
    code = datagen_main(["plan", "--model", str(model), "--dataset", str(rows), "--out", str(out), "--engine", "hf"])
    return code, capsys.readouterr().err


def test_plan_refuses_an_output_that_cannot_hold_its_token_count(capsys, tmp_path, tiny_llama, small_disk):
    # 3 layers x 128 x 2 bytes + 5 = 773 bytes per token: 1000 tokens need 773 KB, 100 need 77 KB.
    big = write_jsonl(tmp_path / "big.jsonl", token_rows([500, 500]))
    code, err = _plan(capsys, tiny_llama, big, small_disk / "ds")
    assert code == EXIT_CANNOT_RUN_HERE, err
    assert "cannot hold this dataset" in err and "1000 tokens x 773 bytes" in err and "->" in err
    assert list(small_disk.iterdir()) == [], "a refused plan leaves the output location as it found it"

    small = write_jsonl(tmp_path / "small.jsonl", token_rows([50, 50]))
    code, err = _plan(capsys, tiny_llama, small, small_disk / "ds")
    assert code == 0, err


def test_plan_sizes_an_fp8_run_at_one_byte_per_value_and_its_scales(capsys, tmp_path, tiny_llama, small_disk):
    """Regression: the plan sized an fp8 run as its compute dtype (bf16), twice the bytes, and
    refused an output that holds it."""
    # fp8: 3 layers x (128 x 1 byte + a 4-byte scale) + 5 = 401 bytes per token (bf16: 773).
    # 400 tokens: 160 KB in fp8 fit the 256 KiB disk; 309 KB in bf16 would not.
    rows = write_jsonl(tmp_path / "rows.jsonl", token_rows([200, 200]))
    code = datagen_main(["plan", "--model", str(tiny_llama), "--dataset", str(rows), "--out", str(small_disk / "ds"),
                         "--engine", "hf", "--storage-dtype", "fp8_e4m3"])
    err = capsys.readouterr().err
    assert code == 0, err

    big = write_jsonl(tmp_path / "big.jsonl", token_rows([500, 500]))
    code = datagen_main(["plan", "--model", str(tiny_llama), "--dataset", str(big), "--out", str(small_disk / "ds"),
                         "--engine", "hf", "--storage-dtype", "fp8_e4m3"])
    err = capsys.readouterr().err
    assert code == EXIT_CANNOT_RUN_HERE and "1000 tokens x 401 bytes" in err, err


def test_a_range_is_on_disk_only_when_every_shard_of_it_is_complete():
    """The extract flow refreshes the cache of each range this says is not on disk, and of no other
    (flows/extract.py: submit): a range whose shard was deleted is extracted again, its neighbour
    stays cached (tests/flows/test_extract_flow.py's fault runs refresh one range)."""
    from datagen.steps.plan import PlanResult
    from tasks.pipeline_spec import ShardRange

    planned = PlanResult.model_construct(shards_complete=[1, 2, 3])
    assert not planned.range_on_disk(ShardRange(first=0, stop=2))
    assert planned.range_on_disk(ShardRange(first=2, stop=4))
    assert planned.range_on_disk(ShardRange(first=1, stop=2))
    assert not PlanResult.model_construct(shards_complete=[]).range_on_disk(ShardRange(first=2, stop=4))


def _result(capsys, *argv) -> tuple[int, dict, str]:
    import json

    from datagen.cli import RESULT_PREFIX

    code = datagen_main(list(argv))
    out = capsys.readouterr()
    lines = [x for x in out.out.splitlines() if x.startswith(RESULT_PREFIX)]
    return code, json.loads(lines[-1][len(RESULT_PREFIX):]) if lines else {}, out.err


def test_shards_sized_by_bytes_are_planned_weighed_and_resumed_byte_for_byte(capsys, caplog, tmp_path, tiny_llama):
    """3 layers x 128 x 2 bytes = 768 bytes of states a token; a 40 kB target cuts 12 rows of 10-90
    tokens into shards of whole rows. The plan says what they weigh; a range re-extracted from the
    stored plan (its boundaries recorded) writes the same bytes."""
    rows = write_jsonl(tmp_path / "rows.jsonl", token_rows([40, 60, 30, 80, 20, 50, 70, 10, 90, 30, 40, 60]))
    out = tmp_path / "ds"
    common = ["--model", str(tiny_llama), "--dataset", str(rows), "--out", str(out), "--engine", "hf",
              "--shard-bytes", "40000"]
    code, planned, err = _result(capsys, "plan", *common)
    assert code == 0, err
    w = planned["shard_state_bytes"]
    assert planned["num_shards"] > 2 and 0 < w["min"] <= w["median"] <= w["max"] <= 80_000, planned
    assert planned["spec"]["preprocessing"]["shard_bytes"] == 40_000
    assert "samples_per_shard" not in planned["spec"]["preprocessing"]
    assert planned["spec"]["engine"]["shard_group"] == planned["shard_group"] == 4096  # 52 tokens a shard
    caplog.set_level("INFO", logger="datagen")
    code, done, err = _result(capsys, "extract", *common)
    assert code == 0, err
    firsts = [s["first_sample"] for s in done["shards"]]
    assert firsts[0] == 0 and firsts == sorted(firsts) and sum(s["rows"] for s in done["shards"]) == 12
    assert all(s["tokens"] * 768 <= 80_000 or s["rows"] == 1 for s in done["shards"])
    k = 1
    shard = out / "shards" / f"shard-{k:06d}.safetensors"
    before = shard.read_bytes()
    shard.unlink()
    code, again, err = _result(capsys, "extract", *common, "--shards", f"{k}:{k + 1}")
    assert code == 0 and again["shards_extracted"] == [k], err
    assert any(r.getMessage().startswith("plan: loaded from") for r in caplog.records)
    assert shard.read_bytes() == before


def test_a_spec_naming_both_shard_sizes_is_refused_before_anything_is_written(capsys, tmp_path, tiny_llama):
    rows = write_jsonl(tmp_path / "rows.jsonl", token_rows([10, 10]))
    code = datagen_main(["extract", "--model", str(tiny_llama), "--dataset", str(rows), "--out", str(tmp_path / "ds"),
                         "--engine", "hf", "--shard-bytes", "1000", "--samples-per-shard", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "name one" in err and "--samples-per-shard" in err, err
    assert not (tmp_path / "ds").exists()
