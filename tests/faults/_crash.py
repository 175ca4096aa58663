"""Kill -9 a `datagen extract` run at chosen moments, resume it, and check every kill left a dataset
that the resume finishes byte-identical to an uninterrupted run.

One run is killed again and again: launch (or resume) -> wait for the moment -> SIGKILL to the
whole process group (the driver, vLLM's engine core and its workers) -> check what is on disk ->
launch again. The moments are drawn from a seeded generator, stratified over the phases of a run
so that each is hit (a uniform draw over wall time would land almost every kill in engine
start-up, the longest phase on a CPU):

    startup     a random delay after launch: interpreter start, imports, reading the dataset
    plan        0-0.5 s after the run logged its plan (claiming the output, resume scan, engine import)
    engine      a random moment of vLLM's start-up (engine core and worker processes spawning), at the
                latest when the engine reports itself ready
    mid-write   the moment the run's first shard has a temporary file (the shard is being written)
    rename      0-20 ms after the run's first shard appears under its final name (record not written)
    mid-shard   a random moment after the engine computed its j-th shard of the run (j from 1-3)
    finalize    the last two kills: 0-20 ms after the last shard appears (its record and the manifest
                are next), then, in a run with nothing left to extract, 0-3 ms after its plan line
                (the resume scan and the manifest's write)

After every kill: each shard file under its final name is byte-identical to the reference's,
each shard record present matches its file, no manifest exists unless it equals the reference's,
and no process of the group survives. The resume's log says how many shards it found complete:
a complete shard redone would be work lost (counted).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from datagen.data.contract import MANIFEST_NAME, STATE_DIR
from tests.builders import REPO, datagen_cmd

MODES = ("startup", "plan", "engine", "mid-write", "rename", "mid-shard", "finalize")
# Modes that need shards left to extract; with none left they become "finalize".
EXTRACTING_MODES = frozenset({"engine", "mid-write", "rename", "mid-shard"})
PLAN_LINE = re.compile(r"(\d+) shards in range \d+:\d+, (\d+) already complete, (\d+) to extract")
ENGINE_LINE = "starting vLLM"
ENGINE_READY = "init engine ("
PROGRESS_LINE = "extract INFO progress "
POLL_S = 0.005


# The order modes are taken in for a campaign of N kills (the first N, cycled beyond 20). 20 kills:
# 4 in start-up, 4 just after the plan, 4 in engine start-up, 6 in extraction (2 mid-write, 2 just
# after a rename, 2 mid-shard) and 2 while the manifest is written. Kills before the engine is up
# are cheap; each kill after it costs an engine start, hence only 6 of them.
PRIORITY = ("rename", "finalize", "engine", "startup", "mid-write", "plan", "mid-shard", "startup", "plan",
            "engine", "rename", "mid-write", "mid-shard", "startup", "plan", "engine", "finalize", "startup",
            "plan", "engine")


def schedule(kills: int, seed: int) -> list[str]:
    """The modes of ``kills`` kills, shuffled (seeded), the finalize kills last: they need every
    shard on disk, and one of them may land after the manifest, which ends the run for good."""
    rng = random.Random(seed)
    modes = [PRIORITY[i % len(PRIORITY)] for i in range(kills)]
    rest = [m for m in modes if m != "finalize"]
    rng.shuffle(rest)
    return rest + [m for m in modes if m == "finalize"]


@dataclass
class Kill:
    """One kill and what it left."""

    attempt: int
    mode: str  # the mode used (see the module docstring)
    drawn: str = ""  # the mode drawn: "startup" replaces it once every shard is on disk
    phase: str = ""  # where the run was when the kill landed
    landed: bool = False  # the process group was alive when killed
    delay_s: float = 0.0  # seconds after launch
    shards_at_launch: int = 0  # shard files on disk when the run was launched
    shards_at_kill: int = 0  # shard files on disk after the kill
    temp_files: int = 0  # temporary files (shards, records, manifest) left by the kill
    temp_shards: int = 0  # of which half-written shards
    unrecorded: int = 0  # shard files without their record (killed between rename and record)
    manifest: bool = False  # a manifest existed after the kill
    computed: int = 0  # shards the killed run's engine had computed (its progress lines)
    computed_not_written: int = 0  # of which not on disk at the kill: compute the kill threw away
    resume_found: int | None = None  # complete shards the next run found (from its log)
    redone: int | None = None  # complete shards the next run did not find (work lost)
    problems: list[str] = field(default_factory=list)

    @property
    def survived(self) -> bool:
        return self.landed and not self.problems and not self.redone


@dataclass
class Reference:
    """The uninterrupted run's shards (name -> bytes) and manifest shard list."""

    shards: dict[str, bytes]
    manifest_shards: list[dict]
    rows: dict[int, int]  # dataset row -> times stored


