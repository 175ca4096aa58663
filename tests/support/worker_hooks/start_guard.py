"""The guard that makes the test marks hold: a test that starts a vLLM engine, talks to a Docker
engine or starts an S3 or Prefect server without the matching mark fails.

The pytest side (``tests/support/marks.py``) writes, before each test, which of the guarded marks
the running test lacks into ``current.json`` of the directory named by ``GUARD_ENV``; every
process of the test session reads it at the moment it starts one of those things, in the test's
own process (``install`` there) and in every process the tests start (this folder is on their
PYTHONPATH, whose ``sitecustomize`` calls ``install``): a ``datagen`` step, a flow step, a
Prefect worker's flow run, vLLM's engine-core process. A start the running test is not marked for
raises ``UnmarkedStart`` and is appended to ``trips.jsonl``, which the pytest side reads after
each phase of the test: the test fails even where the error itself was caught or expected (a
step that exits non-zero, a test asserting that a run fails).

Standard library only: the processes that import it need not have the repository on their path.
The product knows nothing of it: it wraps vLLM's, Docker's and Prefect's own classes as their
modules load.
"""

from __future__ import annotations

import functools
import importlib.abc
import json
import os
import sys
from pathlib import Path

GUARD_ENV = "DATAGEN_TEST_START_GUARD"  # the guard's directory; unset: no guard
CURRENT = "current.json"  # {"test": node id or null, "unmarked": [mark, ...]}
TRIPS = "trips.jsonl"  # one {"test", "mark", "what", "pid"} per start that was refused
STARTS = "starts.jsonl"  # one {"test", "mark", "what"} per start, allowed or not: what the session counts

ENGINE, DOCKER, S3, PREFECT_SERVER = "engine", "docker", "s3", "prefect_server"
GUARDED = (ENGINE, DOCKER, S3, PREFECT_SERVER)


# `report` (`DATAGEN_TEST_START_GUARD_MODE=report make test`): an unmarked start is recorded and the
# session names it at its end instead of refusing it; anything else (`make check`, `make test`, a
# plain pytest) refuses it.
MODE_ENV = "DATAGEN_TEST_START_GUARD_MODE"
REPORT = "report"


class UnmarkedStart(RuntimeError):
    """A test started something its marks do not allow."""


def check(mark: str, what: str) -> None:
    """Refuse to start ``what`` when the running test lacks ``mark`` (nothing without the guard).

    Raises:
        UnmarkedStart: the running test is not marked ``mark``; the refusal is also recorded for
            the pytest side.
    """
    folder = os.environ.get(GUARD_ENV)
    if not folder:
        return
    try:
        current = json.loads((Path(folder) / CURRENT).read_text())
    except (OSError, ValueError):  # the session is over (its folder removed): nothing to guard
        return
    with open(Path(folder) / STARTS, "a") as starts:
        starts.write(json.dumps({"test": current.get("test"), "mark": mark, "what": what}) + "\n")
    if mark not in current.get("unmarked", ()):
        return
    test = current.get("test") or "a test"
    with open(Path(folder) / TRIPS, "a") as trips:
        trips.write(json.dumps({"test": current.get("test"), "mark": mark, "what": what, "pid": os.getpid()}) + "\n")
    if os.environ.get(MODE_ENV) == REPORT:  # the whole suite: recorded and named at its end, not refused
        return
    raise UnmarkedStart(
        f"{test} starts {what} but is not marked `{mark}`: add @pytest.mark.{mark} to the test (or "
        f"to `pytestmark` of its module), so that `make check` leaves it out and `make test` runs it"
    )


def _guard_method(cls: type, name: str, mark: str, what: str, *, when=None) -> None:
    """Wrap ``cls.name`` so that it calls ``check(mark, what)`` first (when ``when(self)`` holds)."""
    original = cls.__dict__.get(name)
    if original is None or getattr(original, "_start_guard", False):
        return

    @functools.wraps(original)
    def guarded(self, *args, **kwargs):
        if when is None or when(self):
            check(mark, what)
        return original(self, *args, **kwargs)

    guarded._start_guard = True
    setattr(cls, name, guarded)


def _vllm_llm(module) -> None:
    _guard_method(module.LLM, "__init__", ENGINE, "a vLLM engine (vllm.LLM)")


def _vllm_engine_core(module) -> None:
    _guard_method(module.EngineCore, "__init__", ENGINE, "a vLLM engine core")


def _docker_client(module) -> None:
    _guard_method(module.APIClient, "__init__", DOCKER, "a client of the Docker engine")


def _prefect_server(module) -> None:
    # start() is called again on a running server (it starts once): only the first start counts
    _guard_method(module.SubprocessASGIServer, "start", PREFECT_SERVER,
                  "a Prefect server (Prefect's test harness, or a flow run without PREFECT_API_URL)",
                  when=lambda server: not server.running)


# module -> what to wrap in it once it has run
PATCHES = {
    "vllm.entrypoints.llm": _vllm_llm,
    "vllm.v1.engine.core": _vllm_engine_core,
    "docker.api.client": _docker_client,
    "prefect.server.api.server": _prefect_server,
}


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, with the patch run right after the module."""

    def __init__(self, loader, patch) -> None:
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):  # get_data, get_resource_reader, ... of the real loader
        return getattr(self._loader, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the finders after it and wraps the loader of a module in PATCHES."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in PATCHES:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, _PatchOnImport) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, PATCHES[fullname])
                return spec
        return None


def install() -> None:
    """Guard this process: patch the modules of PATCHES already loaded, and the others as they load."""
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
