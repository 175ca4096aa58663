"""The vLLM engine, driver side.

Starts an offline ``vllm.LLM`` with the capture worker extension and the
settings that keep capture correct, runs each shard's prompts as one
``generate`` call (prefill only), and asks the worker to write the shard.
One ``generate`` per shard makes batch composition a function of the shard's
rows alone, so a resumed run computes bit-identical states (docs/decisions.md).
"""

from __future__ import annotations

import logging
import os

from datagen import settings
from datagen.contract import ShardRecord
from datagen.engines import patches
from datagen.engines.base import Engine
from datagen.errors import CannotRunHereError, EngineUnsupportedError, ModelError, StorageError
from datagen.modelinfo import ModelInfo
from datagen.shards import ShardJob

log = logging.getLogger(__name__)

EXTENSION = "datagen.engines.vllm_worker.CaptureExtension"


class VllmEngine(Engine):
    name = "vllm"

    def __init__(self, info: ModelInfo, *, layer_ids: tuple[int, ...], dtype: str, max_seq_len: int,
                 tensor_parallel_size: int = 1, max_num_batched_tokens: int = 8192,
                 max_num_seqs: int = 256, trust_remote_code: bool = False):
        self.version = patches.check_vllm_version()
        self.info = info
        self.layer_ids = tuple(layer_ids)
        self.dtype = dtype
        self.max_seq_len = max_seq_len
        self.tp = tensor_parallel_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.trust_remote_code = trust_remote_code
        self.llm = None
        self._pending: list[ShardRecord] = []

    # --- life cycle -----------------------------------------------------------------------
    def engine_kwargs(self) -> dict:
        """The LLM arguments. Each one that keeps capture correct is named in patches.PATCHES."""
        max_model_len = self.max_seq_len + 1  # the prompt plus the one sampled token
        if self.info.max_position_embeddings and max_model_len > self.info.max_position_embeddings:
            max_model_len = self.info.max_position_embeddings
        return dict(
            model=self.info.path,
            skip_tokenizer_init=True,  # prompts arrive as token ids
            dtype=self.dtype,
            tensor_parallel_size=self.tp,
            max_model_len=max_model_len,
            enable_prefix_caching=False,  # cached prefixes would never be recomputed
            async_scheduling=False,  # one step in flight: execute_model_state is this step's
            enable_chunked_prefill=True,
            max_num_batched_tokens=max(self.max_num_batched_tokens, 16),
            max_num_seqs=self.max_num_seqs,
            worker_extension_cls=EXTENSION,
            additional_config={"datagen_capture": {"layer_ids": list(self.layer_ids), "dtype": self.dtype}},
            trust_remote_code=self.trust_remote_code,
            gpu_memory_utilization=settings.gpu_memory_utilization(),
            enforce_eager=settings.enforce_eager(),
            seed=0,
        )

    def start(self) -> None:
        import torch

        on_cuda = torch.cuda.is_available()
        if on_cuda and torch.cuda.device_count() < self.tp:
            raise CannotRunHereError(
                f"tensor parallel size {self.tp} needs {self.tp} GPUs; {torch.cuda.device_count()} visible",
                hint="lower engine.tensor_parallel_size or run on a larger node",
            )
        if not on_cuda and self.tp > 1:
            raise CannotRunHereError(
                f"tensor parallel size {self.tp} asks for GPUs; this machine has none",
                hint="use tensor_parallel_size 1 on the CPU engine",
            )
        # DeepSeek decoders (Kimi's too) return id N on 0.24.0 through patch deepseek-final-layer-aux
        patches.check_capturable(self.info.model_type, self.info.num_hidden_layers, self.layer_ids, self.version,
                                 model=self.info.path)
        if on_cuda:
            # patch pin-v1-model-runner: Model Runner V2 has no execute_model_state.
            if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":
                raise EngineUnsupportedError(
                    "VLLM_USE_V2_MODEL_RUNNER=1: the capture reads the V1 model runner's execute_model_state",
                    hint="unset VLLM_USE_V2_MODEL_RUNNER or set it to 0",
                )
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
            # CUDA is initialized in this process (device checks, the reference engine): its
            # engine processes must be spawned, not forked.
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        else:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.cpu_kvcache_gib()))
        from vllm import LLM

        kwargs = self.engine_kwargs()
        log.info("starting vLLM %s: %s", self.version,
                 {k: v for k, v in kwargs.items() if k not in ("additional_config",)})
        try:
            self.llm = LLM(**kwargs)
        except (ValueError, OSError) as e:
            raise ModelError(f"vLLM cannot load {self.info.path}: {e}", hint="check the model files and settings") from e

    def submit(self, job: ShardJob) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        assert self.llm is not None, "start() first"
        if job.sample_rows:
            prompts = [TokensPrompt(prompt_token_ids=ids.tolist()) for ids in job.input_ids]
            params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
            request_ids = [o.request_id for o in outputs]
        else:
            request_ids = []
        wrote = self.llm.collective_rpc("datagen_write_shard", args=(job.to_wire(), request_ids))
        if not any(wrote):
            raise RuntimeError("no worker took the shard: the capture extension is not active on rank 0")
        self._pending.extend(self._collect(wait=False))

    def _collect(self, *, wait: bool) -> list[ShardRecord]:
        replies = [r for r in self.llm.collective_rpc("datagen_collect", args=(wait,)) if r is not None]
        records = []
        for reply in replies:
            if reply["errors"]:
                first = reply["errors"][0]
                if "No space left" in first or "OSError" in first:
                    raise StorageError(f"writing a shard failed: {first.splitlines()[0]}",
                                       hint="free space at the output location, then re-run to resume")
                raise RuntimeError("writing a shard failed in the worker:\n" + "\n".join(reply["errors"]))
            records.extend(ShardRecord.model_validate(r) for r in reply["records"])
        return records

    def completed(self) -> list[ShardRecord]:
        done, self._pending = self._pending, []
        return done

    def finish(self) -> list[ShardRecord]:
        return self.completed() + self._collect(wait=True)

    def close(self) -> None:
        if self.llm is not None:
            try:
                self.llm.llm_engine.engine_core.shutdown()
            except Exception:  # best effort: the process is ending anyway
                pass
            self.llm = None

    def describe(self) -> dict:
        return {"name": "vllm", "version": self.version, "patches": patches.patch_names()}