def read_reference(out: Path) -> Reference:
    m = json.loads((out / MANIFEST_NAME).read_text())
    shards = {p.name: p.read_bytes() for p in sorted((out / "shards").glob("shard-*.safetensors"))}
    return Reference(shards, m["shards"], stored_rows(out))


def stored_rows(out: Path) -> dict[int, int]:
    """Dataset row -> how many times it is stored across the shard files of ``out``."""
    from safetensors import safe_open

    counts: dict[int, int] = {}
    for p in sorted((out / "shards").glob("shard-*.safetensors")):
        with safe_open(str(p), "pt") as f:
            for r in f.get_tensor("sample_index").tolist():
                counts[r] = counts.get(r, 0) + 1
    return counts


class Campaign:
    """Kill and resume one extraction; see the module docstring."""

    def __init__(self, args: list[str], out: Path, ref: Reference, *, env: dict[str, str], seed: int,
                 logs: Path, engine_start_s: float, slow_shard_s: float):
        self.args = args
        self.out = out
        self.ref = ref
        self.env = {**os.environ, **env}
        self.rng = random.Random(seed)
        self.logs = logs
        self.engine_start_s = engine_start_s
        self.slow_shard_s = slow_shard_s
        self.kills: list[Kill] = []
        logs.mkdir(parents=True, exist_ok=True)

    # --- the state on disk ----------------------------------------------------------------------
    def shard_files(self) -> list[Path]:
        d = self.out / "shards"
        return sorted(d.glob("shard-*.safetensors")) if d.is_dir() else []

    def temp_files(self) -> list[Path]:
        return [p for p in self.out.rglob(".*.tmp-*")] if self.out.is_dir() else []

    def all_shards_on_disk(self) -> bool:
        return len(self.shard_files()) == len(self.ref.shards)

    # --- one attempt ---------------------------------------------------------------------------
    def launch(self, attempt: int, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
        log = self.logs / f"attempt-{attempt:02d}.log"
        return launch(self.args, {**self.env, **(env or {})}, log), log

    def run(self, modes: list[str]) -> None:
        """One kill per mode, in order."""
        for i, mode in enumerate(modes):
            self.kill_once(i, mode)

    def kill_once(self, attempt: int, mode: str) -> Kill:
        drawn = mode
        if mode in EXTRACTING_MODES | {"plan"} and self.all_shards_on_disk():
            # nothing left to extract: only a kill early in start-up is sure to land before the
            # manifest, after which nothing is left to kill
            mode = "startup"
        k = Kill(attempt=attempt, mode=mode, drawn=drawn, shards_at_launch=len(self.shard_files()))
        before = {p.name for p in self.shard_files()}
        proc, log = self.launch(attempt)
        t0 = time.monotonic()
        watch = _Watch(proc, log, self.out)
        moment = self._wait_for(mode, watch, before)
        k.phase = watch.phase(before, all_done_at_launch=len(before) == len(self.ref.shards))
        k.computed = watch.submitted()
        if moment and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            k.landed = True
        k.delay_s = round(time.monotonic() - t0, 3)
        proc.wait()
        if not k.landed:
            k.problems.append(f"the run ended (exit {proc.returncode}) before the kill")
        _wait_group_gone(proc.pid, k)
        self._check_after_kill(k)
        k.computed_not_written = max(k.computed - (k.shards_at_kill - k.shards_at_launch), 0)
        if k.temp_shards and k.phase.startswith("extracting"):
            k.phase = "extracting (shard being written)"
        self.note_resume(log)  # this run's plan line tells what the previous kill left
        self.kills.append(k)
        return k

    def _wait_for(self, mode: str, w: "_Watch", before: set[str]) -> bool:
        """Block until the moment of ``mode``; False when the process ended first.

        The extraction modes aim at the first shard this run writes: a run's shard files can
        appear in bursts (the engine's writer threads lag behind under load), so aiming further
        would overshoot to the end of the run.
        """
        rng = self.rng
        total = len(self.ref.shards)
        if mode == "startup":
            # a run with nothing left to extract logs its plan about 2 s after launch
            return w.sleep(rng.uniform(0.05, 4.0 if not self.all_shards_on_disk() else 1.2))
        if mode == "plan":
            return w.until(lambda: w.plan is not None) and w.sleep(rng.uniform(0.0, 0.5))
        if mode == "finalize":
            if not self.all_shards_on_disk():
                # the moment the last shard appears: its record and the manifest are next
                return w.until(lambda: w.shard_count() == total) and w.sleep(rng.uniform(0.0, 0.02))
            # nothing left to extract: the resume scan and the manifest's write follow the plan line
            # within milliseconds, hence the fast polling
            return w.until(lambda: w.plan is not None, poll=0.0005) and w.sleep(rng.uniform(0.0, 0.003), poll=0.0005)
        if mode == "engine":
            # a random moment of the start-up as long as the reference's took, cut short when the
            # engine reports itself ready (start-up is faster on a quieter machine)
            if not w.until(lambda: ENGINE_LINE in w.text):
                return False
            end = time.monotonic() + rng.uniform(0.0, self.engine_start_s)
            return w.until(lambda: ENGINE_READY in w.text or time.monotonic() >= end)
        if mode == "mid-write":
            # the moment the shard's temporary file exists; if the write is too quick to see,
            # the moment right after its rename
            return w.until(lambda: w.new_temp() or w.new_shards(before) >= 1)
        if mode == "rename":
            return w.until(lambda: w.new_shards(before) >= 1) and w.sleep(rng.uniform(0.0, 0.02))
        if mode == "mid-shard":
            # the driver's j-th shard of this run (its progress line), then a random moment of the
            # next one: wherever the engine's writers are
            # (leaving a shard or more for the kills still to come)
            j = rng.randint(1, max(min(3, total - len(before) - 1), 1))
            return w.until(lambda: w.submitted() >= j) and w.sleep(rng.uniform(0.0, self.slow_shard_s))
        raise ValueError(mode)

    def _check_after_kill(self, k: Kill) -> None:
        files = self.shard_files()
        k.shards_at_kill = len(files)
        temps = self.temp_files()
        k.temp_files = len(temps)
        k.temp_shards = sum(p.name.startswith(".shard-") and p.parent.name == "shards" for p in temps)
        for p in files:
            want = self.ref.shards.get(p.name)
            if want is None:
                k.problems.append(f"{p.name}: not a shard of the reference run")
            elif p.read_bytes() != want:
                k.problems.append(f"{p.name}: differs from the reference (size {p.stat().st_size}, want {len(want)})")
        records = self.out / STATE_DIR / "shards"
        for p in files:
            rec = records / p.with_suffix(".json").name
            if not rec.exists():
                k.unrecorded += 1
                continue
            r = json.loads(rec.read_text())
            ref = self.ref.manifest_shards[r["index"]]
            if r != ref:
                k.problems.append(f"record {rec.name} differs from the reference's manifest entry")
        manifest = self.out / MANIFEST_NAME
        k.manifest = manifest.exists()
        if k.manifest:
            m = json.loads(manifest.read_text())
            if m["shards"] != self.ref.manifest_shards:
                k.problems.append("a manifest exists whose shard list differs from the reference")
            if len(files) != len(self.ref.shards):
                k.problems.append("a manifest exists over incomplete data")

    def note_resume(self, log: Path) -> None:
        """Fill in the previous kill's resume_found/redone from the next run's plan line."""
        if not self.kills:
            return
        prev = self.kills[-1]
        m = PLAN_LINE.search(log.read_text(errors="replace"))
        if m:
            prev.resume_found = int(m.group(2))
            prev.redone = max(prev.shards_at_kill - prev.resume_found, 0)
            if prev.redone:
                prev.problems.append(f"the resume redid {prev.redone} complete shards")

    def finish(self) -> tuple[subprocess.CompletedProcess, Path]:
        """Resume without a kill until the run completes; the completed process and its log."""
        attempt = len(self.kills)
        proc, log = self.launch(attempt, env={"DATAGEN_TEST_SLOW_SHARD_S": "0"})
        proc.wait(timeout=900)
        self.note_resume(log)
        return subprocess.CompletedProcess(proc.args, proc.returncode), log

    def summary(self) -> list[dict]:
        return [asdict(k) | {"survived": k.survived} for k in self.kills]


class _Watch:
    """What a running attempt has done so far: its log and the shard directory."""

    def __init__(self, proc: subprocess.Popen, log: Path, out: Path):
        self.proc, self.log, self.out = proc, log, out
        self.text = ""
        self.plan: tuple[int, int, int] | None = None
        self.saw_temp = False
        self._pos = 0

    def _refresh(self) -> None:
        try:
            with self.log.open("rb") as f:
                f.seek(self._pos)
                chunk = f.read()
        except OSError:
            return
        if chunk:
            self._pos += len(chunk)
            self.text += chunk.decode(errors="replace")
            if self.plan is None and (m := PLAN_LINE.search(self.text)):
                self.plan = tuple(int(x) for x in m.groups())

    def until(self, cond, timeout: float = 900, poll: float = POLL_S) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._refresh()
            if cond():
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(poll)
        raise TimeoutError("the moment never came")

    def sleep(self, seconds: float, poll: float = POLL_S) -> bool:
        end = time.monotonic() + seconds
        return self.until(lambda: time.monotonic() >= end, poll=poll)

    def new_shards(self, before: set[str]) -> int:
        d = self.out / "shards"
        return sum(p.name not in before for p in d.glob("shard-*.safetensors")) if d.is_dir() else 0

    def submitted(self) -> int:
        """Shards the driver has computed in this run (one progress line each)."""
        return self.text.count(PROGRESS_LINE)

    def shard_count(self) -> int:
        d = self.out / "shards"
        return len(list(d.glob("shard-*.safetensors"))) if d.is_dir() else 0

    def new_temp(self) -> bool:
        d = self.out / "shards"
        found = d.is_dir() and any(d.glob(".shard-*.tmp-*"))
        self.saw_temp |= found
        return found

    def phase(self, before: set[str], *, all_done_at_launch: bool) -> str:
        self._refresh()
        if all_done_at_launch:
            return "finalize (manifest)" if self.plan else "finalize (start-up)"
        if self.plan is None:
            return "start-up (imports, dataset)"
        if ENGINE_LINE not in self.text:
            return "plan (claim, resume scan)"
        if ENGINE_READY not in self.text:
            return "engine start-up"
        if self.new_temp():
            return "extracting (shard being written)"
        return "extracting"


def launch(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``datagen ARGS`` in a session of its own (so that killpg reaches every process it starts),
    output to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(datagen_cmd(*args), cwd=REPO, env=env, start_new_session=True,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def measure_reference(args: list[str], env: dict[str, str], out: Path, log: Path) -> tuple[float, float]:
    """Run ``datagen ARGS`` uninterrupted; return (its seconds, the engine's start-up seconds)."""
    t0 = time.monotonic()
    proc = launch(args, env, log)
    w = _Watch(proc, log, out)
    if not w.until(lambda: ENGINE_LINE in w.text):
        raise AssertionError(f"the reference run ended before starting its engine:\n{log.read_text()[-3000:]}")
    t_engine = time.monotonic()
    w.until(lambda: ENGINE_READY in w.text)
    engine_s = time.monotonic() - t_engine
    if proc.wait(timeout=900) != 0:
        raise AssertionError(f"the reference run failed:\n{log.read_text()[-3000:]}")
    return time.monotonic() - t0, engine_s


def _wait_group_gone(pgid: int, k: Kill, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in psutil.process_iter(["pid", "status"]) if _pgid(p.info["pid"]) == pgid
                 and p.info["status"] != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        time.sleep(0.1)
    k.problems.append(f"{len(alive)} processes of the killed group still running")


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None
