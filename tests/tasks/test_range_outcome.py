"""What the extraction tasks return: the step's own results, and a range's outcome around the
extract step's result (the range, the worker's flow run, the result as a cached run sees it)."""

from __future__ import annotations

import hashlib

from datagen.data.contract import MANIFEST_NAME
from datagen.steps.assemble import AssembleResult
from datagen.steps.extract import ExtractResult
from tasks.artifacts import summary_markdown
from tasks.extract import RangeOutcome
from tasks.fanout.parent import _outcome
from tasks.pipeline_spec import ShardRange
from tests.support.synthetic_shards import make_synthetic_dataset, manifest_of


def extract_result(**update) -> ExtractResult:
    fields = dict(dataset="/data/out", fingerprint="f" * 64, extraction_fingerprint="e" * 64, layer_ids=[1, 2],
                  shards_total=6, shards_extracted=[2, 3], shards_cached=[4], tokens=300, tokens_extracted=200,
                  seconds=4.0, tokens_per_s=50.0, engine={"name": "vllm", "version": "0.32.0"})
    return ExtractResult(**{**fields, **update})


def test_a_range_served_from_the_cache_extracted_nothing_now_and_keeps_the_rest():
    done = RangeOutcome(range=ShardRange(first=2, stop=5), worker="run-1", result=extract_result())
    cached = done.served_from_cache()
    assert (cached.shards_extracted, cached.shards_cached) == ([], [2, 3, 4])
    assert (cached.result.tokens_extracted, cached.result.tokens_per_s) == (0, 0.0)
    assert (cached.range, cached.worker, cached.result.tokens) == (done.range, "run-1", 300)
    assert (done.shards_extracted, done.shards_cached) == ([2, 3], [4])  # the original is unchanged


def test_a_range_without_a_step_run_has_every_shard_cached():
    outcome = RangeOutcome(range=ShardRange(first=4, stop=6), result=None)
    assert (outcome.shards_extracted, outcome.shards_cached) == ([], [4, 5])
    assert outcome.served_from_cache() == outcome
    assert outcome.record() == {"range": "4:6", "worker": None, "shards_extracted": [], "shards_cached": [4, 5]}


def test_the_run_summary_counts_the_ranges_records():
    ranges = [RangeOutcome(range=ShardRange(first=2, stop=5), result=extract_result()).record() | {"task_cached": False},
              RangeOutcome(range=ShardRange(first=0, stop=2), result=None).record() | {"task_cached": True}]
    assert ranges[0]["range"] == "2:5" and ranges[0]["engine"] == {"name": "vllm", "version": "0.32.0"}
    text = summary_markdown(spec={"model": "m"}, dataset={"totals": {"shards": 6, "tokens": 900}},
                            ranges=ranges, published_to=None, validation="passed")
    assert "| shards | 6 (2 extracted now, 3 already there) |" in text
    assert "| ranges served from the cache | 1 of 2 |" in text
    assert "| tokens | 900 (200 extracted now) |" in text
    assert "| tokens/s (extraction) | 50 |" in text


def test_a_receipt_is_the_ranges_outcome_and_a_foreign_one_says_only_what_the_bucket_shows():
    r = ShardRange(first=2, stop=5)
    done = RangeOutcome(range=r, worker="run-1", result=extract_result())
    assert _outcome(r, done.model_dump(mode="json")) == done
    nothing = RangeOutcome(range=r, result=None)
    assert _outcome(r, None) == nothing
    assert _outcome(ShardRange(first=0, stop=2), done.model_dump(mode="json")).range == ShardRange(first=0, stop=2)
    flat = {"range": "2:5", "fingerprint": "f", "shards_extracted": [2], "shards_cached": [3, 4], "tokens": 1,
            "seconds": 1.0, "worker": "run-0"}  # a receipt of an earlier version
    assert _outcome(r, flat) == nothing


def test_the_assemble_result_of_a_manifest_in_the_bucket_says_what_the_manifest_says(tmp_path):
    dataset = "s3://bucket/run"
    root = make_synthetic_dataset(tmp_path / "ds", rows=20, samples_per_shard=8)
    raw = (root / MANIFEST_NAME).read_bytes()
    manifest = manifest_of(root)
    result = AssembleResult.of_manifest(raw, dataset=dataset)
    assert result.dataset == dataset
    assert result.manifest_sha256 == hashlib.sha256(raw).hexdigest()
    assert (result.fingerprint, result.totals) == (manifest["fingerprint"], manifest["totals"])
    assert result.layer_ids == manifest["spec"]["layer_ids"] and result.shards_total == 3
    assert [s["index"] for s in result.shards] == [0, 1, 2]
    assert result.shards[1] == {k: manifest["shards"][1][k] for k in
                                ("index", "path", "first_sample", "rows", "samples", "tokens", "bytes", "sha256")}
