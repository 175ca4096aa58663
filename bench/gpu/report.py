"""Table and plot of the H200 results in bench/gpu/results/ (made by bench/gpu/run.py).

    python -m bench.gpu.report      # prints the markdown table, writes bench/gpu/results/h200.png
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = {
    "256 rows, 64 rows/shard (2.1 GB shards)": "bench-256rows-64pershard.json",
    "512 rows, 16 rows/shard (0.5 GB shards)": "bench-512rows-16pershard.json",
}


def main() -> None:
    rows = []
    for label, name in RUNS.items():
        r = json.loads((RESULTS / name).read_text())
        plain = statistics.median(r["plain_tokens_per_s"])
        ext = statistics.median(r["extract_tokens_per_s"])
        wr = statistics.median(r["extract_bytes_per_s"]) / 1e9
        rows.append((label, plain, ext, plain / ext, wr, r["compute_floor_tokens_per_s"]))
    disk = json.loads((RESULTS / "disk.json").read_text())["dd"]
    print("| run | plain prefill tok/s | datagen extract tok/s | overhead | durable writes GB/s | compute floor tok/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, plain, ext, ov, wr, floor in rows:
        print(f"| {label} | {plain:,.0f} | {ext:,.0f} | {ov:.2f}x | {wr:.2f} | {floor:,.0f} |")
    print(f"\ndisk, plain sequential write (dd oflag=direct): {disk}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = [r[0].split(",")[1].strip() for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r[1] for r in rows], 0.4, label="plain vLLM prefill")
    ax.bar([i + 0.2 for i in x], [r[2] for r in rows], 0.4, label="datagen extract (fsync'd shards)")
    ax.axhline(rows[0][5], color="k", ls="--", lw=1, label="compute floor (2 x params FLOPs/token)")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("tokens/s")
    ax.set_title("H200, random 8B Llama shape, 4 layers captured (32 KB/token)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(RESULTS / "h200.png", dpi=120)


if __name__ == "__main__":
    main()
