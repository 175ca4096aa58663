"""The vLLM engine's requests: a row's prompt (its token ids, its images as vLLM multimodal inputs),
a group's prompts with their images decoded (and, where the image processor allows, rendered) on a
pool of threads, and a group's requests taken in order from the engine's render thread
(``VllmEngine``)."""

from __future__ import annotations

import os
import queue
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from itertools import islice

DECODE_THREADS = 16  # at most this many threads read and decode a group's images (prompts())


def prompt(tokens, images=()):
    """The request's prompt: its token ids, and its images as vLLM multimodal inputs beside them."""
    from vllm.inputs import TokensPrompt

    if not images:
        return TokensPrompt(prompt_token_ids=tokens.tolist())
    from datagen.data.media_tokens import engine_prompt

    return TokensPrompt(**engine_prompt(tokens, images))


@cache
def renders_concurrently() -> bool:
    """Whether vLLM's multimodal processing may run on several threads at once in this process: where
    the image processor is the checkpoint's own (vLLM 0.24, which itself lets that processing run on
    a pool of ``renderer_num_workers`` threads when its processor cache is off, as the engine's is). Not
    vLLM 0.32's own Kimi-K2.5 processor: its numba kernels abort on a second thread ("Concurrent
    access has been detected"), and 0.32 keeps that processing on one thread."""
    from datagen.data.media_processor import fused_processor_class

    return fused_processor_class() is None


def _made(request, render):
    made = prompt(*request)
    return made if render is None else render(made)


def prompts(requests, render=None):
    """The prompts of ``(tokens, images)`` pairs, yielded in order; with ``render``, what ``render``
    makes of each (vLLM's engine input). Where two or more have images, the images are read, checked
    (sha256) and decoded on a pool of threads, which PIL's decoders and hashlib run outside the GIL:
    done one after another, this host work left the GPU idle for longer than the group's own steps
    took (docs/datasets-media.md, "Throughput at Kimi's width"). The pool renders them too where the
    image processor allows it (``renders_concurrently``): vLLM's processor (resize, normalize, cut
    into patches) was the larger part of that work, and a run's first group waits for all of its own
    (docs/performance.md, "The image rows' first group"). At most two prompts per thread are made
    ahead of the one taken, so a group's decoded images are never all in memory at once. The first
    failure in order is raised where its prompt is taken, as the loop one by one raised it."""
    with_images = sum(1 for _, images in requests if images)
    if with_images < 2:
        yield from (_made(r, render) for r in requests)
        return
    # the render on the pool where the processor may run on several threads, else here, in order
    pooled, here = (render, None) if render is not None and renders_concurrently() else (None, render)
    workers = min(with_images, max(2, os.cpu_count() or 1), DECODE_THREADS)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="datagen-decode")
    try:
        ahead = iter(requests)
        pending = deque(pool.submit(_made, r, pooled) for r in islice(ahead, 2 * workers))
        while pending:
            done = pending.popleft().result()
            for r in islice(ahead, 1):
                pending.append(pool.submit(_made, r, pooled))
            yield done if here is None else here(done)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class Rendered:
    """A group's engine inputs, made in order from the render thread (``render`` of each prompt of
    ``pairs``, by ``prompts``: on its pool where it may) and taken in order as they are made: a group
    rendered ahead is added at once, one that is not is added as it renders. A render's failure is
    raised where its input is taken."""

    def __init__(self, pool: ThreadPoolExecutor, render, pairs: list):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._count = len(pairs)
        self.waited_s = 0.0  # time the taker waited for an input not rendered yet
        self._future = pool.submit(self._run, render, pairs)

    def _run(self, render, pairs) -> None:
        try:
            for item in prompts(pairs, render):
                self._queue.put((item, None))
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
