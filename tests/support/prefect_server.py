"""A real Prefect server on loopback with a Prefect home of its own, and real process workers.

    server = start_server(tmp_path)          # ~20 s to healthy; server.stop() at the end
    server.cli("work-pool", "create", "cpu", "--type", "process")
    worker = server.start_worker("cpu", name="w1")
    ...
    worker.kill_tree()                        # a host lost: the worker and everything it started

Every command the tests run against the server (the CLI, workers, flows run in a subprocess)
gets ``server.env``: PREFECT_API_URL of this server and its PREFECT_HOME (SQLite database, result
storage, cache records), so nothing touches the user's Prefect home.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.marks import PREFECT_SERVER, check

STARTUP_TIMEOUT_S = 120.0
# A new server's database is a copy of one that a server of this Prefect version made before (its
# migrations run and its block types registered): a start from it took 5.1 s of CPU against 11.5 s
# from an empty home (`prefect server start` to healthy, idle machine). Made by the first server
# started without one (an online copy, sqlite's backup API), kept under .cache.
DATABASE_TEMPLATES = Path(__file__).resolve().parents[2] / ".cache" / "prefect-database"
UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How long a stop waits, after SIGTERM, for a process and everything it started to exit before it
# kills what is left (SIGKILL). A Prefect server stops in 0.4-1.5 s, an idle worker or one with its
# flow run in 0.3-1 s (measured on 2 busy cores); the server keeps the whole former budget (15 s, then
# 20 s more), so a server's stop stays the graceful one the orchestration faults restart it after.
SERVER_STOP_GRACE_S = 35.0
WORKER_STOP_GRACE_S = 5.0


@dataclass
class Process:
    """A background process whose output goes to a file."""

    proc: subprocess.Popen
    log: Path
    grace: float = SERVER_STOP_GRACE_S  # stop(): seconds after SIGTERM before SIGKILL

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill_tree(self, sig: int = signal.SIGKILL) -> None:
        """Kill the process and every process it started (a host lost, as far as Prefect can tell)."""
        kill_tree(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def stop(self) -> None:
        """SIGTERM to the process and every process it started; SIGKILL to those still there after
        ``grace`` seconds. Returns as soon as all of them have exited."""
        if self.proc.poll() is None:
            stop_tree(self.proc.pid, self.grace)
            self.proc.wait(timeout=10)


@dataclass
class PrefectServer:
    url: str  # http://127.0.0.1:PORT/api
    home: Path  # its PREFECT_HOME
    env: dict[str, str]
    process: Process
    workers: list[Process] = field(default_factory=list)

    def cli(self, *args: str, cwd: str | Path | None = None, timeout: float = 900,
            env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
        """``prefect <args>`` against this server."""
        proc = subprocess.run(
            [sys.executable, "-m", "prefect", *args], cwd=cwd, env={**self.env, **(env or {})},
            capture_output=True, text=True, timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"prefect {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
            )
        return proc

    def start_worker(self, pool: str, *, name: str, limit: int | None = None, cwd: str | Path | None = None,
                     env: dict[str, str] | None = None) -> Process:
        """``prefect worker start --pool POOL`` in the background."""
        args = ["worker", "start", "--pool", pool, "--name", name, "--type", "process"]
        if limit is not None:
            args += ["--limit", str(limit)]
        log = self.home / f"worker-{name}.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", *args], cwd=cwd, env={**self.env, **(env or {})},
            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        worker = Process(proc, log, grace=WORKER_STOP_GRACE_S)
        self.workers.append(worker)
        return worker

    def stop(self) -> None:
        """Kill the workers with everything they started (SIGKILL: at the end nothing of them is kept),
        then stop the server (SIGTERM). A process worker that had run a flow of the end-to-end modules
        did not exit on SIGTERM and was waited out for 35 s, each (docs/testing.md)."""
        for w in self.workers:
            if w.proc.poll() is None:  # not reaped yet: its pid is still its own
                w.kill_tree(signal.SIGKILL)
        self.process.stop()


def start_server(root: Path, *, attempts: int = 3) -> PrefectServer:
    """Start ``prefect server start`` on a free loopback port; return once it answers.

    A port found free can be taken by another process before the server binds it (an outgoing
    connection's ephemeral port): the start is then tried again on another port.
    """
    check(PREFECT_SERVER, "a Prefect server (`prefect server start`)")
    for attempt in range(1, attempts + 1):
        try:
            return _start_server_once(root)
        except PortTaken:
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


class PortTaken(RuntimeError):
    """The server could not bind the port chosen for it."""


@functools.cache
def _database_template() -> Path:
    import importlib.metadata

    return DATABASE_TEMPLATES / f"prefect-{importlib.metadata.version('prefect')}.db"


def seed_database(database: Path) -> bool:
    """Copies the template database to ``database`` (a new server's or harness's); False where
    there is none yet."""
    import shutil

    template = _database_template()
    if not template.is_file():
        return False
    shutil.copyfile(template, database)
    return True


def _save_template(home: Path) -> None:
    """The running server's database as the template: sqlite's online backup (a consistent copy
    while the server writes), then renamed into place (a reader never sees half a file)."""
    import sqlite3
    import tempfile

    template = _database_template()
    template.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=template.parent, suffix=".partial")
    os.close(fd)
    try:
        source, target = sqlite3.connect(home / "prefect.db", timeout=30), sqlite3.connect(partial)
        try:
            with target:
                source.backup(target)
            target.execute("PRAGMA journal_mode=DELETE")  # one file, no WAL beside it
        finally:
            source.close()
            target.close()
        os.replace(partial, template)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _start_server_once(root: Path) -> PrefectServer:
    home = Path(root) / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    fresh = not (home / "prefect.db").exists()  # not a server started again on its home
    seeded = fresh and seed_database(home / "prefect.db")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=url,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS="2",
        PREFECT_WORKER_PREFETCH_SECONDS="2",
        PREFECT_CLI_WRAP_LINES="false",
        COLUMNS="240",
    )
    log = home / "server.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env={**env, "PREFECT_API_URL": ""}, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    server = PrefectServer(url=url, home=home, env=env, process=Process(proc, log))
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output = server.process.output()
            error = PortTaken if "address already in use" in output else RuntimeError
            raise error(f"prefect server exited {proc.returncode}:\n{output[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                if fresh and not seeded and not _database_template().exists():
                    _save_template(home)
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"prefect server did not answer within {STARTUP_TIMEOUT_S:.0f} s:\n{server.process.output()[-4000:]}")


def _signal_all(procs, sig: int) -> None:
    import psutil

    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _tree(pid: int) -> list:
    """``pid`` and all its descendants, [] when it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``pid`` and all its descendants (children first found, then all at once)."""
    import psutil

    procs = _tree(pid)
    _signal_all(procs, sig)
    psutil.wait_procs(procs, timeout=15)


def stop_tree(pid: int, grace: float) -> None:
    """SIGTERM to ``pid`` and all its descendants, then SIGKILL to those still running ``grace``
    seconds later; returns once all have exited."""
    import psutil

    procs = _tree(pid)
    _signal_all(procs, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace)
    _signal_all(alive, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=10)


def flow_run_id(output: str) -> str:
    """The flow run id that `prefect deployment run` printed."""
    m = re.search(r"UUID:\s*(" + UUID_RE.pattern + ")", output)
    if not m:
        raise AssertionError(f"no flow run id in:\n{output[-3000:]}")
    return m.group(1)
