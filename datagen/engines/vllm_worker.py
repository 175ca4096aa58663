"""The capture, inside vLLM's worker process.

Importing this module (vLLM does, when it resolves ``worker_extension_cls``)
installs the ``capture-on-load`` patch on the model runner classes: once the
model is loaded, and before warm-up and compilation, the runner is told to
return aux hidden states for the spec's layers, its capture buffers are
allocated, and its ``execute_model`` is wrapped to read the states from
``execute_model_state`` after each step.

The driver announces each group of shards once, before the group's requests
(``datagen_announce``: every shard's job and request ids). From then on the pipe
carries only the finished records, fetched every second (``datagen_collect``;
the steps do not wait for it): each step's states are staged into preallocated
device buffers (statistics and fp8 quantization in float32 chunks of a fixed
workspace), copied on a side stream into a ring of pinned host memory allocated
once (the next step is not held up), and sliced per request from
``scheduler_output.num_scheduled_tokens`` in ``input_batch.req_ids`` order.
On Model Runner V2 (where capture_paths.runner_choice leaves vLLM its runner:
verified on an H200 with vLLM 0.24.0, TP1, Llama, compiled, bitwise equal to
V1; TP > 1, eager and other architectures not verified) the same capture reads
V2's own ``execute_model_state`` through datagen.engines.capture_v2; the runner
is told apart by its class. A shard is queued for writing the moment its
last request's last chunk is captured; writer threads pack, hash and write it.
Every tensor-parallel rank holds the full states after the all-reduce, so each
rank captures and writes its share: shard k by rank k mod TP.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

from datagen import settings
from datagen.engines.capture import Capture
from datagen.engines.capture_rows import StepRows, step_rows_v1
from datagen.engines.capture_paths import runner_version
from datagen.engines.capture_v2 import step_rows_v2
from datagen.engines.vllm_ranks import tp_rank as _tp_rank
from datagen.engines.vllm_settings import INTERNAL, CaptureConfig

log = logging.getLogger("datagen.engines.vllm_worker")


def _runner_class(runner) -> str:
    """The runner's class, module and name (what ``runner_version`` reads)."""
    cls = type(runner)
    return f"{cls.__module__}.{cls.__qualname__}"


def _read_v1(runner, scheduler_output) -> StepRows | None:
    """The V1 runner's step: its ``execute_model_state`` holds the step's scheduler output."""
    state = getattr(runner, "execute_model_state", None)
    return None if state is None else step_rows_v1(runner, state.scheduler_output, state.aux_hidden_states)


def _read_v2(runner, scheduler_output) -> StepRows | None:
    """Model Runner V2's step: its own ``execute_model_state`` (input batch and aux states)."""
    state = getattr(runner, "execute_model_state", None)
    return None if state is None else step_rows_v2(state, scheduler_output)


_READERS = {"v1": _read_v1, "v2": _read_v2}


def _enable_capture(runner) -> None:
    cfg = CaptureConfig.from_vllm_config(runner.vllm_config)
    if cfg is None or cfg.path != INTERNAL:  # the public path: vLLM's drafter and the KV connector capture
        return
    from vllm.model_executor.models.interfaces import supports_eagle3

    model = runner.get_model()
    if not supports_eagle3(model):
        raise RuntimeError(f"{type(model).__name__} does not expose aux hidden states (SupportsEagle3)")
    layer_ids = cfg.layer_ids
    model.set_aux_hidden_state_layers(layer_ids)
    runner.use_aux_hidden_state_outputs = True
    rank, world = _tp_rank()
    capture = Capture(runner, cfg, int(runner.model_config.get_hidden_size()), rank, world)
    runner._datagen_capture = capture  # noqa: SLF001
    original = runner.execute_model
    version = runner_version(_runner_class(runner))
    read = _READERS[version]

    timed = capture.cuda and settings.gpu_step_times()  # profiles only (bench/gpu)

    def event(stream=None):
        if not timed:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    @functools.wraps(original)
    def execute_model(scheduler_output, *args, **kwargs):
        capture.before_step()  # the forward must not overwrite states the capture still reads
        # V2's own dummy runs (profile, CUDA-graph capture, DP padding) go through
        # execute_model(dummy_run=True) with made-up requests (0.24.0 gpu/model_runner.py:562-568), and
        # its start-up warm-up (0.24.0 gpu/warmup.py warmup_kernels, from gpu_worker.py:733-735) runs
        # real steps of made-up requests ("_warmup_*") before the driver has announced any shard:
        # nothing to capture in either (kept, they would hold the host ring's first piece forever)
        if version == "v2" and (kwargs.get("dummy_run", len(args) > 1 and bool(args[1])) or not capture.announced):
            return original(scheduler_output, *args, **kwargs)
        if capture.paused:  # a bench's plain passes on this engine (datagen_capture_pause)
            return original(scheduler_output, *args, **kwargs)
        e0 = event()
        t0 = time.perf_counter()
        out = original(scheduler_output, *args, **kwargs)
        t1 = time.perf_counter()
        e1 = event()
        rows = read(runner, scheduler_output)
        if rows is not None:
            capture.on_rows(rows)
        # the capture's kernels run on its own stream: the third event ends them there
        capture.trace.append((t0, t1, int(scheduler_output.total_num_scheduled_tokens), time.perf_counter(),
                              e0, e1, event(capture.stream)))
        return out

    runner.execute_model = execute_model
    log.info("datagen capture on (rank %d of %d, model runner %s): layers %s, dtype %s, storage %s, %d writers, "
             "%.2f GiB of device buffers", rank, world, version, layer_ids, cfg.dtype, cfg.storage_dtype, cfg.writers,
             capture.device_bytes() / 2**30)


