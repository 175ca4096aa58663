"""What every step task shares: run a step through a runner, stream its output into the run log,
turn its outcome into a typed result or raise, and decide whether a failure is worth a retry.

A step failure raises ``StepFailed``; ``retry_if_transient`` (every task's ``retry_condition_fn``)
lets Prefect retry it only when the outcome was transient: the step exited with
``EXIT_TRANSIENT`` (75), or the infrastructure killed it (137, 143, docker's 125). Bad input,
"cannot run here", validation failures and crashes fail at once, with the step's own message.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from datagen.errors import (
    EXIT_BAD_INPUT, EXIT_CANNOT_RUN_HERE, EXIT_FAILED, EXIT_TRANSIENT, EXIT_VALIDATION, TransientError,
)
from tasks.pipeline_spec import Runner
from tasks.runners import Mount, StepInvocation, StepOutcome, StepRunner

T = TypeVar("T", bound=BaseModel)

# Retry policy of every step task: transient faults only (see retry_if_transient).
# Credentials a step may need, passed to it by name only (their values are never logged).
AWS_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
HUB_AND_AWS_CREDENTIAL_ENV = ("HF_TOKEN", *AWS_CREDENTIAL_ENV)

STEP_RETRIES = 3
STEP_RETRY_DELAYS_S = [5, 30, 120]  # a storage hiccup passes in seconds, a lost node in minutes
STEP_RETRY_JITTER = 0.3

_EXIT_MEANINGS = {
    EXIT_FAILED: "the step crashed",
    EXIT_BAD_INPUT: "bad input",
    EXIT_CANNOT_RUN_HERE: "cannot run here",
    EXIT_VALIDATION: "validation failed",
    EXIT_TRANSIENT: "transient fault",
    125: "the container could not run",
    137: "killed (SIGKILL, e.g. out of memory)",
    143: "killed (SIGTERM)",
    -9: "killed (SIGKILL, e.g. out of memory)",
    -15: "killed (SIGTERM)",
}


class StepFailed(RuntimeError):
    """A step program ended with a non-zero exit code.

    Attributes:
        step: the datagen command ("extract", "validate", ...).
        exit_code: its exit status (negative: killed by that signal).
        retryable: True for a transient fault (the task's retry condition reads it).
        lines: the step's error lines (its message and hint), or the end of its output.
    """

    def __init__(self, step: str, outcome: StepOutcome) -> None:
        self.step = step
        self.exit_code = outcome.exit_code
        self.retryable = outcome.retryable
        self.lines = _error_lines(outcome.last_lines)
        meaning = _EXIT_MEANINGS.get(outcome.exit_code, "failed")
        retry = "will be retried" if self.retryable else "not retried"
        detail = "\n".join(self.lines) or "(the step printed nothing)"
        super().__init__(f"datagen {step}: {meaning} (exit {outcome.exit_code}, {retry})\n{detail}")


class StepResultMissing(RuntimeError):
    """A step exited 0 without printing its result line (a bug in the step or the runner)."""


def _error_lines(lines: tuple[str, ...]) -> list[str]:
    """The step's `error: ...` message and its hint lines; else the last lines of its output."""
    for i, line in enumerate(lines):
        if line.startswith("error: "):
            return list(lines[i : i + 12])
    return list(lines[-12:])


def retry_if_transient(task, task_run, state) -> bool:
    """``retry_condition_fn`` of every step task: retry transient faults, nothing else."""
    try:
        state.result()
    except StepFailed as e:
        return e.retryable
    except TransientError:  # raised in the task's own process (S3 calls of the fan-out's tasks)
        return True
    except Exception:
        return False
    return False


# The retry policy of every step task: transient faults only, with backoff.
STEP_RETRY_POLICY = dict(
    retries=STEP_RETRIES,
    retry_delay_seconds=STEP_RETRY_DELAYS_S,
    retry_jitter_factor=STEP_RETRY_JITTER,
    retry_condition_fn=retry_if_transient,
)


def run_step(invocation: StepInvocation, runner: StepRunner, *, log) -> dict:
    """Run one step; stream each output line to ``log``; return its result record.

    Raises:
        StepFailed: a non-zero exit (``retryable`` says whether a retry may help).
        StepResultMissing: exit 0 without a result line.
    """
    outcome = runner.run(invocation, log)
    if not outcome.ok:
        raise StepFailed(invocation.step, outcome)
    if outcome.result is None:
        raise StepResultMissing(f"datagen {invocation.step} exited 0 but printed no result line")
    return outcome.result


def parse_result(result: dict, model: type[T]) -> T:
    """The step's result record as its typed model: keys the model does not declare are dropped,
    unless it keeps extra ones (``extra="allow"``)."""
    if model.model_config.get("extra") != "allow":
        result = {k: v for k, v in result.items() if k in model.model_fields}
    return model.model_validate(result)


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    """A directory of this task's own for files a step reads or writes, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="datagen-step-") as d:
        yield Path(d)


@contextlib.contextmanager
def spec_file(content: dict[str, Any] | BaseModel, *, name: str = "spec.json") -> Iterator[Path]:
    """A JSON file holding ``content``, in a directory of its own, removed afterwards."""
    data = content.model_dump(mode="json") if isinstance(content, BaseModel) else content
    with tempfile.TemporaryDirectory(prefix="datagen-step-") as d:
        path = Path(d) / name
        path.write_text(json.dumps(data, indent=1, sort_keys=True))
        yield path


def dataset_path(dataset: str | Path) -> Path:
    """Where the rows of ``dataset`` lie, to mount: its name without the options after ``#``
    (``datagen.data.dataset_files.parse_ref``). The step is passed the whole name, options and all."""
    from datagen.data.dataset_files import parse_ref

    return parse_ref(dataset).path


def mounts_for(*paths: str | Path, read_only: tuple[str | Path, ...] = ()) -> tuple[Mount, ...]:
    """Mounts of the given host paths (read-write) and ``read_only`` paths, absolute, deduplicated."""
    seen: dict[str, Mount] = {}
    for p, ro in [(p, False) for p in paths] + [(p, True) for p in read_only]:
        path = str(Path(p).absolute())
        if path not in seen:
            seen[path] = Mount(path=path, read_only=ro)
    return tuple(seen.values())


def make_runner(kind: Runner, *, gpu: bool = False) -> StepRunner:
    """The runner the spec names; ``gpu`` picks the CUDA extract image for the docker runner.

    Raises:
        datagen.errors.CannotRunHereError: docker: the images are not built or no engine answers.
    """
    if kind is Runner.LOCAL:
        from tasks.local_runner import LocalRunner

        return LocalRunner()
    from tasks.docker_runner import DockerRunner

    return DockerRunner(_step_images(gpu=gpu))


def _extract_image(gpu: bool):
    from images.tags import ImageName

    return ImageName.EXTRACT_CUDA if gpu else ImageName.EXTRACT_CPU


def _step_images(*, gpu: bool) -> dict[str, str]:
    """Step name -> image tag of the current tree (each image must be built)."""
    from images.tags import ImageName, plan_image, resolve_image

    steps = resolve_image(ImageName.STEPS).tag
    extract = resolve_image(_extract_image(gpu)).tag
    # plan reads the engine's version (part of every fingerprint): it runs in the engine's image.
    # assemble plans the spec again (the engine's version is in every fingerprint): the same image.
    # validate may re-extract golden rows with the engine itself (models transformers cannot load).
    # regenerate generates with the engine (vLLM offline generation).
    # train and measure-draft: the train image (speculators), resolved when a train run starts its step
    train = plan_image(ImageName.TRAIN_CUDA if gpu else ImageName.TRAIN_CPU).tag
    return {"*": steps, "extract": extract, "plan": extract, "assemble": extract, "env-check": extract,
            "validate": extract, "regenerate": extract, "train": train, "measure-draft": train}


def runner_identity(kind: Runner, *, gpu: bool = False) -> str:
    """What besides the spec decides a step's output: the code that runs it.

    docker: the extract image's tag (it hashes everything that goes into the image).
    local: the datagen package's version. The engine's name, version and patches are in every
    shard key already; the local tree's other edits do not invalidate the cache (bump the
    version to force re-extraction).
    """
    if kind is Runner.DOCKER:
        from images.tags import plan_image

        return "docker:" + plan_image(_extract_image(gpu)).tag
    return f"local:datagen-{_package_version()}"


def _package_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("datagen")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def cache_key(kind: str, *parts: Any) -> str:
    """A cache key: ``<kind>-<sha256 of the parts as canonical JSON>`` (a valid file name)."""
    payload = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return f"{kind}-{hashlib.sha256(payload.encode()).hexdigest()}"

