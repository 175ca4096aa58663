"""The flow with S3: task results and cache records in a prefect-aws S3Bucket block (what several
hosts share), and the dataset published to S3 by the handoff. A real S3 server (SeaweedFS)."""

from __future__ import annotations

import json

import pytest

from flows.extract import extract
from tests.flows.builders import chat_rows, pipeline_spec
from tests.support.prefect_runs import state_names, task_runs
from tests.support.s3server import s3_env, s3_server  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.s3, pytest.mark.prefect_server, pytest.mark.usefixtures("prefect_harness")]

BLOCK = "datagen-results-test"


@pytest.fixture
def results_block(s3_env):
    from prefect_aws import AwsCredentials, S3Bucket
    from prefect_aws.client_parameters import AwsClientParameters

    bucket = s3_env.create_bucket()
    S3Bucket(
        bucket_name=bucket,
        credentials=AwsCredentials(
            aws_access_key_id=s3_env.access_key,
            aws_secret_access_key=s3_env.secret_key,
            region_name=s3_env.region,
            aws_client_parameters=AwsClientParameters(endpoint_url=s3_env.endpoint_url),
        ),
    ).save(BLOCK, overwrite=True)
    return bucket


def test_results_live_in_the_s3_block_and_the_dataset_is_published_to_s3(tmp_path, tiny_llama, s3_env, results_block):
    datasets = s3_env.create_bucket()
    spec = pipeline_spec(
        model=tiny_llama, dataset=chat_rows(tmp_path / "chat.jsonl", rows=4), output=tmp_path / "out",
        samples_per_shard=2, shards_per_task=2, result_storage=f"s3-bucket/{BLOCK}",
        publish_to=f"s3://{datasets}/tiny/v1", validation={"golden_samples": 1},
    )
    first = extract(spec, return_state=True)
    assert first.is_completed(), first.message
    summary = first.result()
    assert summary["uri"] == f"s3://{datasets}/tiny/v1"

    client = s3_env.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=results_block).get("Contents", [])]
    for kind in ("extract-range-", "finalize-", "validate-", "publish-"):
        assert any(k.startswith(kind) for k in keys), (kind, keys)
    manifest = json.loads(client.get_object(Bucket=datasets, Key="tiny/v1/manifest.json")["Body"].read())
    assert manifest["fingerprint"] == summary["fingerprint"]

    second = extract(spec, return_state=True)
    runs = task_runs(second.state_details.flow_run_id)
    assert state_names(runs["extract-range"]) == ["Cached"]
    assert state_names(runs["publish"]) == ["Cached"]
