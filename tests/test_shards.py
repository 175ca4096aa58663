"""The shards (datagen.data.shards): safetensors bytes written once, hashed on the way, fp8 storage."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save

from datagen.data.contract import ShardFormat
from datagen.data.shards.format import FP8, SHARD_FORMAT, ShardJob
from datagen.data.shards.kernels import dequantize_fp8, quantize_fp8, stored_states, token_stats
from datagen.data.shards.writer import write_shard

LAYERS = (2, 3, 6)
H = 40


def job(path: Path, lengths, dtype: str, index: int = 0) -> ShardJob:
    rng = np.random.default_rng(index)
    return ShardJob(
        index=index, path=str(path), first_row=10 * index, rows=len(lengths) + 1,
        sample_rows=tuple(10 * index + i for i in range(len(lengths))),
        input_ids=tuple(rng.integers(0, 500, n).astype(np.int32) for n in lengths),
        loss_masks=tuple((rng.random(n) > 0.5).astype(np.uint8) for n in lengths),
        format=ShardFormat(layer_ids=LAYERS, storage_dtype=dtype, hidden_size=H), shard_key=f"key{index}",
    )


def states(lengths, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, len(LAYERS), H, generator=g) * (1 + torch.arange(len(LAYERS)))[:, None]
            for n in lengths]


def reference_bytes(j: ShardJob, tensors_hs: dict[str, torch.Tensor], meta: str) -> bytes:
    """What safetensors itself writes for the same tensors and metadata."""
    offsets = np.zeros(len(j.input_ids) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in j.input_ids], out=offsets[1:])
    cat = (lambda xs, dt: np.concatenate(xs).astype(dt)) if j.input_ids else (lambda xs, dt: np.zeros(0, dt))
    tensors = {"input_ids": torch.from_numpy(cat(j.input_ids, np.int32)),
               "loss_mask": torch.from_numpy(cat(j.loss_masks, np.uint8)),
               "sample_index": torch.tensor(j.sample_rows, dtype=torch.int64),
               "sample_offsets": torch.from_numpy(offsets), **tensors_hs}
    return save(tensors, metadata={"datagen": meta})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", FP8])
@pytest.mark.parametrize("lengths", [[5, 17, 1], [300], []])
def test_shards_are_byte_identical_to_safetensors_and_hashed_right(tmp_path, dtype, lengths):
    j = job(tmp_path / "shards" / "shard-000000.safetensors", lengths, dtype)
    xs = states(lengths)
    rec = write_shard(j, xs)
    data = Path(j.path).read_bytes()
    if dtype == FP8:
        pairs = [quantize_fp8(x) for x in xs]
        hs = {"hidden_states": torch.cat([q for q, _ in pairs]) if xs else torch.zeros(0, 3, H, dtype=torch.float8_e4m3fn),
              "hidden_states_scale": torch.cat([s for _, s in pairs]) if xs else torch.zeros(0, 3)}
        meta = f'{{"format": "{SHARD_FORMAT}", "layer_ids": [2, 3, 6], "shard_key": "key0", "storage_dtype": "fp8_e4m3"}}'
    else:
        dt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
        hs = {"hidden_states": torch.cat(xs).to(dt) if xs else torch.zeros(0, 3, H, dtype=dt)}
        meta = f'{{"format": "{SHARD_FORMAT}", "layer_ids": [2, 3, 6], "shard_key": "key0"}}'
    assert data == reference_bytes(j, hs, meta)
    assert rec.sha256 == hashlib.sha256(data).hexdigest() and rec.bytes == len(data)
    assert oct(os.stat(j.path).st_mode & 0o777) == "0o644"
    assert not [p for p in Path(j.path).parent.iterdir() if p.name.startswith(".")]  # no temporary left


def test_chunked_states_direct_and_buffered_writes_give_the_same_file(tmp_path, monkeypatch):
    lengths = [700, 3, 129]
    xs = states(lengths, seed=4)
    whole = write_shard(job(tmp_path / "a" / "s.safetensors", lengths, "bfloat16"), xs)
    chunks = [list(x.to(torch.bfloat16).split(64)) for x in xs]  # chunked-prefill steps, as captured
    stats = [[token_stats(c) for c in cs] for cs in chunks]
    chunked = write_shard(job(tmp_path / "b" / "s.safetensors", lengths, "bfloat16"), chunks, stats)
    monkeypatch.setenv("DATAGEN_DIRECT_IO", "0")
    buffered = write_shard(job(tmp_path / "c" / "s.safetensors", lengths, "bfloat16"), xs)
    assert whole.sha256 == chunked.sha256 == buffered.sha256
    assert whole.layer_stats == buffered.layer_stats
    for a, b in zip(whole.layer_stats, chunked.layer_stats):  # float32 sums per chunk vs per shard
        assert a.mean == pytest.approx(b.mean, rel=1e-5, abs=1e-7) and a.std == pytest.approx(b.std, rel=1e-5)


@pytest.mark.parametrize("refuses_at", ["open", "write"])
def test_a_filesystem_without_direct_io_gets_buffered_writes(tmp_path, monkeypatch, refuses_at):
    import errno

    from datagen.data.shards import image_file as writer  # the file image's write

    ref = write_shard(job(tmp_path / "a" / "s.safetensors", [33, 9], "bfloat16"), states([33, 9]))
    real_open, real_write, direct_fds = os.open, os.pwrite, set()

    def fake_open(path, flags, *a):
        if flags & os.O_DIRECT and refuses_at == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags, *a)
        (direct_fds.add if flags & os.O_DIRECT else direct_fds.discard)(fd)
        return fd

    refused = []

    def fake_write(fd, data, offset):
        if fd in direct_fds:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data, offset)

    monkeypatch.setattr(writer.os, "open", fake_open)
    monkeypatch.setattr(writer.os, "pwrite", fake_write)
    rec = write_shard(job(tmp_path / "b" / "s.safetensors", [33, 9], "bfloat16"), states([33, 9]))
    assert rec.sha256 == ref.sha256 == hashlib.sha256((tmp_path / "b" / "s.safetensors").read_bytes()).hexdigest()
    assert refused == ([0] if refuses_at == "write" else [])  # refused once, at the start, then buffered


def test_shapes_that_do_not_match_the_rows_are_refused(tmp_path):
    with pytest.raises(ValueError, match="row 1: states of shape"):
        write_shard(job(tmp_path / "s.safetensors", [5, 6], "bfloat16"), states([5, 7]))
    assert not (tmp_path / "s.safetensors").exists()


def test_fp8_values_are_fp8_times_a_per_token_per_layer_scale(tmp_path):
    lengths = [64, 31]
    xs = states(lengths, seed=7)
    xs[0][3, 1] = 0.0  # an all-zero vector keeps scale 1
    rec = write_shard(job(tmp_path / "s.safetensors", lengths, FP8), xs)
    t = load_file(str(tmp_path / "s.safetensors"))
    assert t["hidden_states"].dtype == torch.float8_e4m3fn and t["hidden_states_scale"].dtype == torch.float32
    assert t["hidden_states_scale"].shape == (sum(lengths), len(LAYERS))
    x = torch.cat(xs)
    got = stored_states(t)
    assert torch.equal(got, t["hidden_states"].float() * t["hidden_states_scale"][..., None])
    assert t["hidden_states_scale"][3, 1] == 1.0 and not got[3, 1].any()
    # each vector's absmax is stored exactly (448 * scale), the rest within e4m3's half step (1/16)
    assert torch.allclose(got.abs().amax(-1), x.abs().amax(-1), rtol=1e-6)
    rel = (got - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)
    assert float(rel.max()) < 0.05 and float(rel.median()) > 0.005  # a real quantization, not a copy
    # the records describe the stored values
    f = got.double()
    for j, s in enumerate(rec.layer_stats):
        assert s.sum == pytest.approx(float(f[:, j].sum()), rel=1e-5, abs=1e-4)
        assert s.absmax == pytest.approx(float(f[:, j].abs().max()), rel=1e-6)


def test_fp8_keeps_nan_and_inf_visible():
    x = torch.randn(4, 2, 8)
    x[1, 0, 3] = float("nan")
    x[2, 1, 0] = float("inf")
    q, s = quantize_fp8(x)
    back = dequantize_fp8(q, s)
    assert back[1, 0].isnan().any() and back[2, 1].isnan().any()
    assert torch.isfinite(back[0]).all() and torch.isfinite(back[3]).all()


def test_a_wrong_number_of_state_tensors_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="shard 0: 2 state tensors for 3 samples"):
        write_shard(job(tmp_path / "s.safetensors", [4, 5, 6], "bfloat16"), states([4, 5]))
    assert list(tmp_path.iterdir()) == []


def test_states_already_quantized_by_the_engine_are_stored_as_given(tmp_path):
    """The vLLM capture quantizes on the GPU and hands over fp8 states with their scales: the file
    holds exactly those, the same bytes as when the writer quantizes the float states itself."""
    lengths = [9, 40]
    xs = states(lengths, seed=3)
    pairs = [quantize_fp8(x) for x in xs]
    given = write_shard(job(tmp_path / "a" / "s.safetensors", lengths, FP8), [q for q, _ in pairs],
                        per_sample_scales=[s for _, s in pairs])
    quantized_here = write_shard(job(tmp_path / "b" / "s.safetensors", lengths, FP8), xs)
    t = load_file(str(tmp_path / "a" / "s.safetensors"))
    assert torch.equal(t["hidden_states"].view(torch.uint8), torch.cat([q for q, _ in pairs]).view(torch.uint8))
    assert torch.equal(t["hidden_states_scale"], torch.cat([s for _, s in pairs]))
    assert given.sha256 == quantized_here.sha256 and given.layer_stats == quantized_here.layer_stats
    # the round trip: within e4m3's rounding of the float states
    x = torch.cat(xs)
    assert float(((stored_states(t) - x).norm(dim=-1) / x.norm(dim=-1)).max()) < 0.05


def test_the_hash_is_taken_piece_by_piece_while_writing_and_matches_the_file(tmp_path, monkeypatch):
    from datagen.data.shards import image_file as writer  # the file image's write

    lengths = [300, 257]  # about 130 kB of bfloat16 states: 11 pieces of 12 kB, the last one short
    monkeypatch.setattr(writer, "WRITE_PIECE", 3 * writer.ALIGN)
    seen: list[int] = []

    class CountingSha:
        def __init__(self, h=None):
            self._h = h or hashlib.new("sha256")

        def copy(self):
            return CountingSha(self._h.copy())

        def update(self, data):
            seen.append(len(data))
            self._h.update(data)

        def hexdigest(self):
            return self._h.hexdigest()

    monkeypatch.setattr(writer.hashlib, "sha256", CountingSha)
    for direct in ("1", "0"):
        monkeypatch.setenv("DATAGEN_DIRECT_IO", direct)
        seen.clear()
        rec = write_shard(job(tmp_path / direct / "s.safetensors", lengths, "bfloat16"), states(lengths))
        data = (tmp_path / direct / "s.safetensors").read_bytes()
        assert rec.sha256 == hashlib.new("sha256", data).hexdigest() and rec.bytes == len(data)
        assert len(seen) == -(-len(data) // writer.WRITE_PIECE) and sum(seen) == len(data)


def test_a_reused_file_image_leaves_no_bytes_of_the_previous_shard(tmp_path):
    """The writer reuses its page-aligned image per thread: a small shard written after a large
    one must be the same bytes as one written from a fresh image."""
    import threading

    small = [7, 3]
    fresh: dict = {}

    def in_new_thread():  # a new thread: a new image
        fresh["rec"] = write_shard(job(tmp_path / "fresh" / "s.safetensors", small, "float32"), states(small, seed=9))

    t = threading.Thread(target=in_new_thread)
    t.start()
    t.join()
    write_shard(job(tmp_path / "big" / "s.safetensors", [900, 900], "float32"), states([900, 900], seed=1))
    reused = write_shard(job(tmp_path / "reused" / "s.safetensors", small, "float32"), states(small, seed=9))
    assert reused.sha256 == fresh["rec"].sha256
    assert (tmp_path / "reused" / "s.safetensors").read_bytes() == (tmp_path / "fresh" / "s.safetensors").read_bytes()


def test_a_failed_write_leaves_neither_the_shard_nor_a_temporary(tmp_path, monkeypatch):
    import errno

    from datagen.data.shards import image_file as writer  # the file image's write

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_shard(job(tmp_path / "shards" / "s.safetensors", [5], "bfloat16"), states([5]))
    assert list((tmp_path / "shards").iterdir()) == []


def test_a_shard_job_survives_the_wire_as_plain_lists():
    j = job(Path("/x/shard-000002.safetensors"), [3, 0, 5], "bfloat16", index=2)
    wire = json.loads(json.dumps(j.to_wire()))  # what msgpack carries: lists, ints, strings
    # the run's format is not in a shard's message: the worker has it from the engine's start
    assert not {"format", "layer_ids", "storage_dtype", "hidden_size", "dtype"} & set(wire)
    fmt = ShardFormat.from_wire(json.loads(json.dumps(j.format.to_wire())))
    assert fmt == j.format
    back = ShardJob.from_wire(wire, fmt)
    assert back.sample_rows == j.sample_rows and back.layer_ids == j.layer_ids and back.tokens == j.tokens == 8
    for a, b in zip(back.input_ids + back.loss_masks, j.input_ids + j.loss_masks):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert (back.index, back.path, back.first_row, back.rows, back.storage_dtype, back.hidden_size, back.shard_key) == (
        j.index, j.path, j.first_row, j.rows, j.storage_dtype, j.hidden_size, j.shard_key)


def test_a_shard_format_names_a_stored_dtype():
    with pytest.raises(ValueError, match="storage dtype 'int8'"):
        ShardFormat(layer_ids=(1, 2), storage_dtype="int8", hidden_size=8)


def test_shard_statistics_combine_exactly_into_the_datasets(tmp_path):
    from datagen.data.shards.kernels import combine_stats, layer_stats

    parts = [torch.randn(n, len(LAYERS), H) * 3 + 1 for n in (17, 1, 40)]
    empty = layer_stats(torch.zeros(0, len(LAYERS), H), LAYERS)
    assert [s.count for s in empty] == [0, 0, 0] and all(s.mean == s.std == s.absmax == 0.0 for s in empty)
    combined = combine_stats([layer_stats(p, LAYERS) for p in parts] + [empty], LAYERS)
    whole = torch.cat(parts)
    at_once = layer_stats(whole, LAYERS)
    for j, s in enumerate(combined):
        v = whole[:, j].double()
        assert s.layer_id == LAYERS[j] and s.count == v.numel() == at_once[j].count
        # the float64 sums add: the same as the statistics of all tokens at once, up to summation order
        assert s.sum == pytest.approx(at_once[j].sum, rel=1e-12) and s.sumsq == pytest.approx(at_once[j].sumsq, rel=1e-12)
        assert s.mean == pytest.approx(float(v.mean()), rel=1e-5)
        assert s.std == pytest.approx(float(v.std(unbiased=False)), rel=1e-5)
        assert s.absmax == at_once[j].absmax == float(v.abs().max())
