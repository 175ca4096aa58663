"""The vLLM engine's requests: a row's prompt (its token ids, its images as vLLM multimodal inputs),
a group's prompts with their images decoded on a pool of threads, and a group's requests rendered
in order on the engine's render thread (``VllmEngine``)."""

from __future__ import annotations

import os
import queue
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from itertools import islice

DECODE_THREADS = 16  # at most this many threads read and decode a group's images (prompts())


def prompt(tokens, images=()):
    """The request's prompt: its token ids, and its images as vLLM multimodal inputs beside them."""
    from vllm.inputs import TokensPrompt

    if not images:
        return TokensPrompt(prompt_token_ids=tokens.tolist())
    from datagen.data.media_tokens import engine_prompt

    return TokensPrompt(**engine_prompt(tokens, images))


def prompts(requests):
    """The prompts of ``(tokens, images)`` pairs, yielded in order. Where two or more have images,
    the images are read, checked (sha256) and decoded on a pool of threads, which PIL's decoders
    and hashlib run outside the GIL: done one after another, this host work left the GPU idle for
    longer than the group's own steps took (docs/datasets-media.md, "Throughput at Kimi's width").
    At most two prompts per thread are made ahead of the one taken, so a group's decoded images are
    never all in memory at once. The first failure in order is raised where its prompt is taken,
    as the loop one by one raised it."""
    with_images = sum(1 for _, images in requests if images)
    if with_images < 2:
        yield from (prompt(tokens, images) for tokens, images in requests)
        return
    workers = min(with_images, max(2, os.cpu_count() or 1), DECODE_THREADS)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="datagen-decode")
    try:
        ahead = iter(requests)
        pending = deque(pool.submit(prompt, *r) for r in islice(ahead, 2 * workers))
        while pending:
            done = pending.popleft().result()
            for r in islice(ahead, 1):
                pending.append(pool.submit(prompt, *r))
            yield done
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class Rendered:
    """A group's engine inputs, made in order on the render thread (``render`` of each prompt of
    ``pairs``, images decoded by ``prompts``) and taken in order as they are made: a group rendered
    ahead is added at once, one that is not is added as it renders. A render's failure is raised
    where its input is taken."""

    def __init__(self, pool: ThreadPoolExecutor, render, pairs: list):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._count = len(pairs)
        self.waited_s = 0.0  # time the taker waited for an input not rendered yet
        self._future = pool.submit(self._run, render, pairs)

    def _run(self, render, pairs) -> None:
        try:
            for p in prompts(pairs):
                self._queue.put((render(p), None))
        except BaseException as e:  # noqa: BLE001 (handed to the taker, raised there)
            self._queue.put((None, e))

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> None:
        self._future.cancel()  # one not started yet; a running render ends by itself, its inputs unread

    def __iter__(self):
        for _ in range(self._count):
            t = time.monotonic()
            item, error = self._queue.get()
            self.waited_s += time.monotonic() - t
            if error is not None:
                raise error
            yield item
