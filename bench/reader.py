"""Figure 7: training reads the shards directly -- reader throughput and time to the first batch.

    python -m bench.reader --mode smoke|full [--results DIR]

One synthetic dataset that follows the contract (``tests/support/synthetic_shards``: 10,000
samples of 64-192 tokens, 4 layers x hidden 128 bf16, 256 samples per shard) is read

* locally: a plain sequential read of the shard files (the floor of any reader); the reader
  (``datagen.reader``) map-style in dataset order and in a random order, and its iterable dataset
  (seeded shuffle across shards) with and without the sha256 check; the same samples exported by
  ``datagen export --format speculators`` and loaded one file per sample the way speculators'
  ``FileTransfer`` does, in a random order;
* from the S3 server (SeaweedFS on loopback, the dataset published by ``datagen publish``): a plain
  sequential GET of every shard object, the reader's iterable dataset (runs of samples in 16 MiB
  ranged GETs, 4 in flight) and its map-style dataset in a random order (a ranged GET per sample,
  one at a time; 1,000 samples).

Local reads start from a cold page cache (every file evicted with fadvise before each run).
Time to the first batch (16 samples) is measured from nothing open: the reader opening the
dataset (manifest and every shard's header and small tensors), against speculators' ArrowDataset
opening the export. One process, one thread per stream unless said; medians of the runs.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import time
from pathlib import Path

from bench._common import RESULTS, SMOKE_RESULTS, Mode, Record, Row, log, median, setup_logging, work_dir

SAMPLES = {Mode.FULL: 10_000, Mode.SMOKE: 600}
PER_SHARD = 256
TOKENS = (64, 192)
HIDDEN, LAYERS = 128, (1, 2, 3, 4)
REPEATS = {Mode.FULL: 3, Mode.SMOKE: 1}
BATCH = 16


def _dataset(mode: Mode) -> Path:
    from datagen.data.contract import MANIFEST_NAME
    from tests.support.fake_dataset import approve
    from tests.support.synthetic_shards import make_synthetic_dataset

    root = work_dir("reader") / f"dataset-{SAMPLES[mode]}"
    if not (root / MANIFEST_NAME).exists():
        shutil.rmtree(root, ignore_errors=True)
        make_synthetic_dataset(root, rows=SAMPLES[mode], samples_per_shard=PER_SHARD, tokens=TOKENS, hidden=HIDDEN,
                               layer_ids=LAYERS, num_hidden_layers=LAYERS[-1])
        approve(root)
    return root


def _export(root: Path) -> Path:
    from datagen.export import speculators as export

    out = root.parent / f"{root.name}-speculators"
    if not (out / export.EXPORT_RECORD).exists():
        shutil.rmtree(out, ignore_errors=True)
        export.export(root, out)
    return out


def _evict(paths: list[Path]) -> None:
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# --- the readers ---------------------------------------------------------------------------------

def plain_read(files: list[Path]) -> None:
    buf = memoryview(bytearray(8 << 20))
    for p in files:
        with p.open("rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def reader_map(root, order: list[int], verify) -> None:
    from datagen.reader import open_dataset

    r = open_dataset(root, verify=verify)
    for i in order:
        r[i]


def reader_stream(root, verify) -> None:
    from datagen.reader import ShardStreamDataset, open_dataset

    for _ in ShardStreamDataset(open_dataset(root, verify=verify), seed=0):
        pass


def export_files(out: Path, order: list[int]) -> None:
    from hs_connectors import FileTransfer

    t = FileTransfer(out / "hidden_states")
    for i in order:
        t.get_cached(i)


def s3_plain(client, bucket: str, keys: list[str]) -> None:
    for k in keys:
        body = client.get_object(Bucket=bucket, Key=k)["Body"]
        for _ in body.iter_chunks(8 << 20):
            pass


def first_batch_reader(root, verify) -> None:
    from itertools import islice

    from datagen.reader import ShardStreamDataset, open_dataset

    batch = list(islice(iter(ShardStreamDataset(open_dataset(root, verify=verify), seed=0)), BATCH))
    assert len(batch) == BATCH


def first_batch_export(out: Path, n: int) -> None:
    import warnings

    from speculators.train.data import ArrowDataset

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise")
    batch = [data[i] for i in random.Random(0).sample(range(n), BATCH)]
    assert len(batch) == BATCH


# --- the figure ------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.reader", description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.SMOKE.value)
    ap.add_argument("--results", help="directory of the JSON records")
    args = ap.parse_args(argv)
    setup_logging()
    mode = Mode(args.mode)
    from datagen.reader import Verify
    from datagen.storage import publish
    from tests.support.s3server import S3Server

    # imported once here: the first-batch times are of the data, not of importing a trainer
    import hs_connectors  # noqa: F401
    import speculators.train.data  # noqa: F401
    import torch

    torch.set_num_threads(1)  # as speculators' DataLoader workers run (train/dataloader.py)

    rec = Record(7, "reader", "Training reads the shards: reader throughput and time to the first batch", mode)
    t0 = time.monotonic()
    root = _dataset(mode)
    log.info("dataset ready in %.0f s", time.monotonic() - t0)
    t0 = time.monotonic()
    out = _export(root)
    log.info("export ready in %.0f s", time.monotonic() - t0)
    shards = sorted((root / "shards").glob("*.safetensors"))
    hs_files = sorted((out / "hidden_states").glob("*.safetensors"))
    n = len(hs_files)
    nbytes = sum(p.stat().st_size for p in shards)
    export_bytes = sum(p.stat().st_size for p in hs_files)
    shuffled = list(range(n))
    random.Random(1).shuffle(shuffled)
    local = {
        "plain sequential read of the shards": lambda: plain_read(shards),
        "reader, map-style, dataset order": lambda: reader_map(root, list(range(n)), Verify.NONE),
        "reader, map-style, random order": lambda: reader_map(root, shuffled, Verify.NONE),
        "reader, iterable, shuffled, sha256 checked": lambda: reader_stream(root, Verify.FULL),
        "reader, iterable, shuffled, no sha256": lambda: reader_stream(root, Verify.NONE),
        "exported per-sample files, random order": lambda: export_files(out, shuffled),
    }
    runs: dict[str, list[float]] = {k: [] for k in local}
    ttfb: dict[str, list[float]] = {"reader, local, sha256 checked": [], "reader, local, no sha256": [],
                                    "speculators ArrowDataset on the export": [], "reader, S3 (stored sha256)": []}
    for i in range(REPEATS[mode]):
        for name, fn in local.items():
            _evict(shards + hs_files if "export" in name else shards)
            runs[name].append(_timed(fn))
        _evict(shards)
        ttfb["reader, local, sha256 checked"].append(_timed(lambda: first_batch_reader(root, Verify.FULL)))
        _evict(shards)
        ttfb["reader, local, no sha256"].append(_timed(lambda: first_batch_reader(root, Verify.NONE)))
        _evict(hs_files + list(out.glob("*.arrow")))
        ttfb["speculators ArrowDataset on the export"].append(_timed(lambda: first_batch_export(out, n)))
        log.info("local round %d: %s", i + 1, {k: round(v[-1], 2) for k, v in runs.items()})

    server = S3Server(work_dir("reader") / "seaweedfs", volume_size_limit_mb=1024)
    server.start()
    try:
        for k, v in server.env().items():
            os.environ[k] = v
        bucket = server.create_bucket()
        uri = f"s3://{bucket}/nightly/ds"
        t0 = time.monotonic()
        publish.publish(root, to=uri)
        log.info("published in %.0f s", time.monotonic() - t0)
        client = server.client()
        keys = [f"nightly/ds/shards/{p.name}" for p in shards]
        s3_map = min(n, 1000)  # a request per sample: a sample of the order is enough for its rate
        remote = {
            "S3: plain sequential GET of the shards": lambda: s3_plain(client, bucket, keys),
            "S3: reader, iterable, shuffled (16 MiB ranged GETs)": lambda: reader_stream(uri, Verify.STORED),
            "S3: reader, map-style, random order (a ranged GET per sample)":
                lambda: reader_map(uri, shuffled[:s3_map], Verify.STORED),
        }
        runs.update({k: [] for k in remote})
        for i in range(REPEATS[mode]):
            for name, fn in remote.items():
                runs[name].append(_timed(fn))
            ttfb["reader, S3 (stored sha256)"].append(_timed(lambda: first_batch_reader(uri, Verify.STORED)))
            log.info("S3 round %d: %s", i + 1, {k: round(runs[k][-1], 2) for k in remote})
    finally:
        server.stop()
        shutil.rmtree(server.data_dir, ignore_errors=True)

    base_local = median(runs["plain sequential read of the shards"])
    base_s3 = median(runs["S3: plain sequential GET of the shards"])
    for name, secs in runs.items():
        t = median(secs)
        base = base_s3 if name.startswith("S3") else base_local
        count = min(n, 1000) if "map-style" in name and name.startswith("S3") else n
        moved = (export_bytes if "export" in name else nbytes) * count / n
        rec.rows.append(Row(name, round(count / t), "samples/s", None, None,
                            f"{moved / t / 1e6:,.0f} MB/s; {t:.2f} s for {count:,} samples; "
                            f"{base * count / n / t:.2f}x the plain read's rate"))
    for name, secs in ttfb.items():
        rec.rows.append(Row(f"time to the first batch ({BATCH} samples): {name}", round(median(secs), 3), "s",
                            None, None, f"runs {', '.join(f'{s:.3f}' for s in secs)}"))
    rec.data = {"samples": n, "shards": len(shards), "bytes": nbytes, "export_bytes": export_bytes,
                "tokens": TOKENS, "hidden": HIDDEN, "layers": len(LAYERS), "seconds": runs, "ttfb_s": ttfb,
                "batch": BATCH}
    rec.notes.append("local runs start with the files evicted from the page cache (fadvise); S3 is SeaweedFS on "
                     "loopback, so its numbers are the reader's request overhead, not a network's bandwidth")
    rec.write(Path(args.results) if args.results else (RESULTS if mode is Mode.FULL else SMOKE_RESULTS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
