"""The engine's prompts for a group: images read, checked and decoded on a pool of threads, in order.

No engine starts here (vllm.inputs only): the pool's output is held against the one-by-one
prompts, only a few prompts are made ahead of the one taken, and a changed image must fail the way
the loop failed, naming the first changed image.
"""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest
from PIL import Image

from datagen.data import media_tokens
from datagen.data.media import MediaItem
from datagen.engines.vllm_requests import prompt, prompts
from datagen.errors import DatasetError

PAD = 7  # a stand-in placeholder id: the prompt collapses each image's run of it to one


def _image(path, w, h, seed, mode="RGB"):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).convert(mode).save(path)
    return path


def _sample(tmp_path, i, n_images):
    """Ids with ``n_images`` runs of 3 placeholders and the images' items."""
    ids, items = [100 + i], []
    for j in range(n_images):
        path = _image(tmp_path / f"im-{i}-{j}.png", 40 + 7 * j, 30 + 5 * i, seed=10 * i + j,
                      mode=("RGB", "RGBA", "L")[(i + j) % 3])
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        items.append(MediaItem(url=path.name, path=str(path), sha256=sha, offset=len(ids), tokens=3))
        ids += [PAD] * 3 + [200 + j]
    return np.asarray(ids), tuple(items)


def _same(a, b):
    assert a["prompt_token_ids"] == b["prompt_token_ids"]
    ca = (a.get("multi_modal_data") or {}).get("vision_chunk", [])
    cb = (b.get("multi_modal_data") or {}).get("vision_chunk", [])
    assert [c["uuid"] for c in ca] == [c["uuid"] for c in cb]
    for x, y in zip(ca, cb):
        assert x["image"].mode == y["image"].mode == "RGB"
        assert x["image"].tobytes() == y["image"].tobytes()


def test_the_pooled_prompts_equal_the_one_by_one_prompts_in_order(tmp_path, monkeypatch):
    requests = [_sample(tmp_path, i, n) for i, n in enumerate([1, 2, 0, 1, 2, 1])]
    requests.insert(2, (np.asarray([5, 6, 7]), ()))  # a text row among image rows
    threads = set()
    real = media_tokens.load_image

    def slow_load(path, sha256):  # long enough that a pool of two or more overlaps its loads
        threads.add(threading.current_thread().name)
        time.sleep(0.05)
        return real(path, sha256)

    monkeypatch.setattr(media_tokens, "load_image", slow_load)
    got = list(prompts(requests))
    threads, pooled = set(), set(threads)  # the one-by-one prompts below load on this thread
    assert len(got) == len(requests)
    for (tokens, images), p in zip(requests, got):
        _same(p, prompt(tokens, images))
    assert got[2] == {"prompt_token_ids": [5, 6, 7]}
    assert all(name.startswith("datagen-decode") for name in pooled), pooled
    assert len(pooled) > 1, f"the images were decoded on one thread: {pooled}"


def test_a_changed_image_fails_naming_the_first_changed_one(tmp_path):
    requests = [_sample(tmp_path, i, 1) for i in range(5)]
    first, later = requests[1][1][0], requests[3][1][0]
    for item, seed in ((first, 91), (later, 92)):
        _image(tmp_path / item.url, 33, 33, seed=seed)
    with pytest.raises(DatasetError, match="the image changed since the plan") as e:
        list(prompts(requests))
    assert e.value.path == first.path
    assert "run the extraction again" in e.value.hint


def test_only_a_few_prompts_are_made_ahead_of_the_one_taken(tmp_path, monkeypatch):
    """A group's decoded images are never all in memory at once: two per thread ahead at most."""
    from datagen.engines import vllm_requests

    monkeypatch.setattr(vllm_requests, "DECODE_THREADS", 2)
    requests = [_sample(tmp_path, i, 1) for i in range(20)]
    loaded = []
    real = media_tokens.load_image

    def counting_load(path, sha256):
        loaded.append(path)
        return real(path, sha256)

    monkeypatch.setattr(media_tokens, "load_image", counting_load)
    gen = prompts(requests)
    first = next(gen)
    time.sleep(0.5)  # every prompt the pool was given is made by now
    assert first["prompt_token_ids"][0] == 100
    assert 2 <= len(loaded) <= 1 + 2 * 2 + 1, f"{len(loaded)} images loaded for one prompt taken"
    rest = list(gen)
    assert len(rest) == 19 and len(loaded) == 20


@pytest.mark.parametrize("concurrent", [True, False], ids=["checkpoint-processor", "numba-processor"])
def test_the_render_runs_on_the_pool_only_where_the_processor_allows_it(tmp_path, monkeypatch, concurrent):
    """vLLM's processor renders on the decode pool where it may run on several threads (the
    checkpoint's own, vLLM 0.24), else one by one on the taker's thread (vLLM 0.32's numba kernels
    abort on a second thread); either way the renders come in order, each of its own prompt."""
    from datagen.engines import vllm_requests

    monkeypatch.setattr(vllm_requests, "renders_concurrently", lambda: concurrent)
    requests = [_sample(tmp_path, i, n) for i, n in enumerate([1, 2, 0, 1, 2, 1, 1, 2])]
    where = []

    def render(p):
        where.append(threading.current_thread().name)
        time.sleep(0.05)  # long enough that renders on a pool overlap
        return {"rendered": p["prompt_token_ids"]}

    got = list(prompts(requests, render))
    assert [g["rendered"] for g in got] == [prompt(t, im)["prompt_token_ids"] for t, im in requests]
    if concurrent:
        assert all(n.startswith("datagen-decode") for n in where) and len(set(where)) > 1, where
    else:
        assert set(where) == {threading.current_thread().name}, where


def test_a_failed_render_is_raised_in_order_after_the_renders_before_it(tmp_path, monkeypatch):
    from datagen.engines import vllm_requests

    monkeypatch.setattr(vllm_requests, "renders_concurrently", lambda: True)
    requests = [_sample(tmp_path, i, 1) for i in range(6)]

    def render(p):
        first = p["prompt_token_ids"][0]
        if first in (102, 104):
            time.sleep(0.1 if first == 102 else 0)  # the later failure is made first
            raise ValueError(f"row {first - 100} cannot be rendered")
        return first

    gen = prompts(requests, render)
    assert [next(gen), next(gen)] == [100, 101]
    with pytest.raises(ValueError, match="row 2 cannot"):
        next(gen)
