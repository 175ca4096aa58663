"""Validation throughput against a plain sequential read of the same bytes.

    python -m bench.validate_throughput [--mb 384] [--hidden 2048] [--workers 1,2] [--dir DIR]

Writes a synthetic dataset with the real shard writer (``datagen.data.shards.writer.write_shard``:
random bf16 states, 4 layers) and a self-consistent manifest, then measures, cold and
warm:

- read: one thread reading every shard file sequentially in 8 MiB blocks;
- sha256: hashing the same files (the part of validation no parallelism can skip per file);
- validate: ``datagen.validation.dataset.validate`` with no golden samples and no reachable source (the
  structure, checksum, tensor, offsets, row, NaN/Inf and statistics checks: every byte).

"Cold" evicts the files from the page cache first: by default with
``posix_fadvise(DONTNEED)`` on each file (evicts its clean pages, needs no privilege and
leaves other processes' caches alone); ``--evict drop_caches`` writes
``/proc/sys/vm/drop_caches`` instead (root; the whole machine's cache). Results are printed
as a table; nothing is written outside ``--dir``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from datagen.data.contract import FORMAT_VERSION, LAYER_NUMBERING, MANIFEST_NAME, Manifest, ShardFormat, shard_name
from datagen.data.files import atomic_write_json
from datagen.data.shards.format import ShardJob
from datagen.data.shards.kernels import combine_stats
from datagen.data.shards.writer import write_shard
from datagen.specs.extraction import canonical_json, sha256_hex

LAYER_IDS = (2, 4, 5, 8)
TOKENS_PER_SAMPLE = 256
SAMPLES_PER_SHARD = 16


def make_dataset(root: Path, *, total_mb: int, hidden: int, seed: int = 0) -> Path:
    """A dataset of about ``total_mb`` MB of hidden states that passes validation."""
    per_token = len(LAYER_IDS) * hidden * 2
    tokens = total_mb * 1_000_000 // per_token
    n_shards = max(1, -(-tokens // (SAMPLES_PER_SHARD * TOKENS_PER_SAMPLE)))
    rows = n_shards * SAMPLES_PER_SHARD
    extraction = {
        "model": {"revision": "synthetic", "architecture": "LlamaForCausalLM", "num_hidden_layers": 8,
                  "hidden_size": hidden},
        "layer_ids": list(LAYER_IDS),
        "layer_numbering": LAYER_NUMBERING,
        "dtype": "bfloat16",
        "preprocessing": {"max_seq_len": 4096, "chat_template_sha256": None, "tokenizer_sha256": None,
                          "samples_per_shard": SAMPLES_PER_SHARD},
        "engine": {"name": "synthetic", "version": "0", "patches": []},
    }
    efp = sha256_hex(canonical_json(extraction))
    data_sha = sha256_hex(f"synthetic:{rows}")
    spec = {**extraction, "model": {**extraction["model"], "source": "(synthetic: no model)"},
            "dataset": {"source": "(synthetic: no rows)", "sha256": data_sha, "rows": rows}}
    g = torch.Generator().manual_seed(seed)
    records = []
    for k in range(n_shards):
        first = k * SAMPLES_PER_SHARD
        ids = tuple(np.random.default_rng(k).integers(0, 32000, TOKENS_PER_SAMPLE, dtype=np.int32)
                    for _ in range(SAMPLES_PER_SHARD))
        masks = tuple(np.ones(TOKENS_PER_SAMPLE, dtype=np.uint8) for _ in range(SAMPLES_PER_SHARD))
        job = ShardJob(index=k, path=str(root / shard_name(k)), first_row=first, rows=SAMPLES_PER_SHARD,
                       sample_rows=tuple(range(first, first + SAMPLES_PER_SHARD)), input_ids=ids, loss_masks=masks,
                       format=ShardFormat(LAYER_IDS, "bfloat16", hidden),
                       shard_key=sha256_hex(f"{efp}:{k}"))
        states = [torch.randn(TOKENS_PER_SAMPLE, len(LAYER_IDS), hidden, generator=g).to(torch.bfloat16)
                  for _ in range(SAMPLES_PER_SHARD)]
        records.append(write_shard(job, states))
    m = Manifest(
        format_version=FORMAT_VERSION, fingerprint=sha256_hex(canonical_json({"extraction": efp, "dataset": data_sha})),
        extraction_fingerprint=efp, spec=spec, shards=records,
        totals={"rows": rows, "samples": rows, "tokens": sum(r.tokens for r in records),
                "bytes": sum(r.bytes for r in records), "shards": n_shards, "skipped": 0, "truncated": 0},
        skipped=[], truncated=[], layer_stats=combine_stats([r.layer_stats for r in records], LAYER_IDS),
        created_at="1970-01-01T00:00:00+00:00",
    )
    atomic_write_json(root / MANIFEST_NAME, m.model_dump(mode="json"))
    return root


def evict(files: list[Path], how: str) -> str:
    """Drop the files from the page cache; returns the method used."""
    os.sync()
    if how == "drop_caches":
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "drop_caches"
        except OSError:
            pass  # not root: fall back to the per-file way
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def plain_read(files: list[Path]) -> float:
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    t = time.perf_counter()
    for p in files:
        with p.open("rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return time.perf_counter() - t


def sha_only(files: list[Path]) -> float:
    t = time.perf_counter()
    for p in files:
        h = hashlib.sha256()
        with p.open("rb", buffering=0) as f:
            for block in iter(lambda: f.read(8 << 20), b""):
                h.update(block)
    return time.perf_counter() - t


def validate_once(root: Path, workers: int) -> float:
    from datagen.validation.dataset import validate as run
    from datagen.validation.settings import ValidationSettings

    t = time.perf_counter()
    report = run(root, ValidationSettings(golden_samples=0), workers=workers)
    dt = time.perf_counter() - t
    problems = report["problems"]
    if not report["ok"]:
        raise SystemExit(f"synthetic dataset failed validation: {json.dumps(problems[:3])}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=384, help="size of the hidden states (MB)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts for validate")
    ap.add_argument("--dir", help="where to write the dataset (default: a temporary directory, removed after)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per measurement; the best is reported")
    ap.add_argument("--evict", choices=["fadvise", "drop_caches"], default="fadvise",
                    help="how cold runs empty the page cache (default: per file, fadvise)")
    args = ap.parse_args()

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="validate-bench-"))
    root = base / "dataset"
    try:
        if not (root / MANIFEST_NAME).exists():
            t = time.perf_counter()
            make_dataset(root, total_mb=args.mb, hidden=args.hidden)
            print(f"wrote {root} in {time.perf_counter() - t:.1f}s")
        files = sorted((root / "shards").glob("*.safetensors"))
        nbytes = sum(f.stat().st_size for f in files)
        rows = []
        method = None

        def measure(name: str, fn, cold: bool) -> None:
            nonlocal method
            best = float("inf")
            for _ in range(args.repeat):
                if cold:
                    method = evict(files, args.evict)
                else:
                    plain_read(files)  # make sure everything is cached
                best = min(best, fn())
            rows.append((name, "cold" if cold else "warm", nbytes / best / 1e9, best))

        for cold in (True, False):
            measure("plain sequential read (1 thread)", lambda: plain_read(files), cold)
            measure("sha256 only (1 thread)", lambda: sha_only(files), cold)
            for w in (int(x) for x in args.workers.split(",")):
                measure(f"datagen validate, {w} worker(s)", lambda w=w: validate_once(root, w), cold)

        print(f"\n{len(files)} shards, {nbytes / 1e6:.0f} MB, {os.cpu_count()} CPUs; cold = evicted with {method}; "
              f"best of {args.repeat}\n")
        print(f"| {'measurement':<36} | cache | {'GB/s':>6} | {'seconds':>7} |")
        print(f"|{'-' * 38}|-------|{'-' * 8}|{'-' * 9}|")
        for name, cache, gbs, s in rows:
            print(f"| {name:<36} | {cache:<5} | {gbs:>6.2f} | {s:>7.2f} |")
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