def _v2_may_capture(environ, cuda: bool) -> bool:
    """Whether Model Runner V2 may run the capture in this worker: DATAGEN_CAPTURE_RUNNER_V2=1, or on
    CUDA unless the engine pinned V1 (VLLM_USE_V2_MODEL_RUNNER=0, inherited from the driver)."""
    return bool(settings.capture_runner_v2(environ)) or (cuda and environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0")


def _install_capture_on_load() -> None:
    """Wrap load_model of every runner class vLLM may use here (idempotent). Model Runner V2's only
    where it may run the capture (its module is not imported otherwise): DATAGEN_CAPTURE_RUNNER_V2=1,
    or on CUDA where the engine left vLLM its runner (capture_paths.runner_choice; where it pins V1,
    the workers inherit VLLM_USE_V2_MODEL_RUNNER=0)."""
    classes = []
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    classes.append(GPUModelRunner)
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        classes.append(CPUModelRunner)
    except ImportError:
        pass
    if _v2_may_capture(os.environ, torch.cuda.is_available()):
        # V2's CPU runner (vllm.v1.worker.cpu.model_runner) inherits this load_model
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as ModelRunnerV2

        classes.append(ModelRunnerV2)
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
        capture = getattr(self.model_runner, "_datagen_capture", None)
        if capture is None:
            cfg = CaptureConfig.from_vllm_config(self.vllm_config)
            if cfg is not None and cfg.path != INTERNAL:
                from datagen.engines.public_capture import worker_capture

                capture = worker_capture()
        return capture

    def datagen_model_runner(self) -> str:
        """The model runner class this worker runs (module and name)."""
        return _runner_class(self.model_runner)

    def datagen_announce(self, shards: list[dict]) -> dict | None:
        """A group's shards (job wires with their request ids), before its requests are added;
        replies with what ``datagen_collect`` would (one RPC per group)."""
        capture = self._datagen()
        if capture is None:
            return None
        capture.announce(shards)
        return capture.collect(False).to_wire()

    def datagen_collect(self, wait: bool = False) -> dict | None:
        capture = self._datagen()
        return None if capture is None else capture.collect(wait).to_wire()

    def datagen_capture_pause(self, paused: bool = True) -> bool:
        """Benches only: while paused, the internal capture reads no step (the model still returns
        its aux states), so plain prefill can be timed on the started capture engine. Returns
        whether this worker has an internal capture to pause."""
        capture = getattr(self.model_runner, "_datagen_capture", None)
        if capture is None:
            return False
        capture.paused = bool(paused)
        return True

    def datagen_step_trace(self) -> list | None:
        """The engine steps since the last call (rank 0), for profiles: (start, end of execute_model,
        tokens, end of the capture, GPU ms of the forward, GPU ms of the capture's kernels); the
        times are this process's perf_counter, the GPU times None unless
        DATAGEN_GPU_STEP_TIMES=1 (CUDA); None without the internal capture (the public path)."""
        capture = getattr(self.model_runner, "_datagen_capture", None)
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
