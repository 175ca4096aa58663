"""prefect.yaml: every deployment's parameters validate against its flow's spec; the schedules,
limits and the training trigger are what the docs say."""

from __future__ import annotations

from flows._deployments import deployment_parameters, deployments
from tasks.publish import EVENT_READY, RESOURCE_PREFIX
from tasks.pipeline_spec import PipelineSpec


def test_the_kimi_deployment_is_kimi_k2_5_at_a_pinned_revision_on_eight_gpus():
    spec = PipelineSpec.model_validate(deployment_parameters("kimi")["spec"])
    repo, _, revision = spec.model.removeprefix("hf://").partition("@")
    assert repo == "moonshotai/Kimi-K2.5" and len(revision) == 40 and int(revision, 16) >= 0
    assert spec.layer_ids == (2, 30, 58, 61)
    assert spec.engine.tensor_parallel_size == 8 and spec.gpus == 8
    assert spec.runner.value == "docker" and spec.publish_to.startswith("s3://")


def test_the_kimi_deployment_runs_nightly_in_an_explicit_timezone_one_run_at_a_time():
    kimi = deployments()["kimi"]
    [schedule] = kimi["schedules"]
    assert schedule["cron"] and schedule["timezone"]
    assert kimi["concurrency_limit"]["limit"] == 1
    assert kimi["work_pool"]["name"] == "gpu"


def test_the_tiny_deployment_is_the_embedded_default():
    spec = PipelineSpec.model_validate(deployment_parameters("tiny")["spec"])
    assert spec.runner.value == "local" and spec.device.value == "cpu" and spec.engine.name.value == "vllm"
    assert not spec.model.startswith(("hf://", "s3://")) and spec.publish_to is None
    assert deployments()["tiny"]["work_pool"]["name"] == "cpu"


def test_the_demo_makes_the_model_where_the_tiny_deployment_reads_it():
    from flows.demo import tiny_spec

    assert tiny_spec() == deployment_parameters("tiny")["spec"]


def test_the_train_deployment_triggers_on_the_dataset_ready_event():
    [trigger] = deployments()["train"]["triggers"]
    assert trigger["expect"] == [EVENT_READY]
    assert trigger["match"]["prefect.resource.id"] == RESOURCE_PREFIX + "*"
    assert set(trigger["parameters"]) == {"dataset", "fingerprint"}


def test_the_range_deployment_runs_the_extract_shards_flow_on_the_gpu_pool():
    gpu = deployments()["gpu"]
    assert gpu["entrypoint"] == "flows/extract_shards.py:extract_shards"
    assert gpu["work_pool"]["name"] == "gpu"
    from tasks.pipeline_spec import DEFAULT_RANGE_DEPLOYMENT

    assert DEFAULT_RANGE_DEPLOYMENT == "extract-shards/gpu"


def test_the_fleet_deployment_fans_kimi_out_from_a_pool_without_gpus():
    fleet = deployments()["kimi-fleet"]
    spec = PipelineSpec.model_validate(fleet["parameters"]["spec"])
    kimi = PipelineSpec.model_validate(deployment_parameters("kimi")["spec"])
    assert spec.fans_out and spec.fan_out.deployment == "extract-shards/gpu"
    assert spec.model_copy(update={"ranges_in_flight": 1}) == kimi, "the same extraction as extract/kimi"
    assert fleet["work_pool"]["name"] != "gpu", "a parent on a GPU host's only slot would wait forever"
