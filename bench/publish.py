"""Figure 5: ``datagen publish`` to a local S3 server against one large boto3 upload to it.

    python -m bench.publish --mode smoke|full [--results DIR]

Runs ``bench/publish_throughput.py`` (SeaweedFS on loopback from
``tests/support/s3server.py``; a contract-valid dataset; each repeat into a fresh prefix:
``datagen.storage.publish.publish``, then one ``upload_file`` of a single file of the same bytes with boto3's
defaults, then the same with a SHA-256 checksum) and turns its JSON into the figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench._common import RESULTS, ROOT, SMOKE_RESULTS, Mode, Record, Row, setup_logging

TARGET = 0.70
SIZE = {Mode.FULL: {"shards": 8, "shard_mb": 32, "repeats": 5}, Mode.SMOKE: {"shards": 4, "shard_mb": 8, "repeats": 2}}


def measure(shards: int, shard_mb: int, repeats: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench.publish_throughput", "--shards", str(shards),
                           "--shard-mb", str(shard_mb), "--repeats", str(repeats)],
                          cwd=ROOT, capture_output=True, text=True)
    out = proc.stdout
    if proc.returncode != 0 or "{" not in out:
        raise RuntimeError(f"bench.publish_throughput failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out[out.index("{"):])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.publish", description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.SMOKE.value)
    ap.add_argument("--results", help="directory of the JSON records")
    args = ap.parse_args(argv)
    setup_logging()
    mode = Mode(args.mode)
    rec = Record(5, "publish", "Publish throughput to local S3 vs one large boto3 upload", mode)
    got = measure(**SIZE[mode])
    mbs = {k: v["median"] for k, v in got["mb_per_s"].items()}
    ratio = mbs["publish"] / mbs["boto3-one-file"]
    size = f"{got['shards']} shards, {got['bytes'] / 1e6:.0f} MB"
    rec.rows.append(Row(f"{size}, against boto3 defaults", round(100 * ratio, 1), "%", f">= {100 * TARGET:.0f}%",
                        ratio >= TARGET, f"publish {mbs['publish']:.0f} MB/s, one boto3 upload_file "
                                         f"{mbs['boto3-one-file']:.0f} MB/s"))
    sha = mbs["publish"] / mbs["boto3-one-file-sha256"]
    rec.rows.append(Row(f"{size}, against boto3 with SHA-256 part checksums", round(100 * sha, 1), "%", None, None,
                        f"one boto3 upload_file with ChecksumAlgorithm=SHA256 {mbs['boto3-one-file-sha256']:.0f} MB/s"))
    rec.data = got
    rec.notes.append("The S3 server runs on the same 2 CPUs as the client: the figure compares two clients, "
                     "it is not a network measurement.")
    rec.write(Path(args.results) if args.results else (RESULTS if mode is Mode.FULL else SMOKE_RESULTS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
