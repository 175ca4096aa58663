"""Every environment variable datagen reads, in one place, read when asked (not at import)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return default if raw in (None, "") else int(raw)


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return default if raw in (None, "") else float(raw)


def cpu_kvcache_gib() -> int:
    """DATAGEN_CPU_KVCACHE_GIB: KV cache of the CPU engine in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    return _int("DATAGEN_CPU_KVCACHE_GIB", 2)


def gpu_memory_utilization() -> float:
    """DATAGEN_GPU_MEMORY_UTILIZATION: vLLM's share of GPU memory (on CPU: of RAM)."""
    return _float("DATAGEN_GPU_MEMORY_UTILIZATION", 0.85 if _cuda() else 0.1)


def enforce_eager() -> bool:
    """DATAGEN_ENFORCE_EAGER: 1 to run vLLM without torch.compile / CUDA graphs."""
    return os.environ.get("DATAGEN_ENFORCE_EAGER", "0") == "1"


def cpu_engine_in_process() -> bool:
    """DATAGEN_CPU_ENGINE_IN_PROCESS: 0 to start the CPU engine (tensor parallel 1) in vLLM's own
    process layout, an engine-core process and a worker process beside the caller, instead of in the
    caller's process (datagen.engines.vllm_devices.set_process_env)."""
    return os.environ.get("DATAGEN_CPU_ENGINE_IN_PROCESS", "1") != "0"


def direct_io() -> bool:
    """DATAGEN_DIRECT_IO: 0 to write shards through the page cache instead of with O_DIRECT
    (filesystems without direct I/O fall back to that by themselves)."""
    return os.environ.get("DATAGEN_DIRECT_IO", "1") != "0"


def stream_writes() -> bool:
    """DATAGEN_STREAM_WRITES: 0 to write each shard only once its last row is in, instead of from
    its start while it fills (for comparisons; the bytes are the same either way)."""
    return os.environ.get("DATAGEN_STREAM_WRITES", "1") != "0"


def gpu_step_times() -> bool:
    """DATAGEN_GPU_STEP_TIMES: 1 to time each engine step's forward and capture on the GPU (CUDA
    events; for profiles, with DATAGEN_STEP_TRACE). Off by default: it adds events per step."""
    return os.environ.get("DATAGEN_GPU_STEP_TIMES", "0") == "1"


def step_trace_path() -> Path | None:
    """DATAGEN_STEP_TRACE: a file the vLLM engine writes its steps to when the run's rows are done,
    for profiles (``bench/gpu/run.py --trace``): each step's start and end, its tokens and the end of
    its capture, on the wall clock (datagen.engines.step_trace). Unset: no file."""
    raw = os.environ.get("DATAGEN_STEP_TRACE")
    return Path(raw) if raw else None


def capture_runner_v2(environ: Mapping[str, str] | None = None) -> bool | None:
    """DATAGEN_CAPTURE_RUNNER_V2: the model runner the internal capture may run on (CUDA). 1: Model
    Runner V2 allowed anywhere (vLLM picks; a warning where the V2 capture is not verified); 0: V1
    pinned everywhere; unset (None): datagen.engines.releases.V2_CAPTURE_VERIFIED decides (vLLM's
    own choice where the V2 capture was verified: 0.24.0, tensor_parallel_size 1, LlamaForCausalLM;
    V1 pinned elsewhere). Any other value pins V1. ``environ``: read instead of the process's
    environment."""
    env = os.environ if environ is None else environ
    raw = (env.get("DATAGEN_CAPTURE_RUNNER_V2") or "").strip()
    return None if not raw else raw == "1"


def model_cache() -> Path:
    """DATAGEN_MODEL_CACHE: the shared model cache for downloads."""
    return Path(os.environ.get("DATAGEN_MODEL_CACHE", Path.home() / ".cache" / "datagen" / "models"))


def spool_dir() -> Path | None:
    """DATAGEN_SPOOL: this host's local directory where a fanned-out range writes its shards before
    they are uploaded to the dataset's bucket (fast local disk); unset: the spec's output."""
    raw = os.environ.get("DATAGEN_SPOOL")
    return Path(raw) if raw else None


def lost_host_window_s(default: int) -> int:
    """DATAGEN_LOST_HOST_WINDOW_S: seconds without a flow-run heartbeat after which the lost-host
    automation marks the run Crashed (read when the automation is deployed)."""
    return _int("DATAGEN_LOST_HOST_WINDOW_S", default)


def progress_interval_s() -> float:
    """DATAGEN_PROGRESS_INTERVAL: seconds between progress log lines when not on a terminal."""
    return _float("DATAGEN_PROGRESS_INTERVAL", 10.0)


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# -- S3 transfers (datagen.storage.s3). Endpoint, region and credentials are NOT read here: boto3 reads
# the standard AWS variables itself (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_REGION /
# AWS_DEFAULT_REGION, AWS_PROFILE, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, instance roles), so
# every credential source boto3 supports works and no secret passes through datagen.


def s3_chunk_bytes() -> int:
    """DATAGEN_S3_CHUNK_MB: multipart part size (and ranged-download chunk) in MiB."""
    return _int("DATAGEN_S3_CHUNK_MB", 64) * 1024 * 1024


def s3_max_concurrency() -> int:
    """DATAGEN_S3_MAX_CONCURRENCY: parallel part transfers in flight across all files."""
    return _int("DATAGEN_S3_MAX_CONCURRENCY", 16)


def s3_max_attempts() -> int:
    """DATAGEN_S3_MAX_ATTEMPTS: attempts per S3 request (botocore standard retry mode)."""
    return _int("DATAGEN_S3_MAX_ATTEMPTS", 5)


def s3_connect_timeout_s() -> float:
    """DATAGEN_S3_CONNECT_TIMEOUT: seconds to open a connection to the S3 endpoint."""
    return _float("DATAGEN_S3_CONNECT_TIMEOUT", 10.0)


def s3_read_timeout_s() -> float:
    """DATAGEN_S3_READ_TIMEOUT: seconds without a byte from the S3 endpoint before a retry."""
    return _float("DATAGEN_S3_READ_TIMEOUT", 60.0)


def real_kimi_dir() -> Path:
    """DATAGEN_REAL_KIMI: the directory of Moonshot's real Kimi tokenizer files (``tiktoken.model``,
    ``tokenizer_config.json``, the real chat templates) that tests and ``bench/planning.py`` hold
    the project's Kimi tokenizer against; default ``shared/real-kimi`` beside the repository."""
    raw = os.environ.get("DATAGEN_REAL_KIMI")
    return Path(raw) if raw else Path(__file__).resolve().parents[2] / "shared" / "real-kimi"


def planning_workers() -> int | None:
    """DATAGEN_PLANNING_WORKERS: processes that plan a dataset (tokenize its rows); unset: every core
    this process may run on."""
    raw = os.environ.get("DATAGEN_PLANNING_WORKERS")
    return int(raw) if raw else None
