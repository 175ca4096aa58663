"""``datagen`` slowed down: a pause after each shard the extraction submits to its engine, a window
for the fault tests to kill a run in the middle of its extraction (the product has no such switch);
with RENDER_DELAY_S in the environment, also a pause before each request the vLLM engine renders, so
that a group's requests reach the engine core slowly.

    [RENDER_DELAY_S=0.5] python -m tests.support.slow_datagen SECONDS <datagen arguments...>
"""

from __future__ import annotations

import functools
import os
import sys
import time


def slow_datagen_cmd(seconds: float, *args: str) -> list[str]:
    """The command line of ``datagen ARGS`` pausing ``seconds`` after each shard (run from the repository)."""
    return [sys.executable, "-m", "tests.support.slow_datagen", str(seconds), *args]


def pause_after_each_shard(seconds: float) -> None:
    """Every engine (those defined and those still to be) pauses ``seconds`` after each ``submit``."""
    from datagen.engines.base import Engine

    def slowed(cls: type) -> None:
        submit = cls.__dict__.get("submit")
        if submit is None or getattr(submit, "_slowed", False):
            return

        @functools.wraps(submit)
        def submit_then_pause(self, job):
            submit(self, job)
            time.sleep(seconds)

        submit_then_pause._slowed = True
        cls.submit = submit_then_pause

    def every_subclass(cls: type):
        for sub in cls.__subclasses__():
            yield sub
            yield from every_subclass(sub)

    for cls in every_subclass(Engine):
        slowed(cls)
    def init_subclass(cls, **kwargs):  # engines defined from now on (Engine defines no hook of its own)
        super(Engine, cls).__init_subclass__(**kwargs)
        slowed(cls)

    Engine.__init_subclass__ = classmethod(init_subclass)


def pause_before_each_render(seconds: float) -> None:
    """The vLLM engine pauses ``seconds`` before it renders each request (on its render thread)."""
    from datagen.engines.vllm_engine import VllmEngine

    render = VllmEngine._render_one

    def render_later(self, prompt):
        time.sleep(seconds)
        return render(self, prompt)

    VllmEngine._render_one = render_later


def main(argv: list[str]) -> int:
    seconds, *args = argv
    if float(seconds) > 0:
        pause_after_each_shard(float(seconds))
    if float(os.environ.get("RENDER_DELAY_S", 0)) > 0:
        pause_before_each_render(float(os.environ["RENDER_DELAY_S"]))
    from datagen.cli import main as datagen_main

    return datagen_main(args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
