"""The capture's packer and writers fed at a compute rate: what a run pays beyond its compute,
with each shard written once its last row is in ("at close") against written from its start
while it fills ("streamed").

    python -m bench.stream_tail                    # table + bench/results/stream_tail.{json,md,png}
    python -m bench.stream_tail --rate-of-disk 0.5    # ... bench/results/stream_tail-0.50.*
    python -m bench.stream_tail --shard-mib 512 --shards 4 --repeats 3

An engine that makes states at a rate R hands the packer one step's pieces at a time
(``Packer.put``, then ``close`` at each shard's last row), paced so that the steps alone would
take total bytes / R: that is the run's compute, what plain prefill would take. The run ends
when the last shard's file is in place (``Packer.join``). R is set against the volume's own rate
(``dd oflag=direct``): by default 0.95 of it, the 8B bf16 case on the H200 (states made at 1.41
GB/s, the volume taking 1.48), where compute holds the run and the disk keeps up between shards.
What the run pays beyond its compute is then the write after the last step: a whole shard at
close, the last piece streamed. The states are the 8B shape's (4 layers x 4,096, bf16), rows of
1,024 tokens, 2,048 tokens a step; both forms write the same bytes (checked).

Cases alternate (at close, streamed, then the next repeat); medians.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from bench._common import median, write_results
from bench.writer import dd_direct
from datagen.data.contract import ShardFormat
from datagen.data.shards.format import ShardJob
from datagen.engines.capture_pack import Chunk, Packer

LAYERS, HIDDEN = (2, 16, 29, 31), 4096
ROW, STEP = 1024, 2048  # tokens a row, tokens a step


def token_bytes() -> int:
    return len(LAYERS) * HIDDEN * 2


def jobs(out: Path, shards: int, rows_per_shard: int) -> list[ShardJob]:
    rng = np.random.default_rng(0)
    out_jobs = []
    for k in range(shards):
        ids = tuple(rng.integers(3, 50_000, size=ROW).astype(np.int32) for _ in range(rows_per_shard))
        first = k * rows_per_shard
        out_jobs.append(ShardJob(index=k, path=str(out / f"shard-{k:06d}.safetensors"), first_row=first,
                                 rows=rows_per_shard, sample_rows=tuple(range(first, first + rows_per_shard)),
                                 input_ids=ids, loss_masks=tuple(np.ones(ROW, np.uint8) for _ in ids),
                                 format=ShardFormat(LAYERS, "bfloat16", HIDDEN), shard_key=f"k{k}"))
    return out_jobs


def one_run(out: Path, shards: int, rows_per_shard: int, rate: float, stream: bool, states: torch.Tensor,
            stats: torch.Tensor) -> dict:
    """One run's timings: its compute (the paced steps), its wall (to the last file in place), the
    tail (the last close to the end), and the sha256 of every file."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    js = jobs(out, shards, rows_per_shard)
    packer = Packer(image_budget_bytes=16 << 30, writers=4, stream=stream)
    step_s = STEP * token_bytes() / rate
    rows = [(j, r) for j in js for r in range(j.rows)]
    per_step = STEP // ROW
    t0 = time.perf_counter()
    for s in range(0, len(rows), per_step):
        wait = t0 + (s // per_step + 1) * step_s - time.perf_counter()  # the step's compute, then its states
        if wait > 0:
            time.sleep(wait)
        for j, r in rows[s:s + per_step]:
            packer.put(j, r, 0, Chunk(states, stats, None, None, None))
            if r == j.rows - 1:
                packer.close(j)
    t_last = time.perf_counter()
    packer.join()
    t_end = time.perf_counter()
    packer.images.close()  # its images' memory back (the product's packer keeps them for the engine's life)
    done, errors = packer.take()
    if errors or len(done) != shards:
        raise RuntimeError(f"{len(done)} of {shards} shards written; errors: {errors}")
    sha = [hashlib.sha256(Path(j.path).read_bytes()).hexdigest() for j in js]
    if [r.sha256 for r in sorted(done, key=lambda r: r.index)] != sha:
        raise RuntimeError("a record's sha256 is not its file's")
    compute = len(rows) * ROW * token_bytes() / rate
    return {"compute_s": compute, "wall_s": t_end - t0, "tail_s": t_end - t_last, "steps_s": t_last - t0,
            "streamed_bytes": packer.streamed_bytes, "sha256": sha}


def run(shard_mib: int, shards: int, repeats: int, rate_of_disk: float, work: Path) -> dict:
    rows_per_shard = max(1, (shard_mib << 20) // (ROW * token_bytes()))
    disk = [dd_direct(work / "dd", shard_mib) for _ in range(3)]
    rate = rate_of_disk * median(disk)  # from the dd runs before the cases; those after are reported beside
    g = torch.Generator().manual_seed(0)
    states = torch.randn(ROW, len(LAYERS), HIDDEN, generator=g).to(torch.bfloat16)
    stats = torch.zeros(ROW, 3, len(LAYERS))
    res: dict = {"at close": [], "streamed": []}
    for r in range(repeats):
        for case in res:
            res[case].append(one_run(work / "out", shards, rows_per_shard, rate, case == "streamed", states, stats))
            x = res[case][-1]
            print(f"repeat {r} {case}: wall {x['wall_s']:.2f} s, compute {x['compute_s']:.2f} s, "
                  f"tail {x['tail_s']:.2f} s, streamed {x['streamed_bytes'] / 2**20:,.0f} MiB", flush=True)
        disk.append(dd_direct(work / "dd", shard_mib))
    shutil.rmtree(work / "out", ignore_errors=True)
    same = len({tuple(x["sha256"]) for xs in res.values() for x in xs}) == 1
    return {"shard_bytes": rows_per_shard * ROW * token_bytes(), "shards": shards, "rate_of_disk": rate_of_disk,
            "compute_bytes_per_s": rate, "dd_direct_bytes_per_s": disk[:3], "dd_direct_after_bytes_per_s": disk[3:], "identical_files": same,
            "cases": {k: [{a: b for a, b in x.items() if a != "sha256"} for x in xs] for k, xs in res.items()}}


def table(rec: dict) -> str:
    gb = rec["shard_bytes"] / 1e9
    lines = [f"Shards of {gb:.2f} GB x {rec['shards']}; states made at {rec['compute_bytes_per_s'] / 1e9:.2f} GB/s "
             f"({rec['rate_of_disk']:.2f} of `dd oflag=direct` before the cases, "
             f"{median(rec['dd_direct_bytes_per_s']) / 1e9:.2f} GB/s; between repeats "
             f"{', '.join(f'{x / 1e9:.2f}' for x in rec['dd_direct_after_bytes_per_s'])}); "
             f"same bytes in both forms: {rec['identical_files']}", "",
             "| shards written | compute s | run s (to the last file in place) | after the last step s | "
             "compute / run | streamed before the close |", "|---|---|---|---|---|---|"]
    for case, xs in rec["cases"].items():
        m = {k: median([x[k] for x in xs]) for k in ("compute_s", "wall_s", "tail_s", "streamed_bytes")}
        lines.append(f"| {case} | {m['compute_s']:.2f} | {m['wall_s']:.2f} | {m['tail_s']:.2f} | "
                     f"{m['compute_s'] / m['wall_s']:.3f} | {m['streamed_bytes'] / 2**30:.2f} GiB |")
    return "\n".join(lines)


def plot(rec: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(rec["cases"])
    fig, ax = plt.subplots(figsize=(7, 4))
    comp = [median([x["compute_s"] for x in rec["cases"][c]]) for c in cases]
    rest = [median([x["wall_s"] for x in rec["cases"][c]]) - comp[i] for i, c in enumerate(cases)]
    ax.barh(cases, comp, label="compute (paced steps)")
    ax.barh(cases, rest, left=comp, label="beyond compute (writes after the last step)")
    ax.set_xlabel("seconds (median)")
    ax.set_title(f"{rec['shards']} shards of {rec['shard_bytes'] / 1e9:.2f} GB, states at "
                 f"{rec['rate_of_disk']:.2f} of the disk's rate")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shard-mib", type=int, default=1024, help="shard size (the product's default: 1 GiB)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rate-of-disk", type=float, default=0.95, help="states made per second, over dd's rate")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--work", default=str(Path(__file__).resolve().parents[1] / ".cache" / "bench" / "stream_tail"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rec = run(args.shard_mib, args.shards, args.repeats, args.rate_of_disk, work)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "stream_tail" if args.rate_of_disk == 0.95 else f"stream_tail-{args.rate_of_disk:.2f}"
    write_results(out, stem, rec, table(rec), plot)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
