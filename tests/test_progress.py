"""The run's progress: rates from the first token handed over (not the process start), the last
minute's rate, tokens done and left, the time left and the bytes written per second."""

from __future__ import annotations

import logging

from datagen.extraction.run import Progress


class Clock:
    """A clock the test moves."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def progress(total: int = 10_000, **overrides) -> tuple[Progress, Clock]:
    clock = overrides.pop("clock", Clock())
    return Progress(total, clock=clock, terminal=False, interval_s=overrides.pop("interval_s", 5.0), **overrides), clock


def test_the_rate_counts_from_the_first_token_not_from_the_start():
    p, clock = progress()
    clock.t += 300  # the engine starts: five minutes in which no token is handed over
    p.begin()
    clock.t += 10
    p.advance(1_000)
    assert p.rate() == 100.0, "1,000 tokens in the 10 s since the first token, not in 310 s"


def test_the_last_minute_rate_follows_a_change_of_pace():
    p, clock = progress(total=100_000)
    p.begin()
    for _ in range(12):  # two minutes at 100 tokens/s
        clock.t += 10
        p.advance(1_000)
    for _ in range(6):  # then one minute at 400 tokens/s
        clock.t += 10
        p.advance(4_000)
    tokens_s, _ = p.recent()
    assert tokens_s == 400.0
    assert round(p.rate()) == round(36_000 / 180)
    assert p.seconds_left() == (100_000 - 36_000) / 400


def test_bytes_written_per_second_over_the_last_minute():
    p, clock = progress()
    p.begin()
    clock.t += 30
    p.wrote(3_000_000_000)
    clock.t += 30
    p.wrote(3_000_000_000)
    assert p.recent()[1] == 100_000_000.0
    assert "0.10 GB/s written" in p.line()


def test_a_log_line_every_interval_and_at_the_end_says_done_left_and_time_left(caplog):
    caplog.set_level(logging.INFO, logger="datagen.extraction.run")
    p, clock = progress(total=3_000, interval_s=5.0)
    p.begin()
    clock.t += 1
    p.advance(1_000)  # 1 s after the last line: none
    clock.t += 5
    p.advance(1_000)
    clock.t += 1
    p.advance(1_000)  # the last tokens: a line whatever the interval
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress ")]
    assert len(lines) == 2, lines
    assert lines[0].startswith("progress 2000/3000 tokens (67%), 333 tokens/s since the first token")
    assert "1,000 tokens left" in lines[0] and "0:00:03 left" in lines[0]
    assert lines[1].startswith("progress 3000/3000 tokens (100%)") and "0 tokens left" in lines[1]


def test_before_any_token_the_time_left_is_unknown():
    p, _ = progress()
    assert p.rate() == 0.0 and p.seconds_left() is None and "unknown time left" in p.line()
