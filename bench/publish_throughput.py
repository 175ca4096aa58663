"""Upload throughput of `datagen publish` to a local S3 server, against one plain boto3 upload.

    .venv/bin/python -m bench.publish_throughput [--shards 8] [--shard-mb 64] [--repeats 3]

Starts SeaweedFS on loopback (tests.support.s3server), writes a contract-valid dataset of random
shards (tests.support.fake_dataset), then times, each ``--repeats`` times into a fresh prefix:

* ``publish``: ``datagen.storage.publish.publish`` (re-hashes every shard, uploads them through one transfer
  manager with a SHA-256 checksum per part, checks every object, then writes the manifest);
* ``boto3-one-file``: one ``upload_file`` of a single file holding the same number of bytes,
  with boto3's default TransferConfig (8 MiB parts, 10 threads, its default CRC32 checksum);
* ``boto3-one-file-sha256``: the same with ``ChecksumAlgorithm=SHA256`` (what publish sends),
  to tell the cost of the checksum from the cost of the rest.

The server runs on the same machine as the client, so on a small machine both compete for the
same cores: the numbers compare the two clients, they are not a network measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--shard-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from tests.support.fake_dataset import make_dataset
    from tests.support.s3server import S3Server

    work = Path(tempfile.mkdtemp(prefix="publish-bench-"))
    server = S3Server(work / "s3", volume_size_limit_mb=1024)
    server.start()
    try:
        os.environ.update(server.env())
        from datagen import settings
        from datagen.storage import publish

        hidden, layers = 1024, 4
        tokens = args.shard_mb * 1024 * 1024 // (layers * hidden * 2)
        ds = make_dataset(work / "ds", shards=args.shards, samples_per_shard=tokens // 64, tokens_per_sample=64,
                          layer_ids=(2, 4, 5, 8), hidden=hidden)
        total = sum(p.stat().st_size for p in (ds / "shards").iterdir())
        blob = work / "one-file.bin"
        with blob.open("wb") as out:
            for p in sorted((ds / "shards").iterdir()):
                out.write(p.read_bytes())
        bucket = server.create_bucket()
        client = server.client()

        rows: dict[str, list[float]] = {"publish": [], "boto3-one-file": [], "boto3-one-file-sha256": []}
        for i in range(args.repeats):
            t = time.monotonic()
            publish.publish(ds, to=f"s3://{bucket}/publish-{i}")
            rows["publish"].append(total / (time.monotonic() - t) / 1e6)
            t = time.monotonic()
            client.upload_file(str(blob), bucket, f"one-file-{i}.bin")
            rows["boto3-one-file"].append(total / (time.monotonic() - t) / 1e6)
            t = time.monotonic()
            client.upload_file(str(blob), bucket, f"one-file-sha-{i}.bin", ExtraArgs={"ChecksumAlgorithm": "SHA256"})
            rows["boto3-one-file-sha256"].append(total / (time.monotonic() - t) / 1e6)
        result = {
            "bytes": total,
            "shards": args.shards,
            "cpus": os.cpu_count(),
            "publish_settings": {
                "chunk_mb": settings.s3_chunk_bytes() // 2**20,
                "max_concurrency": settings.s3_max_concurrency(),
            },
            "mb_per_s": {k: {"median": round(statistics.median(v), 1), "runs": [round(x, 1) for x in v]} for k, v in rows.items()},
        }
        print(json.dumps(result, indent=1))
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
