"""The docker runner: each step program in its versioned container.

``DockerRunner.run`` is a chain of short steps: build the container settings, create,
start, stream the output, wait, and remove the container, which happens whatever
goes wrong (an exception, Ctrl-C, a cancelled flow run raising in this thread). A
process killed outright (SIGKILL) cannot clean up: every container carries labels
(``dev.datagen.managed``, the step, the project version and the invocation's own labels,
such as the flow-run id), and ``remove_leftover_containers`` removes them by label.

Containers run as the host user (uid:gid), so what a step writes to a bind mount belongs
to the user who started the flow, not to root or the image's user.

Each container is fresh, and so would be the kernels its engine compiles (torch inductor's, Triton's,
vLLM's compiled graphs and its probe of the model registry): a host folder is mounted into every step
container for them (``tasks.settings.compile_cache``, DATAGEN_COMPILE_CACHE), so that an engine
started again with the same model, settings and image finds them. Their keys hold the versions of
torch, vLLM and the kernels' sources, so one folder serves images of several versions; removing it
costs one compile, nothing else.
"""

from __future__ import annotations

import atexit
import codecs
import importlib.metadata
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import docker
import docker.errors
import docker.types
import requests

from datagen.errors import CannotRunHereError
from tasks.runners import StepInvocation, StepOutcome, parse_result_line
from tasks.settings import compile_cache, engine_step_env

logger = logging.getLogger(__name__)

LABEL_PREFIX = "dev.datagen."
MANAGED_LABEL = LABEL_PREFIX + "managed"  # "true" on every container this runner creates
EXIT_DOCKER_FAILED = 125  # docker's own code for "could not run the container": retryable
EXIT_OOM_KILLED = 137  # SIGKILL, as the OOM killer delivers it: retryable
LAST_LINES = 50  # output lines kept for error messages
COMPILE_CACHE_PATH = "/var/cache/datagen-compile"  # where the host's compile cache is in a container
# what the compilers read their cache folders from, each under the mounted folder
COMPILE_CACHE_ENV = {"TORCHINDUCTOR_CACHE_DIR": "torchinductor", "TRITON_CACHE_DIR": "triton", "VLLM_CACHE_ROOT": "vllm"}

_running: set = set()  # containers this process created and has not removed yet
_running_lock = threading.Lock()


@dataclass(frozen=True)
class ContainerSettings:
    """How step containers are started (not what they run)."""

    # PyTorch (and vLLM's workers) share tensors through /dev/shm; Docker's default is 64 MB.
    shm_size: str = "8g"
    # vLLM's documented setting for tensor parallelism across GPUs: the host's IPC namespace.
    gpu_ipc_mode: str = "host"
    # "uid:gid" the step runs as; None: this process's own (files on mounts belong to the user).
    user: str | None = None


