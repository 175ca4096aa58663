"""Figure 6: peak memory of extraction as the dataset grows 1x, 4x, 16x.

    python -m bench.memory --mode smoke|full [--results DIR]

Each size is one ``datagen extract`` command (the real CLI, a process of its own), sampled every
0.2 s with psutil: the RSS of the whole process tree (the driver, vLLM's engine core and its
worker, where the states are captured and the shards written). The model is a random Llama with
hidden size 1024 and every layer captured (3 layers: 6 KiB of states per token), so that the
states dominate: at 16x they are about 1.6 GB, which a pipeline that held them would show.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench._common import (
    RESULTS, ROOT, SMOKE_RESULTS, Mode, Record, Row, TreeRSS, engine_env, log, setup_logging, work_dir, write_rows,
)

FLAT = 1.10  # peak at 16x within 10% of the peak at 1x
ROW_LEN = 512
BASE_ROWS = {Mode.FULL: 32, Mode.SMOKE: 4}
SAMPLES_PER_SHARD = {Mode.FULL: 8, Mode.SMOKE: 2}
SCALES = (1, 4, 16)
LAYERS = "0,1,2"


def model(work: Path) -> Path:
    from datagen.testmodels.tiny import TinyArch, make_model

    d = work / "llama-h1024"
    if not (d / "config.json").exists():
        make_model(d, arch=TinyArch.LLAMA, num_layers=2, hidden=1024, with_tokenizer=False)
    return d


def extract(model_dir: Path, data: Path, out: Path, samples_per_shard: int, log_path: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "datagen", "extract", "--model", str(model_dir), "--dataset", str(data),
           "--out", str(out), "--layers", LAYERS, "--max-seq-len", str(ROW_LEN), "--samples-per-shard",
           str(samples_per_shard)]
    with log_path.open("w") as logf:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT, env=dict(os.environ))
        with TreeRSS(proc.pid) as rss:
            rc = proc.wait()
    if rc != 0:
        raise RuntimeError(f"datagen extract failed (exit {rc}); see {log_path}")
    shard_bytes = sum(f.stat().st_size for f in (out / "shards").glob("*.safetensors"))
    shutil.rmtree(out)
    return {"peak_bytes": rss.peak, "samples": rss.samples, "shard_bytes": shard_bytes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.SMOKE.value)
    ap.add_argument("--results", help="directory of the JSON records")
    args = ap.parse_args(argv)
    setup_logging()
    engine_env()
    mode = Mode(args.mode)
    rec = Record(6, "memory", "Peak memory (RSS of the process tree) of extraction as the dataset grows", mode)
    work = work_dir("memory")
    m = model(work)
    runs = {}
    for scale in SCALES:
        rows = BASE_ROWS[mode] * scale
        data = write_rows(work / f"rows-{rows}x{ROW_LEN}.jsonl", rows=rows, length=ROW_LEN, vocab=512, seed=2)
        got = extract(m, data, work / "out", SAMPLES_PER_SHARD[mode], work / f"extract-{scale}x.log")
        got["rows"], got["tokens"] = rows, rows * ROW_LEN
        runs[scale] = got
        log.info("%dx: %d tokens, %.0f MB of shards, peak RSS %.0f MiB", scale, got["tokens"],
                 got["shard_bytes"] / 1e6, got["peak_bytes"] / 2**20)
    base = runs[1]["peak_bytes"]
    for scale in SCALES:
        r = runs[scale]
        rec.rows.append(Row(f"{scale}x: {r['rows']} rows, {r['tokens']:,} tokens, {r['shard_bytes'] / 1e6:,.0f} MB shards",
                            round(r["peak_bytes"] / 2**20), "MiB", None, None,
                            f"{r['peak_bytes'] / base:.2f}x the 1x peak"))
    growth = runs[SCALES[-1]]["peak_bytes"] / base
    rec.rows.append(Row(f"peak at {SCALES[-1]}x / peak at 1x", round(growth, 3), "x", f"<= {FLAT} (flat)",
                        growth <= FLAT,
                        f"+{(runs[SCALES[-1]]['peak_bytes'] - base) / 2**20:,.0f} MiB while the shards grew by "
                        f"{(runs[SCALES[-1]]['shard_bytes'] - runs[1]['shard_bytes']) / 2**20:,.0f} MiB"))
    rec.data = {"row_len": ROW_LEN, "layers": LAYERS, "hidden": 1024,
                "runs": {str(s): {k: v for k, v in r.items()} for s, r in runs.items()}}
    rec.write(Path(args.results) if args.results else (RESULTS if mode is Mode.FULL else SMOKE_RESULTS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
