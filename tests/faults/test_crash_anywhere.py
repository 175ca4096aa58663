"""Crash anywhere: kill -9 a vLLM extraction at seeded random moments, resume each time, and get the
dataset of an uninterrupted run, byte for byte (tests/faults/_crash.py says how the moments are
chosen and what is checked after each kill).

    DATAGEN_FAULTS_FULL=1   20 kills (make faults); otherwise 3 (make test)
    DATAGEN_FAULTS_KILLS=N  N kills
    DATAGEN_FAULTS_SEED=S   another draw of modes and delays (default 20261130)
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import time
import uuid

import numpy as np
import pytest

from datagen.data.contract import MANIFEST_NAME
from tests.builders import token_rows, write_jsonl
from tests.faults._crash import Campaign, measure_reference, read_reference, schedule, stored_rows
from tests.faults._results import CaseRecord
from tests.faults.conftest import full_campaign

pytestmark = [pytest.mark.engine, pytest.mark.timeout(2400)]

ROWS = 28
PER_SHARD = 2  # 14 shards: enough for every kill to find work left, few enough to finish
SLOW_SHARD_S = 0.5  # the test hook's pause after each shard: a window to land mid-shard kills in
# Eager mode starts the engine in about half the time; the reference uses it too (compiled and
# eager kernels round differently, and the check is byte identity).
ENV = {"DATAGEN_ENFORCE_EAGER": "1", "DATAGEN_PROGRESS_INTERVAL": "0"}
KILLED_RUNS_ENV = {"DATAGEN_TEST_SLOW_SHARD_S": str(SLOW_SHARD_S)}  # the final, unkilled run goes at full speed
# Planted in every run of the campaign; at the end every log and file is searched for them.
SECRETS = {"AWS_SECRET_ACCESS_KEY": f"FaultsCrashSecret{uuid.uuid4().hex}",
           "HF_TOKEN": f"hf_FaultsCrashToken{uuid.uuid4().hex}"}


def _kills() -> int:
    return int(os.environ.get("DATAGEN_FAULTS_KILLS") or (20 if full_campaign() else 3))


def _args(model, rows, out) -> list[str]:
    return ["extract", "--model", str(model), "--dataset", str(rows), "--out", str(out),
            "--samples-per-shard", str(PER_SHARD), "--max-num-batched-tokens", "256", "--max-seq-len", "512"]


def test_kill_9_anywhere_and_resume_gives_the_uninterrupted_dataset(tiny_llama, tmp_path, case):
    seed = int(os.environ.get("DATAGEN_FAULTS_SEED", "20261130"))
    n_kills = _kills()
    case.category = "crash"
    case.case = f"kill -9 of the extraction process group at {n_kills} random moments, resumed each time"
    rng = np.random.default_rng(seed)
    rows = write_jsonl(tmp_path / "rows.jsonl", token_rows(rng.integers(1, 150, ROWS).tolist(), seed=seed))

    # The uninterrupted reference run, watched to learn how long the engine takes to start.
    env = {**os.environ, **ENV}
    ref_out = tmp_path / "reference"
    ref_s, engine_start_s = measure_reference(_args(tiny_llama, rows, ref_out), env, ref_out,
                                              tmp_path / "logs" / "reference.log")
    ref = read_reference(ref_out)
    assert len(ref.shards) == ROWS // PER_SHARD

    out = tmp_path / "killed"
    campaign = Campaign(_args(tiny_llama, rows, out), out, ref, env={**ENV, **KILLED_RUNS_ENV, **SECRETS}, seed=seed, logs=tmp_path / "logs",
                        engine_start_s=engine_start_s, slow_shard_s=SLOW_SHARD_S)
    modes = schedule(n_kills, seed)
    t0 = time.monotonic()
    campaign.run(modes)
    done, final_log = campaign.finish()
    campaign_s = time.monotonic() - t0
    text = final_log.read_text(errors="replace")
    assert done.returncode == 0, text[-4000:]

    # The final dataset against the reference: every shard byte, the manifest's shard list, rows.
    got = {p.name: p.read_bytes() for p in sorted((out / "shards").glob("shard-*.safetensors"))}
    differing = sorted(n for n in ref.shards if got.get(n) != ref.shards[n]) + sorted(set(got) - set(ref.shards))
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    rows_got = stored_rows(out)
    lost = sum(1 for r in ref.rows if r not in rows_got)
    duplicated = sum(n - 1 for n in rows_got.values() if n > 1)
    leftovers = [str(p.relative_to(out)) for p in out.rglob(".*.tmp-*")]

    kills = campaign.summary()
    landed = [k for k in campaign.kills if k.landed]
    survived = [k for k in campaign.kills if k.survived]
    phases = collections.Counter(k.phase for k in landed)
    case.attempts = len(landed)
    case.outcome = (f"{len(survived)}/{len(landed)} kills survived; final dataset "
                    f"{'byte-identical' if not differing and manifest['shards'] == ref.manifest_shards else 'DIFFERENT'}"
                    f" ({len(ref.shards)} shards)")
    case.data_lost = f"{lost} samples lost, {duplicated} duplicated"
    case.details = {
        "seed": seed, "kills": kills, "phases": dict(phases), "engine_start_s": round(engine_start_s, 1),
        "reference_run_s": round(ref_s, 1), "campaign_s": round(campaign_s, 1),
        "unrecorded_shards_recovered": sum(k.unrecorded for k in campaign.kills),
        "temp_files_left_by_kills": sum(k.temp_files for k in campaign.kills),
        "complete_shards_redone": sum(k.redone or 0 for k in campaign.kills),
        "kills_redirected_to_start_up": sum(k.mode != k.drawn for k in campaign.kills),
        # not a loss of data: shards the engine had computed but not yet written when killed
        "computed_not_written": sum(k.computed_not_written for k in campaign.kills),
        "differing_shards": differing, "leftover_temp_files": leftovers,
    }
    problems = [f"kill {k.attempt} ({k.mode}, {k.phase}): {p}" for k in campaign.kills for p in k.problems]
    assert not problems, "\n".join(problems)
    assert not differing, differing
    assert manifest["shards"] == ref.manifest_shards
    assert lost == 0 and duplicated == 0
    assert not leftovers
    assert len(landed) == n_kills
    # a campaign whose shards were all written early degenerates into kills of idle start-ups
    converted = [k for k in campaign.kills if k.mode != k.drawn]
    assert len(converted) <= n_kills // 4, f"{len(converted)} kills had nothing left to aim at: {phases}"
    _no_secret_in(tmp_path / "logs", out, n_runs=len(campaign.kills) + 1)
    shutil.rmtree(tmp_path / "logs", ignore_errors=True)


def _no_secret_in(logs, out, *, n_runs: int) -> None:
    """Every log of the campaign's vLLM runs and every file they wrote, searched for the secrets."""
    files = [p for d in (logs, out) for p in d.rglob("*") if p.is_file() and p.name != "reference.log"]
    hits = [f"{name} in {p.name}" for p in files for name, value in SECRETS.items()
            if value.encode() in p.read_bytes() or value[4:20].encode() in p.read_bytes()]
    CaseRecord(case=f"secrets planted in the environment of the {n_runs} vLLM extraction runs of the crash campaign",
               category="secrets", command="pytest tests/faults/test_crash_anywhere.py",
               attempts=len(files), outcome=f"{len(SECRETS)} planted secrets found in {len(hits)} of {len(files)} "
               "logs and dataset files", passed=not hits, details={"hits": hits}).write()
    assert not hits, hits
