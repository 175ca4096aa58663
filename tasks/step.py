"""The step task: every task that runs a step program is this one task under the step's name.

``step_task("plan")`` runs `datagen plan`, ``step_task("extract-range", cache_policy=STEP_CACHE)``
one shard range, and so on. The task writes the call's spec (the step's ``Spec``, whole) to a file of its own, runs
``datagen <step> --spec FILE`` through the runner the pipeline spec names (a local
subprocess or a container, ``tasks/runners.py``), streams every output line into the run log (and
onto the run's progress bar), and returns the step's own result type (``datagen.steps.result_type``:
``PlanResult``, ``ExtractResult``, ...), parsed from its result line.

Retries: transient faults only (``tasks/retries.py``). Caching: one policy, ``STEP_CACHE``: the
cache key is the task's ``cache_key`` argument, which the flow computes from what decides the
step's output (each ``*_cache_key`` function says what its key holds; docs/orchestration.md), with
a digest of the result type's schema after it (a record of another shape is never read back). A
call without a key is not cached. What is cached is the typed result.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE, CacheKeyFnPolicy, CachePolicy
from prefect.context import TaskRunContext
from prefect.runtime import flow_run
from pydantic import BaseModel, TypeAdapter

from datagen.steps import result_type
from tasks import artifacts
from tasks.mounts import mounts_for
from tasks.pipeline_spec import Runner
from tasks.results import parse_result, run_step
from tasks.retries import STEP_RETRY_POLICY
from tasks.runner_choice import make_runner
from tasks.runners import Mount, StepInvocation
from tasks.step_files import spec_file

# Cache records are JSON: readable, and they survive code moves.
RESULT_SERIALIZER = "json"


@dataclass(frozen=True)
class StepCall:
    """One run of a step program, as the step task receives it."""

    step: str  # the datagen command: "plan", "extract", "validate", ...; its Result is the task's result
    spec: dict[str, Any]  # the step's spec whole, as JSON (its `--spec FILE`); the task writes it and mounts it
    mounts: tuple[Mount, ...] = ()  # host paths the step reads or writes
    env: dict[str, str] = field(default_factory=dict)  # plain settings, may be logged
    secret_env_names: tuple[str, ...] = ()  # env vars passed through by name, never logged
    gpus: int = 0  # GPUs the step needs; > 0 picks the CUDA image of the docker runner
    # the CUDA image without a GPU: a step that describes the CUDA engine (its version is in every
    # fingerprint) but starts none: plan, finalize and assemble of a CUDA extraction
    cuda_image: bool = False
    known: dict[str, Any] = field(default_factory=dict)  # result fields the caller sets (a host path as given)
    label: str = ""  # what tells this call from the step's others (a shard range "A:B"): run name, progress item
    progress: UUID | None = None  # the run's progress bar (tasks/artifacts.py) whose item ``label`` it advances


def in_cuda_image(call: StepCall) -> bool:
    """The docker runner runs ``call`` in the CUDA image: it needs GPUs, or describes the CUDA engine."""
    return call.gpus > 0 or call.cuda_image


def _cache_key_argument(context, parameters: dict[str, Any]) -> str | None:
    """The ``cache_key`` argument, and the shape of the result a record under it holds.

    A record stores its value as JSON of the task's result type. When that type changes (a field,
    a name), an older record of the same key could not be read back as the new type: the key then
    changes with it, so such a record is simply not found and the step runs again.
    """
    key = parameters.get("cache_key")
    if key is None:
        return None
    call = parameters.get("call")
    if isinstance(call, StepCall):
        shape: Any = result_type(call.step)
    else:  # a fan-out task: its declared return type
        shape = typing.get_type_hints(context.task.fn).get("return", Any)
    return f"{key}-r{_result_schema_digest(shape)}"


@functools.cache
def _result_schema_digest(shape: Any) -> str:
    # The import path (a record names its type by it) and the JSON schema (fields, types, names).
    schema = TypeAdapter(shape).json_schema(mode="serialization")
    payload = json.dumps([_type_path(shape), schema], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def _type_path(shape: Any) -> str:
    if isinstance(shape, type):
        return f"{shape.__module__}.{shape.__qualname__}"
    return repr(shape)  # a union or other typing form: its repr names its members' import paths


# The one cache policy of the step tasks (and of the fan-out's tasks): the `cache_key` argument,
# and the shape of the result (above).
STEP_CACHE = CacheKeyFnPolicy(cache_key_fn=_cache_key_argument)


@task(name="step", cache_policy=NO_CACHE, **STEP_RETRY_POLICY)
def _step(call: StepCall, *, runner: Runner, cache_key: str | None = None) -> BaseModel:
    """`datagen <step>` through ``runner``; its result line as the step's ``Result``.

    Raises:
        tasks.errors.StepFailed: a non-zero exit (retried when transient).
        tasks.errors.StepResultMissing: exit 0 without a result line.
    """
    logger = get_run_logger()
    board = artifacts.board(call.progress)
    watch = board.line_watcher(call.label) if board is not None else None

    def log(line: str) -> None:
        logger.info("%s", line)
        if watch is not None:
            watch(line)

    with _spec_args(call) as (args, spec_mounts):
        invocation = StepInvocation(
            step=call.step,
            args=args,
            mounts=(*call.mounts, *spec_mounts),
            env=dict(call.env),
            secret_env_names=call.secret_env_names,
            gpus=call.gpus,
            labels=_labels(),
        )
        result = run_step(invocation, make_runner(runner, gpu=in_cuda_image(call)), log=log)
    if board is not None:
        board.set(call.label, 1.0, force=True)
    return parse_result({**result, **call.known}, result_type(call.step))


def step_task(name: str, *, cache_policy: CachePolicy = NO_CACHE, task_run_name: str | None = None):
    """The step task under ``name`` (the task's name in the UI, the API and the container labels).

    Args:
        cache_policy: ``STEP_CACHE`` to key it on its ``cache_key`` argument (its results are then
            persisted, as JSON); ``NO_CACHE``, the default, for a step that must always run.
        task_run_name: a template of its runs' names, e.g. ``"extract-range-{call.label}"``;
            None: Prefect's ``<name>-<random>``.
    """
    options: dict[str, Any] = dict(name=name, task_run_name=task_run_name, cache_policy=cache_policy)
    if cache_policy is not NO_CACHE:
        options.update(persist_result=True, result_serializer=RESULT_SERIALIZER)
    return _step.with_options(**options)


@contextlib.contextmanager
def _spec_args(call: StepCall) -> Iterator[tuple[tuple[str, ...], tuple[Mount, ...]]]:
    """The step's arguments (its spec file) and the mount of that file, which exists while the block runs."""
    with spec_file(call.spec) as path:
        yield ("--spec", str(path)), mounts_for(read_only=(path.parent,))


def _labels() -> dict[str, str]:
    """The task's name (a step's runs are told apart by it) and the flow run's id."""
    ctx = TaskRunContext.get()
    run_id = flow_run.get_id()
    return {
        **({"task": ctx.task.name} if ctx is not None else {}),
        **({"flow-run-id": str(run_id)} if run_id else {}),
    }
