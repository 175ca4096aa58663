"""The capture's packer (datagen.engines.capture_pack): pieces arrive in any order, each leaves the
host ring the moment it is in its shard's image (the ring never holds a shard), the image's final
prefix streams to its temporary file while the shard fills and the file is in place only once the
shard closes, byte for byte what ``write_shard`` writes, and a shard whose piece is wrong is
reported and dropped while the others are written."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from datagen.data.contract import ShardFormat
from datagen.data.shards.format import FP8, ShardJob
from datagen.data.shards.image import ImagePool, Layout, ShardImage, new_buffer
from datagen.data.shards.kernels import quantize_fp8, token_stats
from datagen.data.shards.writer import write_shard
from datagen.engines.capture_host import HostArena, HostBlock
from datagen.engines.capture_pack import Chunk, Packer

LAYERS, H = (2, 5), 64
ROWS = [9, 30, 17]  # tokens per row
PIECE = 8  # tokens per piece: every row comes in several


def _job(tmp_path, storage, index=0, name="a"):
    rng = np.random.default_rng(index)
    ids = tuple(rng.integers(3, 500, size=n).astype(np.int32) for n in ROWS)
    return ShardJob(index=index, path=str(tmp_path / name / f"shard-{index:06d}.safetensors"), first_row=0,
                    rows=len(ROWS), sample_rows=tuple(range(len(ROWS))), input_ids=ids,
                    loss_masks=tuple(np.ones(n, np.uint8) for n in ROWS), format=ShardFormat(LAYERS, storage, H),
                    shard_key=f"key{index}")


def _states(storage, seed=0):
    """Per row: stored states [n, L, H], per-token stats [n, 3, L] (the capture's layout), fp8 scales."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in ROWS:
        x = torch.randn(n, len(LAYERS), H, generator=g).to(torch.bfloat16)
        if storage == FP8:
            q, scale = quantize_fp8(x.float())
            from datagen.data.shards.kernels import fp8_token_stats
            out.append((q, fp8_token_stats(q, scale).transpose(1, 2).contiguous(), scale))
        else:
            out.append((x, token_stats(x).transpose(1, 2).contiguous(), None))
    return out


def _pieces():
    """(row, first token, n) of every piece, rows interleaved and each row's pieces backwards."""
    per_row = [[(r, a, min(PIECE, n - a)) for a in range(0, n, PIECE)][::-1] for r, n in enumerate(ROWS)]
    out = []
    while any(per_row):
        for p in per_row:
            if p:
                out.append(p.pop(0))
    return out


def _feed(packer, arena, job, rows, pieces=None):
    for r, a, n in pieces or _pieces():
        x, st, sc = rows[r]
        region, (host, hstats, hscale), _ = arena.take([x[a:a + n], st[a:a + n], None if sc is None else sc[a:a + n]],
                                                       packer.busy)
        host.copy_(x[a:a + n])
        hstats.copy_(st[a:a + n])
        if hscale is not None:
            hscale.copy_(sc[a:a + n])
        packer.put(job, r, a, Chunk(host, hstats, hscale, None, HostBlock(arena, region, 1)))


@pytest.mark.parametrize("storage", ["bfloat16", FP8])
def test_pieces_in_any_order_leave_the_ring_at_once_and_the_shard_is_write_shards_bytes(tmp_path, storage):
    job = _job(tmp_path, storage)
    rows = _states(storage)
    piece_bytes = HostArena.size(PIECE * len(LAYERS) * H * 2) + 2 * HostArena.size(PIECE * 3 * len(LAYERS) * 4)
    arena = HostArena(2 * piece_bytes, pin=False)  # room for two pieces of the shard's nine
    assert len(_pieces()) == 9
    packer = Packer(image_budget_bytes=1 << 30, writers=2)
    _feed(packer, arena, job, rows)
    packer.pieces.join()
    assert arena.outside_bytes == 0  # every step found ring space: the packer freed it, not a write
    assert not arena.live
    time.sleep(0.1)
    assert not any((tmp_path / "a").glob("*.safetensors"))  # not written before its close
    packer.close(job)
    packer.join()
    done, errors = packer.take()
    assert errors == [] and [r.index for r in done] == [0]
    ref = dataclasses.replace(job, path=str(tmp_path / "ref" / "shard-000000.safetensors"))
    want = write_shard(ref, [x for x, _, _ in rows], [st.transpose(1, 2) for _, st, _ in rows],
                       [sc for _, _, sc in rows] if storage == FP8 else None)
    assert (tmp_path / "a" / "shard-000000.safetensors").read_bytes() == (tmp_path / "ref" / "shard-000000.safetensors").read_bytes()
    assert done[0].sha256 == want.sha256 and done[0].layer_stats == want.layer_stats


def test_a_shard_with_a_wrong_piece_is_reported_and_dropped_and_the_next_is_written(tmp_path):
    bad, good = _job(tmp_path, "bfloat16", 0), _job(tmp_path, "bfloat16", 1)
    rows = _states("bfloat16")
    arena = HostArena(1 << 20, pin=False)
    packer = Packer(image_budget_bytes=1 << 30, writers=1)
    wrong = [(0, 0, 8), (0, 4, 8)] + [p for p in _pieces() if p[0] != 0]  # row 0: tokens 4..11 twice, 8 short
    _feed(packer, arena, bad, rows, wrong)
    packer.close(bad)
    _feed(packer, arena, good, rows)
    packer.close(good)
    packer.join()
    done, errors = packer.take()
    assert [r.index for r in done] == [1]
    assert len(errors) == 1 and errors[0].startswith("shard 0:") and "tokens' states were put" in errors[0]
    assert not arena.live  # the failed shard's pieces left the ring too
    assert not (tmp_path / "a" / "shard-000000.safetensors").exists()
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no temporary left


def test_the_image_pool_waits_for_a_write_but_never_for_a_shard_still_being_filled():
    pool = ImagePool(budget_bytes=ImagePool.GRAIN)
    a, waited = pool.take(ImagePool.GRAIN, pending=lambda: False)
    assert waited < 0.05
    b, _ = pool.take(1, pending=lambda: False)  # over the budget: nothing on its way would free one
    assert pool.over_budget_bytes == ImagePool.GRAIN
    import threading
    threading.Timer(0.2, pool.give, args=(a,)).start()
    c, waited = pool.take(1, pending=lambda: True)  # a write is on its way: wait for its buffer
    assert c is a and waited >= 0.15


def _in_order():
    """(row, first token, n) of every piece, rows and their pieces in order (the engine's FCFS)."""
    return [(r, a, min(PIECE, n - a)) for r, n in enumerate(ROWS) for a in range(0, n, PIECE)]


def _ref_bytes(tmp_path, job, rows, storage):
    ref = dataclasses.replace(job, path=str(tmp_path / "ref" / "shard-000000.safetensors"))
    write_shard(ref, [x for x, _, _ in rows], [st.transpose(1, 2) for _, st, _ in rows],
                [sc for _, _, sc in rows] if storage == FP8 else None)
    return Path(ref.path).read_bytes()


def _wait_for(cond, timeout=10.0):
    t0 = time.monotonic()
    while not cond() and time.monotonic() - t0 < timeout:
        time.sleep(0.01)
    return cond()


@pytest.mark.parametrize("storage", ["bfloat16", FP8])
def test_the_final_prefix_ends_at_the_first_token_not_yet_put(storage):
    job = _job(Path("/nonexistent"), storage)
    rows = _states(storage)
    lay = Layout.of(job)
    image = ShardImage(job, new_buffer(lay.size), lay)
    hs_start, _ = lay.spans["hidden_states"]
    per_token = len(LAYERS) * H * (1 if storage == FP8 else 2)
    first_per_token = lay.spans["hidden_states_scale"][0] if storage == FP8 else hs_start
    assert image.ready() == first_per_token  # header and the tensors set when the image was made
    for r in (1, 2):  # rows 1 and 2: row 0's tokens are still missing
        x, st, sc = rows[r]
        image.put(r, 0, x, scale=sc, stats=st.transpose(1, 2))
    assert image.ready() == first_per_token
    x, st, sc = rows[0]
    image.put(0, 0, x[:5], scale=None if sc is None else sc[:5], stats=st[:5].transpose(1, 2))
    # bf16: the states of the first 5 tokens are final; fp8: its scales come first in the file, so
    # the prefix ends inside them (their first 5 tokens'), before any state, until the last token
    assert image.ready() == first_per_token + 5 * (len(LAYERS) * 4 if storage == FP8 else per_token)
    assert storage != FP8 or image.ready() < hs_start
    image.put(0, 5, x[5:], scale=None if sc is None else sc[5:], stats=st[5:].transpose(1, 2))
    assert image.ready() == lay.size


def test_a_shard_streams_to_its_file_while_it_fills_and_ends_as_write_shards_bytes(tmp_path, monkeypatch):
    from datagen.data.shards import image as image_mod
    from datagen.engines import capture_pack

    monkeypatch.setattr(image_mod, "WRITE_PIECE", image_mod.ALIGN)  # stream page by page
    monkeypatch.setattr(capture_pack, "STREAM_MIN", 0)
    job = _job(tmp_path, "bfloat16")
    rows = _states("bfloat16")
    arena = HostArena(1 << 20, pin=False)
    packer = Packer(image_budget_bytes=1 << 30, writers=1, stream=True)
    pieces = _in_order()
    last_row = [p for p in pieces if p[0] == len(ROWS) - 1]
    _feed(packer, arena, job, rows, [p for p in pieces if p not in last_row])
    tmp = lambda: [p for p in (tmp_path / "a").glob(".*.tmp-*")] if (tmp_path / "a").exists() else []
    hs_start, _ = Layout.of(job).spans["hidden_states"]
    done_tokens = sum(ROWS[:-1])
    want = (hs_start + done_tokens * len(LAYERS) * H * 2) // image_mod.ALIGN * image_mod.ALIGN
    assert _wait_for(lambda: tmp() and tmp()[0].stat().st_size == want)  # the final prefix, page-aligned
    assert not (tmp_path / "a" / "shard-000000.safetensors").exists()  # not before its last row
    _feed(packer, arena, job, rows, last_row)
    packer.close(job)
    packer.join()
    done, errors = packer.take()
    assert errors == [] and [r.index for r in done] == [0]
    assert packer.streamed_bytes >= want  # (and more, when the last row came in before the close)
    data = (tmp_path / "a" / "shard-000000.safetensors").read_bytes()
    assert data == _ref_bytes(tmp_path, job, rows, "bfloat16")
    assert done[0].sha256 == hashlib.sha256(data).hexdigest()
    assert tmp() == []


def test_an_fp8_shard_is_written_only_once_its_last_token_is_in(tmp_path, monkeypatch):
    """Its scales lie ahead of its states and end with its last token: nothing of the file past
    the first page is final before."""
    from datagen.data.shards import image as image_mod
    from datagen.engines import capture_pack

    monkeypatch.setattr(image_mod, "WRITE_PIECE", image_mod.ALIGN)
    monkeypatch.setattr(capture_pack, "STREAM_MIN", 0)
    job = _job(tmp_path, FP8)
    rows = _states(FP8)
    arena = HostArena(1 << 20, pin=False)
    packer = Packer(image_budget_bytes=1 << 30, writers=1, stream=True)
    pieces = _in_order()
    _feed(packer, arena, job, rows, pieces[:-1])  # every token but the last few
    packer.pieces.join()
    time.sleep(0.3)
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())
    _feed(packer, arena, job, rows, pieces[-1:])
    packer.close(job)
    packer.join()
    assert (tmp_path / "a" / "shard-000000.safetensors").read_bytes() == _ref_bytes(tmp_path, job, rows, FP8)


