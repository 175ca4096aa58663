"""The shard writer alone: before (save_file, fsync, read back for sha256) against now.

    python -m bench.writer                      # table + bench/results/writer.{json,png}
    python -m bench.writer --sizes 16,64 --repeats 3 --out /tmp/w

Each case writes one shard of random bf16 states given as the vLLM capture hands them over
(per sample, a list of chunked-prefill chunks) into a fresh directory on the same volume:

- before: the writer as it was (concatenate each sample's chunks, concatenate the samples,
  ``safetensors.torch.save_file``, fsync, read the file back for its sha256, rename, fsync the
  directory), kept here verbatim for the comparison;
- direct: ``datagen.data.shards.writer.write_shard`` (chunks copied once into a reused, page-aligned file
  image, sha256 while writing, O_DIRECT, one fsync, rename, directory fsync);
- buffered: the same with ``DATAGEN_DIRECT_IO=0`` (through the page cache).

Cases alternate (before, direct, buffered, then the next repeat), and ``dd oflag=direct`` of the
same size gives the volume's own figure. Throughput is shard bytes over wall time (median).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from datagen.data.files import fsync_dir
from datagen.data.contract import ShardFormat
from datagen.data.shards.format import SHARD_FORMAT, ShardJob
from datagen.data.shards.kernels import token_stats
from datagen.data.shards.writer import write_shard

H, LAYERS, ROW, CHUNK = 4096, (2, 16, 29, 32), 1024, 256


def make_inputs(size_mb: int, seed: int = 0):
    rows = max(1, size_mb * (1 << 20) // (ROW * len(LAYERS) * H * 2))
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    chunks = [[torch.randn(CHUNK, len(LAYERS), H, generator=g).to(torch.bfloat16) for _ in range(ROW // CHUNK)]
              for _ in range(rows)]
    stats = [[token_stats(c) for c in s] for s in chunks]
    ids = tuple(rng.integers(0, 1000, ROW).astype(np.int32) for _ in range(rows))
    masks = tuple(np.ones(ROW, np.uint8) for _ in range(rows))
    return chunks, stats, ids, masks


def job(path: Path, ids, masks) -> ShardJob:
    return ShardJob(index=0, path=str(path), first_row=0, rows=len(ids), sample_rows=tuple(range(len(ids))),
                    input_ids=ids, loss_masks=masks, format=ShardFormat(LAYERS, "bfloat16", H),
                    shard_key="bench")


def write_before(j: ShardJob, chunks) -> tuple[str, int]:
    """The writer before this change (pack, save_file, fsync, sha256 by reading back, rename)."""
    from safetensors.torch import save_file

    states = [torch.cat(c, dim=0) for c in chunks]  # what the worker did per request
    lengths = [len(x) for x in j.input_ids]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tensors = {"input_ids": torch.from_numpy(np.concatenate(j.input_ids)),
               "loss_mask": torch.from_numpy(np.concatenate(j.loss_masks)),
               "hidden_states": torch.cat(states, dim=0).contiguous(),
               "sample_index": torch.tensor(j.sample_rows, dtype=torch.int64),
               "sample_offsets": torch.from_numpy(offsets)}
    final = Path(j.path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp")
    save_file(tensors, str(tmp), metadata={"datagen": json.dumps(
        {"format": SHARD_FORMAT, "shard_key": j.shard_key, "layer_ids": list(j.layer_ids)}, sort_keys=True)})
    os.chmod(tmp, 0o644)
    with tmp.open("rb+") as f:
        os.fsync(f.fileno())
    h = hashlib.sha256()
    with tmp.open("rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    size = tmp.stat().st_size
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return h.hexdigest(), size


def dd_direct(path: Path, size_mb: int) -> float:
    proc = subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={max(1, size_mb // 4)}",
                           "oflag=direct", "conv=fsync"], capture_output=True, text=True)
    path.unlink(missing_ok=True)
    line = proc.stderr.strip().splitlines()[-1]
    n, unit = line.rsplit(",", 1)[1].split()
    return float(n) * {"kB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9}[unit]


def run(sizes: list[int], repeats: int, work: Path) -> dict:
    out: dict = {"machine": {"cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0]}, "sizes": {}}
    for mb in sizes:
        chunks, stats, ids, masks = make_inputs(mb)
        res = {"before": [], "direct": [], "buffered": [], "dd_direct": []}
        sha = {}
        for r in range(repeats):
            for case in ("before", "direct", "buffered"):
                d = work / f"{case}-{mb}-{r}"
                shutil.rmtree(d, ignore_errors=True)
                j = job(d / "shard-000000.safetensors", ids, masks)
                os.environ["DATAGEN_DIRECT_IO"] = "0" if case == "buffered" else "1"
                t0 = time.perf_counter()
                if case == "before":
                    digest, size = write_before(j, chunks)
                else:
                    rec = write_shard(j, chunks, stats)
                    digest, size = rec.sha256, rec.bytes
                dt = time.perf_counter() - t0
                res[case].append(size / dt)
                sha.setdefault(case, digest)
                shutil.rmtree(d)
            res["dd_direct"].append(dd_direct(work / "dd", mb))
        os.environ.pop("DATAGEN_DIRECT_IO", None)
        out["sizes"][str(mb)] = {"bytes": size, "mb_per_s": {k: [v / 1e6 for v in vs] for k, vs in res.items()},
                                 "identical_files": len(set(sha.values())) == 1}
        print(f"{mb} MB: " + ", ".join(f"{k} {statistics.median(v) / 1e6:,.0f} MB/s" for k, v in res.items())
              + f"; same bytes: {len(set(sha.values())) == 1}", flush=True)
    out["machine"]["load_average_1m_end"] = os.getloadavg()[0]
    return out


def table(rec: dict) -> str:
    lines = ["| shard | before MB/s | direct MB/s | buffered MB/s | dd oflag=direct MB/s | direct / before | same bytes |",
             "|---|---|---|---|---|---|---|"]
    for mb, r in rec["sizes"].items():
        m = {k: statistics.median(v) for k, v in r["mb_per_s"].items()}
        lines.append(f"| {r['bytes'] / 1e6:,.0f} MB | {m['before']:,.0f} | {m['direct']:,.0f} | {m['buffered']:,.0f} | "
                     f"{m['dd_direct']:,.0f} | {m['direct'] / m['before']:.2f}x | {r['identical_files']} |")
    return "\n".join(lines)


def plot(rec: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(rec["sizes"])
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.2
    for i, case in enumerate(("before", "direct", "buffered", "dd_direct")):
        ax.bar([x + i * w for x in range(len(sizes))],
               [statistics.median(rec["sizes"][s]["mb_per_s"][case]) for s in sizes], w, label=case)
    ax.set_xticks([x + 1.5 * w for x in range(len(sizes))], [f"{s} MB shard" for s in sizes])
    ax.set_ylabel("MB/s (median)")
    ax.set_title("shard writer: before vs hash-while-writing + O_DIRECT")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,64,256", help="shard sizes in MB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--work", default=str(Path(__file__).resolve().parents[1] / ".cache" / "bench" / "writer"))
    args = ap.parse_args()
    torch.set_num_threads(1)  # as in the vLLM worker
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rec = run([int(s) for s in args.sizes.split(",")], args.repeats, work)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "writer.json").write_text(json.dumps(rec, indent=1))
    t = table(rec)
    (out / "writer.md").write_text(t + "\n")
    print(t)
    plot(rec, out / "writer.png")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
