"""The run's progress: rates from the first token handed over (not the process start), the last
minute's rate, tokens done and left, the time left and the bytes written per second."""

from __future__ import annotations

import logging

from datagen.extraction.progress import Progress


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
    caplog.set_level(logging.INFO, logger="datagen.extraction.progress")
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


def test_the_run_loop_counts_tokens_when_their_shard_is_written_not_when_handed_over(monkeypatch):
    """The engine holds every shard until ``finish`` (a stub engine: the loop's contract, not a model's):
    the tokens handed over are not done; the progress reaches 100% only with the records written."""
    from types import SimpleNamespace

    from datagen.extraction import run

    class HoldingEngine:  # a stand-in: submit keeps the job, finish hands every shard's record out
        def __init__(self):
            self.jobs = []

        def submit(self, job):
            self.jobs.append(job)

        def completed(self):
            return []

        def finish(self):
            return [SimpleNamespace(index=j.index, tokens=j.tokens, bytes=10 * j.tokens) for j in self.jobs]

    saved = {}
    monkeypatch.setattr(run, "build_job", lambda p, k: SimpleNamespace(index=k, tokens=100 * (k + 1)))
    monkeypatch.setattr(run, "_placed", lambda p, recs: recs)
    monkeypatch.setattr(run, "save_records", lambda out, recs, records: records.update({r.index: r for r in recs}))
    plan = SimpleNamespace(spec=SimpleNamespace(out="unused"))
    p, clock = progress(total=600)
    engine = HoldingEngine()
    original_finish = engine.finish

    def finish():
        assert p.done == 0, "tokens handed to the engine are not done until their shard is written"
        return original_finish()

    engine.finish = finish
    records = run.extract_shards(plan, engine, [0, 1, 2], progress=p)
    assert sorted(records) == [0, 1, 2] and p.done == 600 and p.written == 6_000