def test_a_streamed_write_that_fails_is_redone_at_its_place_by_the_close(tmp_path, monkeypatch):
    """The streamer's write of a piece fails half way (the disk full for a moment): the shard's
    close writes from the last whole piece, at its offset, and the file is still exact."""
    import errno

    from datagen.data.shards import image as image_mod
    from datagen.engines import capture_pack

    monkeypatch.setattr(image_mod, "WRITE_PIECE", image_mod.ALIGN)
    monkeypatch.setattr(capture_pack, "STREAM_MIN", 0)
    real, calls = image_mod.os.pwrite, []

    def flaky(fd, data, offset):
        calls.append(offset)
        if len(calls) == 2:  # the second piece: half of it lands, then the disk refuses
            real(fd, bytes(data)[: len(data) // 2], offset)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(image_mod.os, "pwrite", flaky)
    job = _job(tmp_path, "bfloat16")
    rows = _states("bfloat16")
    arena = HostArena(1 << 20, pin=False)
    packer = Packer(image_budget_bytes=1 << 30, writers=1, stream=True)
    pieces = _in_order()
    _feed(packer, arena, job, rows, pieces[:-1])
    assert _wait_for(lambda: len(calls) >= 2)
    time.sleep(0.2)  # the streamer has given the image up
    _feed(packer, arena, job, rows, pieces[-1:])
    packer.close(job)
    packer.join()
    done, errors = packer.take()
    assert errors == [] and [r.index for r in done] == [0]
    data = (tmp_path / "a" / "shard-000000.safetensors").read_bytes()
    assert data == _ref_bytes(tmp_path, job, rows, "bfloat16") and done[0].sha256 == hashlib.sha256(data).hexdigest()
    assert calls[2] == calls[1]  # the failed piece again, at its own offset
