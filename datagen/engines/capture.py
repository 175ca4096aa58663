"""The capture's per-step work, in torch alone (no vLLM): the worker extension
(datagen.engines.vllm_worker) feeds it each step's aux hidden states.

A group's shards are announced first (which requests make which shard; shard k is
written by tensor-parallel rank k mod TP). Each step's states of this rank's
requests are staged into buffers preallocated once (the step's token budget x
layers x hidden, in the storage dtype), with statistics and fp8 quantization
computed in float32 chunks of a fixed workspace, then copied into pinned host
memory on a side stream: a ring over one buffer of the rank's host budget, pinned
when the engine starts. A packer thread moves each request's piece from the ring
into its shard's file image (``datagen.data.shards.image``: laid out before any state
exists, so pieces go to their place in any order) and frees the ring at once: the
ring never holds a shard, whatever the shard's size. A shard's image goes to the
writer threads the moment its last piece is in; they hash and write it while the
engine computes on. A step waits (backpressure) only while the ring is full and the
packer has pieces to free; the packer waits only while the images' budget is spent
and a write that returns one is on its way.

What a step hands the capture is one ``StepRows``, whatever the model runner: the V1
runner's is made by ``datagen.engines.capture_rows.step_rows_v1``, Model Runner V2's by
``datagen.engines.capture_v2.step_rows_v2``; everything after that is shared. The host ring is
``datagen.engines.capture_host``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from datagen.data.shards.format import FP8, STORAGE_DTYPES, TORCH_DTYPES, ShardJob
from datagen.data.shards.kernels import quantize_into, stats_into, work_rows
from datagen.data.shards.writer import writer_rank
from datagen.engines.capture_host import HostArena, HostBlock
from datagen.engines.capture_pack import Chunk, Packer
from datagen.engines.capture_rows import StepRows, runner_prompt, step_rows_v1
from datagen.engines.messages import CaptureReply
from datagen.engines.vllm_settings import CaptureConfig


@dataclass
class _RequestStates:
    shard: int
    position: int  # row within the shard
    expected: int  # prompt tokens
    chunks: list[Chunk] = field(default_factory=list)  # a loose request's (a shard's go to the packer)
    tokens: int = 0


@dataclass
class _Shard:
    job: ShardJob
    requests: list[str]  # external ids, row order
    remaining: int


class Capture:
    """Per-runner capture state: every rank captures the requests of the shards it writes."""

    def __init__(self, runner, cfg: CaptureConfig, hidden_size: int, rank: int = 0, world: int = 1):
        """``runner``: what the capture reads of vLLM's model runner: ``device``; for ``on_step`` and
        ``on_request`` (the V1 runner, the public path's shim) also ``input_batch.req_ids`` and
        ``requests`` (each with ``prompt_token_ids``). ``on_rows`` reads only ``device``."""
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
            self.stats = torch.empty((M, 3, L), dtype=torch.float32, device=self.device)
            self.scales = torch.empty((M, L), dtype=torch.float32, device=self.device) if self.fp8 else None
        self.work = torch.empty((work_rows(hidden_size, M), hidden_size), dtype=torch.float32, device=self.device)
        self.read_done = None  # CUDA: the capture's kernels have read the last step's states
        self.requests: dict[str, _RequestStates] = {}  # external id -> states (announced, this rank's)
        self.others: set[str] = set()  # announced, written by another rank
        self.shards: dict[int, _Shard] = {}
        self.internal: dict[str, str | None] = {}  # engine-core id -> external id (None: not ours)
        self.steps = 0
        self.announced = False  # a shard map has come (Model Runner V2's start-up steps come before any)
        self.paused = False  # benches: the worker reads no step while set (datagen_capture_pause)
        # the pinned host memory of the steps' copies (CUDA; on the CPU the staged step is the copy)
        self.arena = HostArena(cfg.host_budget_bytes if self.cuda else 0, pin=self.cuda)
        self.backpressure_s = 0.0
        # each engine step, for profiles (datagen_step_trace); bounded: (start, end of the model
        # runner's execute_model, tokens, end of the capture's own work, CUDA events before the
        # forward, after it and after the capture's kernels when DATAGEN_GPU_STEP_TIMES=1, else None)
        self.trace: collections.deque = collections.deque(maxlen=1 << 16)
        self.packer = Packer(cfg.image_budget_bytes, cfg.writers)

    # --- the shard map ----------------------------------------------------------------------
    def announce(self, wires: list[dict]) -> None:
        """A group's shards, before its requests: which requests make which shard, who writes it.
        The previous group's requests have all finished (the driver drains between groups)."""
        self.announced = True
        self.others.clear()
        self.internal.clear()
        for d in wires:
            ids = list(d.pop("request_ids"))
            job = ShardJob.from_wire(d, self.cfg.shard)
            if writer_rank(job.index, self.world) != self.rank:
                self.others.update(ids)
                continue
            if len(ids) != len(job.input_ids):
                raise RuntimeError(f"shard {job.index}: {len(ids)} request ids for {len(job.input_ids)} rows")
            self.shards[job.index] = _Shard(job, ids, len(ids))
            for pos, (rid, toks) in enumerate(zip(ids, job.input_ids)):
                self.requests[rid] = _RequestStates(job.index, pos, len(toks))
            if not ids:
                self._queue(job.index)

    # requests outside every announced shard are kept (rank 0) until take_loose

    def _external(self, req_id: str, prompt_of: Callable[[str], Sequence[int] | None]) -> str | None:
        ext = self.internal.get(req_id, "")
        if ext != "":
            return ext
        # vLLM 0.32 suffixes the ids it is given ("<external id>-<8 chars>"); 0.24 keeps them
        cand = req_id if (req_id in self.requests or req_id in self.others) else req_id.rsplit("-", 1)[0]
        if cand in self.requests:
            st = self.requests[cand]
            prompt = prompt_of(req_id)
            ids = self.shards[st.shard].job.input_ids[st.position]
            if prompt is not None and (len(prompt) != len(ids) or list(prompt) != ids.tolist()):
                raise RuntimeError(f"row {self.shards[st.shard].job.sample_rows[st.position]}: the engine's prompt "
                                   "tokens differ from the row's tokens")
            ext = cand
        elif cand in self.others:
            ext = None
        elif self.rank == 0:  # not in any shard (a bench's own requests): kept apart, for take_loose
            self.requests[req_id] = _RequestStates(-1, -1, -1)
            ext = req_id
        else:
            ext = None
        self.internal[req_id] = ext
        return ext

    # --- per step -------------------------------------------------------------------------
    def on_step(self, scheduler_output, aux_hidden_states) -> None:
        """A V1 runner's step (its ``execute_model_state``'s scheduler output and aux states)."""
        rows = step_rows_v1(self.runner, scheduler_output, aux_hidden_states)
        if rows is not None:
            self.on_rows(rows)

    def on_rows(self, rows: StepRows) -> None:
        """A step's states, from any runner's adapter: this rank's requests are staged and handed out.

        Raises:
            RuntimeError: the engine returned states for other layers than the capture's.
        """
        aux_hidden_states = rows.aux
        if len(aux_hidden_states) != len(self.layer_ids):
            raise RuntimeError(f"engine returned {len(aux_hidden_states)} aux states for layers {self.layer_ids}")
        # this rank's requests: (external id, first token in the step, tokens), merged into runs
        mine, runs, pos = [], [], 0
        for req_id, c in zip(rows.req_ids, rows.counts):
            if c:
                ext = self._external(req_id, rows.prompt)
                if ext is not None:
                    mine.append((ext, pos, c))
                    if runs and runs[-1][1] == pos:
                        runs[-1][1] = pos + c
                    else:
                        runs.append([pos, pos + c])
            pos += c
        self.steps += 1
        if mine:
            self._capture_runs(aux_hidden_states, mine, runs)

    def on_request(self, req_id: str, states: torch.Tensor) -> None:
        """A whole request's states [T, L, H] at once (the public-API path: vLLM's
        extract_hidden_states drafter stored them in its KV cache, the connector read them out when
        the request finished). Staged, handed out and written exactly as a step's."""
        if states.shape[1] != len(self.layer_ids):
            raise RuntimeError(f"engine returned {states.shape[1]} aux states for layers {self.layer_ids}")
        ext = self._external(req_id, runner_prompt(self.runner))
        if ext is None:
            return
        # in pieces of at most the step budget: the device buffers hold that many rows (a prompt
        # may be longer than a step, whose chunks the internal path sees one by one)
        n, step = int(states.shape[0]), max(1, int(self.cfg.max_tokens))
        for a in range(0, n, step):
            piece = states[a:a + step]
            k = int(piece.shape[0])
            self._capture_runs([piece[:, j] for j in range(piece.shape[1])], [(ext, 0, k)], [[0, k]])

    def _capture_runs(self, aux_hidden_states, mine, runs) -> None:
        """Stage the rows ``runs`` of the per-layer states (this rank's requests ``mine``: external
        id, first row, rows), copy them to the host and hand each request its piece."""
        m = sum(c for _, _, c in mine)
        L, H = len(self.layer_ids), self.hidden
        if self.cuda:
            # The capture's kernels run on its own stream, after the forward: the step's sampling
            # (on vLLM's stream) does not wait for them, so they overlap the gap until the next
            # step. The next forward waits for them (before_step), as it may overwrite the states
            # (CUDA graphs' static buffers); the caching allocator keeps the states' memory until
            # this stream has read it (record_stream). Staging and copies share this one stream,
            # so a step's staging starts after the previous step's copy out of the buffers.
            cur = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(cur)
            for h in aux_hidden_states:
                h.record_stream(self.stream)
            staged, stats = self.staged[:m], self.stats[:m]  # contiguous: one copy to the host
            scales = self.scales[:m] if self.fp8 else None
        else:  # new memory each step: these are the chunks the writer packs
            staged = torch.empty((m, L, H), dtype=self.store)
            stats = torch.empty((m, 3, L), dtype=torch.float32)
            scales = torch.empty((m, L), dtype=torch.float32) if self.fp8 else None
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            self._stage(aux_hidden_states, runs, staged, stats, scales)
        block = None
        if self.cuda:
            self.read_done = torch.cuda.Event()
            self.read_done.record(self.stream)
            region, (host, host_stats, host_scale), waited = self.arena.take(
                [staged, stats, scales], self.packer.busy)
            self.backpressure_s += waited
            block = HostBlock(self.arena, region, len(mine))
            with torch.cuda.stream(self.stream):
                host.copy_(staged, non_blocking=True)
                host_stats.copy_(stats, non_blocking=True)
                if host_scale is not None:
                    host_scale.copy_(scales, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            host, host_stats, host_scale, event = staged, stats, scales, None
        self._hand_out(mine, host, host_stats, host_scale, event, block)

    def before_step(self) -> None:
        """Called before each forward: it waits (on the GPU) until the capture has read the last
        step's states."""
        if self.read_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self.read_done)
            self.read_done = None

    def _stage(self, aux_hidden_states, runs, staged, stats, scales) -> None:
        """The step's states of this rank's requests (``runs`` of the batch) into ``staged``, with
        their statistics (and fp8 scales)."""
        for j, h in enumerate(aux_hidden_states):
            off = 0
            for a, b in runs:
                x = h[a:b]
                k = b - a
                if self.fp8:
                    quantize_into(x, staged[off:off + k, j], scales[off:off + k, j], stats[off:off + k, :, j].t(),
                                  self.work)
                else:
                    staged[off:off + k, j].copy_(x)
                    stats_into(staged[off:off + k, j], stats[off:off + k, :, j].t(), self.work)
                off += k

    def _hand_out(self, mine, host, host_stats, host_scale, event, block) -> None:
        """Each request's piece of the step's host copy, to the packer (a loose request keeps its
        own); a shard whose last request is complete is closed."""
        off = 0
        for ext, _, c in mine:
            st = self.requests[ext]
            chunk = Chunk(host[off:off + c], host_stats[off:off + c],
                           None if host_scale is None else host_scale[off:off + c], event, block)
            off += c
            if st.shard < 0:
                st.chunks.append(chunk)
                st.tokens += c
                continue
            if st.tokens + c > st.expected:
                raise RuntimeError(f"request {ext}: captured {st.tokens + c} tokens, prompt has {st.expected}")
            sh = self.shards[st.shard]
            self.packer.put(sh.job, st.position, st.tokens, chunk)
            st.tokens += c
            if st.tokens == st.expected:
                sh.remaining -= 1
                if sh.remaining == 0:
                    self._queue(st.shard)

    # --- shards ---------------------------------------------------------------------------
    def _queue(self, index: int) -> None:
        """The shard's last request is captured: its close follows its pieces to the packer."""
        sh = self.shards.pop(index)
        for rid in sh.requests:
            del self.requests[rid]
        self.packer.close(sh.job)

    def collect(self, wait: bool) -> CaptureReply:
        """What was written (and what failed) since the last call; ``wait``: after every queued write."""
        if wait:
            self.packer.join()
        done, errors = self.packer.take()
        return CaptureReply(rank=self.rank, records=tuple(r.model_copy(update={"written_by": self.rank}) for r in done),
                            errors=tuple(errors), pending_requests=len(self.requests),
                            pending_shards=tuple(sorted(self.shards)), backpressure_s=self.backpressure_s,
                            host_outside_bytes=self.arena.outside_bytes)



    def take_loose(self, external_id: str) -> list[Chunk]:
        """The chunks of a request that no announced shard holds (exact id, or with vLLM's suffix)."""
        hits = [r for r, st in self.requests.items() if st.shard < 0 and (r == external_id or
                                                                          r.rsplit("-", 1)[0] == external_id)]
        if len(hits) != 1:
            raise RuntimeError(f"request {external_id}: {len(hits)} captured requests match")
        st = self.requests.pop(hits[0])
        out = []
        for ch in st.chunks:
            if ch.event is not None:
                ch.event.synchronize()
            if ch.block is not None:
                if ch.block.region is not None:  # the ring's piece is reused once released: copy it out
                    ch = Chunk(ch.host.clone(), ch.stats.clone(), None if ch.scale is None else ch.scale.clone(),
                                None, ch.block)
                ch.block.release()
            out.append(ch)
        return out

    def device_bytes(self) -> int:
        """GPU memory the capture holds (its preallocated buffers)."""
        return sum(t.numel() * t.element_size() for t in (getattr(self, "staged", None), getattr(self, "stats", None),
                                                          getattr(self, "scales", None), self.work) if t is not None)

