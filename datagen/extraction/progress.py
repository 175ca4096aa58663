"""A run's progress: on a terminal a bar, else a log line every few seconds (the run loop's,
``datagen.extraction.run``)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque

from datagen import settings

log = logging.getLogger(__name__)


class Progress:
    """What a run has done and how fast: on a terminal a bar, else a log line every few seconds.

    Rates count from the moment the first token is handed to the engine (``begin``), never from
    the process start (the engine's start is said once, in its own line): the rate since then, the
    rate over the last minute, tokens done and left, the time left at the last minute's rate, and
    the bytes of shards written per second. A token is done when the shard holding its states is
    written, so the rate since the first token is the run's end-to-end rate. Each line starts ``progress DONE/TOTAL tokens`` (the
    orchestration follows a range's progress by it, tasks/artifacts.py).
    """

    WINDOW_S = 60.0

    def __init__(self, total_tokens: int, *, clock=time.monotonic, terminal: bool | None = None,
                 interval_s: float | None = None):
        self.total, self.done, self.written = total_tokens, 0, 0
        self.clock = clock
        self.interval_s = settings.progress_interval_s() if interval_s is None else interval_s
        self.first: float | None = None  # when the first token was handed over
        self.last_log: float | None = None
        self._recent: deque[tuple[float, int, int]] = deque()  # (time, tokens done, bytes written)
        self._lock = threading.Lock()
        self.bar = None
        if sys.stderr.isatty() if terminal is None else terminal:
            from tqdm import tqdm

            self.bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, desc="extract")

    def begin(self) -> None:
        """The first token is handed to the engine now: the rates count from here."""
        if self.first is None:
            self.first = self.last_log = self.clock()
            self._recent.append((self.first, 0, 0))

    def advance(self, tokens: int) -> None:
        """``tokens`` more are done: their states are in a shard written (the run loop calls it as it
        keeps a shard's record, never when it hands the rows to the engine, which may hold many)."""
        self.begin()
        with self._lock:
            self.done += tokens
            self._tick()
        if self.bar is not None:
            self.bar.update(tokens)
            self.bar.set_postfix_str(self.postfix(), refresh=False)
            return
        now = self.clock()
        if now - self.last_log >= self.interval_s or self.done >= self.total:
            self.last_log = now
            log.info("%s", self.line())

    def wrote(self, nbytes: int) -> None:
        """Shards of ``nbytes`` bytes were written (any thread)."""
        self.begin()
        with self._lock:
            self.written += nbytes
            self._tick()

    def _tick(self) -> None:
        now = self.clock()
        self._recent.append((now, self.done, self.written))
        while len(self._recent) > 2 and self._recent[1][0] <= now - self.WINDOW_S:
            self._recent.popleft()  # keep one point at or before the window's start

    def rate(self) -> float:
        """Tokens per second since the first token was handed over."""
        if self.first is None:
            return 0.0
        return self.done / max(self.clock() - self.first, 1e-9)

    def recent(self) -> tuple[float, float]:
        """Tokens per second and bytes written per second over the last minute."""
        if not self._recent:
            return 0.0, 0.0
        now = self.clock()
        t0, done0, written0 = self._recent[0]
        dt = max(now - t0, 1e-9)
        return (self.done - done0) / dt, (self.written - written0) / dt

    def seconds_left(self) -> float | None:
        """At the last minute's rate; None before any token is done."""
        tokens_s, _ = self.recent()
        return (self.total - self.done) / tokens_s if tokens_s > 0 else None

    def postfix(self) -> str:
        tokens_s, bytes_s = self.recent()
        left = self.seconds_left()
        return (f"{self.rate():,.0f} tokens/s since the first token, {tokens_s:,.0f} tokens/s last minute, "
                f"{self.total - self.done:,} tokens left, {_duration(left)} left, {bytes_s / 1e9:.2f} GB/s written")

    def line(self) -> str:
        return (f"progress {self.done}/{self.total} tokens ({100.0 * self.done / max(self.total, 1):.0f}%), "
                + self.postfix())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown time"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
