"""Marks that hold: the pytest side of the start guard (``worker_hooks/start_guard.py``).

A test that starts a vLLM engine, talks to a Docker engine or starts an S3 or Prefect server must
carry the mark of it (``engine``, ``docker``, ``s3``, ``prefect_server``): `make check` selects by
these marks, so an unmarked start would put minutes of engine or server into the fast tier. Three
things enforce it, each where the thing starts:

- a fixture that starts one declares it (``@starts(S3)`` under ``@pytest.fixture``); a test whose
  fixtures include it fails in its set-up when it lacks the mark, whether or not an earlier test
  has already started the shared server;
- the harnesses of tests/support call ``check`` before they start a server or a client
  (``S3Server.start``, ``prefect_server.start_server``, ``docker_engine.docker_client``);
- every other start, wherever it happens (a module fixture, a ``datagen`` subprocess, a flow
  step, a Prefect worker's flow run), goes through vLLM's ``LLM``/``EngineCore``, Docker's
  ``APIClient`` or Prefect's ``SubprocessASGIServer``, which the guard wraps in the test process
  and, through ``sitecustomize`` on PYTHONPATH, in every process the tests start.

The ``slow`` mark has no guard (a duration is no start): a run that leaves out ``slow`` (`make
check`) names, at its end, the unmarked tests that took over SLOW_S seconds.

The hooks below are imported into tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest

HOOKS_DIR = Path(__file__).resolve().parent / "worker_hooks"
SLOW_S = 15.0  # a test of the fast tier over this (set-up and call) is named at its end: mark it slow
# The guard by the same name as the processes the tests start import it (`start_guard`, through
# sitecustomize): one module, one set of patches, one UnmarkedStart, whichever imported it first.
if str(HOOKS_DIR) not in sys.path:
    sys.path.append(str(HOOKS_DIR))

import start_guard  # noqa: E402
from start_guard import (  # noqa: E402, F401  (re-exported for the harnesses)
    DOCKER, ENGINE, GUARDED, PREFECT_SERVER, S3, UnmarkedStart, check,
)
_STARTS_ATTR = "_datagen_test_starts"  # on a fixture function: (mark, what) it starts
_DURATIONS = pytest.StashKey[dict]()  # node id -> seconds of set-up and call, of tests not marked slow


def starts(mark: str, what: str):
    """Declare that a fixture starts ``what``, which needs ``mark``; put it under ``@pytest.fixture``."""
    assert mark in GUARDED, mark

    def declare(func):
        setattr(func, _STARTS_ATTR, (mark, what))
        return func

    return declare


def _folder() -> Path:
    return Path(os.environ[start_guard.GUARD_ENV])


def _set_current(test: str | None, unmarked: list[str]) -> None:
    tmp = _folder() / (start_guard.CURRENT + ".tmp")
    tmp.write_text(json.dumps({"test": test, "unmarked": unmarked}))
    tmp.replace(_folder() / start_guard.CURRENT)


def _trips_since(offset: int) -> tuple[list[dict], int]:
    path = _folder() / start_guard.TRIPS
    if not path.exists():
        return [], offset
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    lines = data.decode(errors="replace").splitlines()
    return [json.loads(line) for line in lines if line.strip()], offset + len(data)


def unmarked_of(item: pytest.Item) -> list[str]:
    """The guarded marks ``item`` lacks: what it may not start."""
    marks = {m.name for m in item.iter_markers()}
    return [m for m in GUARDED if m not in marks]


def pytest_configure(config: pytest.Config) -> None:
    folder = Path(tempfile.mkdtemp(prefix="datagen-start-guard-"))
    config._datagen_start_guard = folder
    os.environ[start_guard.GUARD_ENV] = str(folder)
    (folder / start_guard.TRIPS).touch()
    _set_current(None, [])
    paths = [str(HOOKS_DIR), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))  # every process the tests start
    start_guard.install()  # this process


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = getattr(config, "_datagen_start_guard", None)
    if folder is not None:
        os.environ.pop(start_guard.GUARD_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    # set-up, call and tear-down of the item (its fixtures' too) run under its marks
    _set_current(item.nodeid, unmarked_of(item))
    item._start_guard_offset = (_folder() / start_guard.TRIPS).stat().st_size
    try:
        return (yield)
    finally:
        _set_current(None, [])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    unmarked = set(unmarked_of(item))
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        for fixturedef in (info.name2fixturedefs.get(name, ()) if info else ()):
            declared = getattr(fixturedef.func, _STARTS_ATTR, None)
            if declared and declared[0] in unmarked:
                mark, what = declared
                if _reporting():
                    _REPORTED.append(f"{item.nodeid} uses `{name}` ({what}) but is not marked `{mark}`")
                    continue
                pytest.fail(
                    f"{item.nodeid} uses the fixture `{name}`, which starts {what}, but is not marked "
                    f"`{mark}`: add @pytest.mark.{mark} (or `pytestmark` of its module)", pytrace=False,
                )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    rep = yield
    if rep.when in ("setup", "call") and item.get_closest_marker("slow") is None:
        seconds = item.config.stash.setdefault(_DURATIONS, {})
        seconds[item.nodeid] = seconds.get(item.nodeid, 0.0) + rep.duration
    offset = getattr(item, "_start_guard_offset", None)
    if offset is None:
        return rep
    trips, item._start_guard_offset = _trips_since(offset)
    mine = [t for t in trips if t.get("test") == item.nodeid]
    if mine and _reporting():
        _REPORTED.extend(f"{t['test']} started {t['what']} but is not marked `{t['mark']}`" for t in mine)
    elif mine and not rep.failed:
        rep.outcome = "failed"
        rep.longrepr = "\n".join(
            f"{t['test']} started {t['what']} (process {t['pid']}) but is not marked `{t['mark']}`: "
            f"add @pytest.mark.{t['mark']} (or `pytestmark` of its module)" for t in mine
        )
    return rep


def _reporting() -> bool:
    return os.environ.get(start_guard.MODE_ENV) == start_guard.REPORT


_REPORTED: list[str] = []  # report mode: the unmarked starts, named at the session's end


ENGINE_CORE = "a vLLM engine core"  # start_guard's name for one engine start, in whichever process it runs


def _starts() -> list[dict]:
    path = _folder() / start_guard.STARTS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(errors="replace").splitlines() if line.strip()]


def _write_starts(terminalreporter) -> None:
    """What this session started, counted where it started (every process of the session): engine
    cores, Prefect and S3 servers, Docker clients; and the tests that started the most engines."""
    starts = _starts()
    if not starts:
        return
    terminalreporter.write_sep("=", f"starts in this session ({len(starts)})")
    for what, n in Counter(s["what"] for s in starts).most_common():
        terminalreporter.write_line(f"{n:5d}  {what}")
    engines = Counter(s["test"] or "(between tests)" for s in starts if s["what"] == ENGINE_CORE)
    if engines:
        terminalreporter.write_line(f"engine cores by test ({sum(engines.values())} in {len(engines)} tests):")
        for test, n in engines.most_common():
            terminalreporter.write_line(f"{n:5d}  {test}")


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    _write_starts(terminalreporter)
    if _REPORTED:
        terminalreporter.write_sep("=", "unmarked starts (add the marks named: `make check` would refuse them)")
        for line in dict.fromkeys(_REPORTED):
            terminalreporter.write_line(line)
    if "not slow" not in (config.option.markexpr or ""):
        return
    over = sorted(((t, n) for n, t in config.stash.get(_DURATIONS, {}).items() if t > SLOW_S), reverse=True)
    if over:
        terminalreporter.write_sep("=", f"not marked slow, over {SLOW_S:.0f} s (mark them slow, or make them cheaper)")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