class DockerRunner:
    """Runs ``datagen <step> <args>`` in a container of the step's image.

    Args:
        images: step name -> image tag (``images.tags.resolve_image(...).tag``); a step not
            named uses the tag under ``"*"``.
        client: a ``docker.DockerClient``; None: ``docker.from_env()``.
        settings: how containers start.
    """

    def __init__(
        self,
        images: Mapping[str, str],
        *,
        client: docker.DockerClient | None = None,
        settings: ContainerSettings = ContainerSettings(),
    ) -> None:
        self.images = dict(images)
        self.client = client or docker.from_env()
        self.settings = settings

    def run(self, invocation: StepInvocation, log: Callable[[str], None]) -> StepOutcome:
        """Runs the step; its container is removed before this returns or raises.

        Raises:
            CannotRunHereError: the step's image is not built (the hint gives the command), or
                it needs GPUs and the engine cannot give containers any.
        """
        image = self._image_for(invocation.step)
        try:
            container = self.client.containers.create(image, **self._create_args(invocation))
        except docker.errors.ImageNotFound as e:
            raise CannotRunHereError(
                f"image {image} for step {invocation.step} is not built", hint="run `make images`"
            ) from e
        except docker.errors.APIError as e:
            return _docker_failed(f"creating the container for {invocation.step} failed", e)
        with _running_lock:
            _running.add(container)
        try:
            return self._start_and_watch(container, invocation, log)
        finally:
            _remove(container)

    def _image_for(self, step: str) -> str:
        try:
            return self.images[step] if step in self.images else self.images["*"]
        except KeyError:
            raise CannotRunHereError(
                f"no image for step {step}", hint='give DockerRunner an image for it (or for "*")'
            ) from None

    def _create_args(self, invocation: StepInvocation) -> dict:
        gpu = invocation.gpus > 0
        mounts = [
            docker.types.Mount(target=m.path, source=m.path, type="bind", read_only=m.read_only)
            for m in invocation.mounts
        ]
        cache = compile_cache()
        if cache is not None:
            try:
                cache.mkdir(parents=True, exist_ok=True)  # made here, it belongs to the user, not to root
            except OSError as e:
                raise CannotRunHereError(
                    f"the compile cache {cache} cannot be made: {e.strerror}",
                    hint="set DATAGEN_COMPILE_CACHE to a folder this user can write, or to off",
                ) from e
            mounts.append(docker.types.Mount(target=COMPILE_CACHE_PATH, source=str(cache.absolute()), type="bind"))
        return dict(
            entrypoint=["datagen"],
            command=[invocation.step, *invocation.args],
            user=self.settings.user or f"{os.getuid()}:{os.getgid()}",
            environment=self._environment(invocation, compiled_kernels=cache is not None),
            mounts=mounts,
            labels=self._labels(invocation),
            shm_size=None if gpu else self.settings.shm_size,
            ipc_mode=self.settings.gpu_ipc_mode if gpu else None,
            device_requests=(
                [docker.types.DeviceRequest(count=invocation.gpus, capabilities=[["gpu"]])]
                if gpu
                else None
            ),
            detach=True,
        )

    def _environment(self, invocation: StepInvocation, *, compiled_kernels: bool = False) -> dict[str, str]:
        # The host user may have no home in the image; tools that cache under ~ need one. The compile
        # cache's folders, then the worker's engine settings reach the step as they reach a local step;
        # the step's own env comes last.
        env = {"HOME": "/tmp"}
        if compiled_kernels:
            env.update({name: f"{COMPILE_CACHE_PATH}/{sub}" for name, sub in COMPILE_CACHE_ENV.items()})
        env.update({**engine_step_env(), **invocation.env})
        missing = [n for n in invocation.secret_env_names if n not in os.environ]
        if missing:
            logger.warning("%s: secret env vars not set on the host: %s", invocation.step, missing)
        env.update({n: os.environ[n] for n in invocation.secret_env_names if n in os.environ})
        return env

    def _labels(self, invocation: StepInvocation) -> dict[str, str]:
        labels = {LABEL_PREFIX + k: v for k, v in invocation.labels.items()}
        labels.update(
            {
                MANAGED_LABEL: "true",
                LABEL_PREFIX + "step": invocation.step,
                LABEL_PREFIX + "version": _project_version(),
            }
        )
        return labels

    def _start_and_watch(self, container, invocation: StepInvocation, log) -> StepOutcome:
        try:
            container.start()
        except docker.errors.APIError as e:
            if invocation.gpus and "could not select device driver" in str(e.explanation):
                # No retry can help: this engine cannot hand GPUs to containers at all.
                raise CannotRunHereError(
                    f"{invocation.step} needs {invocation.gpus} GPU(s) but this Docker engine "
                    "cannot give containers GPUs",
                    hint="install the NVIDIA Container Toolkit on this host, or run the step on a "
                    "GPU host",
                ) from e
            return _docker_failed(f"starting the container for {invocation.step} failed", e)
        logger.debug("%s: container %s started", invocation.step, container.short_id)
        result = None
        last = deque(maxlen=LAST_LINES)
        try:
            for line in _lines(container.logs(stream=True, follow=True)):
                parsed = parse_result_line(line)
                result = parsed if parsed is not None else result
                last.append(line)
                log(line)
            exit_code = container.wait()["StatusCode"]
            container.reload()
        except (docker.errors.APIError, requests.exceptions.RequestException) as e:
            # The engine went away mid-step (restarted, crashed): an infrastructure fault.
            return _docker_failed(f"lost the container of {invocation.step}", e)
        if container.attrs["State"].get("OOMKilled"):
            last.append(f"{invocation.step}: the container ran out of memory (OOM-killed)")
            exit_code = EXIT_OOM_KILLED
        return StepOutcome(exit_code=exit_code, result=result, last_lines=tuple(last))


def _lines(chunks: Iterator[bytes]) -> Iterator[str]:
    """Whole lines from a byte stream whose chunks may split lines and characters."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    for chunk in chunks:
        pending += decoder.decode(chunk)
        *complete, pending = pending.split("\n")
        yield from (line.rstrip("\r") for line in complete)
    pending += decoder.decode(b"", final=True)
    if pending:
        yield pending


def _docker_failed(what: str, error: Exception) -> StepOutcome:
    message = f"{what}: {getattr(error, 'explanation', None) or error}"
    logger.warning("%s", message)
    return StepOutcome(exit_code=EXIT_DOCKER_FAILED, result=None, last_lines=(message,))


def _remove(container) -> None:
    with _running_lock:
        _running.discard(container)
    try:
        container.remove(force=True)
    except docker.errors.NotFound:
        pass  # already gone (removed by a leftover sweep, or the engine restarted)
    except (docker.errors.APIError, requests.exceptions.RequestException) as e:
        # Never let a failed clean-up hide the step's outcome (or the exception in flight).
        logger.warning(
            "container %s was not removed: %s; remove_leftover_containers() will find it by label",
            container.short_id,
            e,
        )


@atexit.register
def _remove_all() -> None:
    # This interpreter exits while a step runs in another thread (a flow run cancelled or
    # crashed): its container must not outlive it.
    with _running_lock:
        containers = list(_running)
    for container in containers:
        _remove(container)


def _project_version() -> str:
    try:
        return importlib.metadata.version("datagen")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def remove_leftover_containers(
    labels: Mapping[str, str] | None = None, *, client: docker.DockerClient | None = None
) -> list[str]:
    """Removes (by force) the runner's containers that carry all of ``labels``.

    Args:
        labels: invocation labels to match, e.g. ``{"flow-run-id": "..."}`` (without the
            prefix); None or empty: every container this runner ever made.
        client: a ``docker.DockerClient``; None: ``docker.from_env()``.

    Returns:
        The ids of the removed containers.
    """
    client = client or docker.from_env()
    wanted = [f"{MANAGED_LABEL}=true"]
    wanted += [f"{LABEL_PREFIX}{k}={v}" for k, v in (labels or {}).items()]
    removed = []
    for container in client.containers.list(all=True, filters={"label": wanted}):
        _remove(container)
        removed.append(container.id)
        logger.info("removed leftover container %s (%s)", container.short_id, container.name)
    return removed
