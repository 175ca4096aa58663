"""datagen.reader: every sample as stored, in export's numbering; shards that disagree with the manifest refused."""

from __future__ import annotations

import pytest
import torch

from datagen.errors import DatasetError, ValidationFailed
from datagen.reader import ShardRefused, Verify, open_dataset
from tests.support.extracted import (
    SKIPPED_ROWS, copy_dataset, extracted_dataset, manifest, shard_path, stored_samples,
    write_manifest,
)
from tests.support.synthetic_shards import make_synthetic_dataset, row_value


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return extracted_dataset(tmp_path_factory)


def test_every_sample_is_read_as_stored_in_dataset_row_order(pristine):
    reader = open_dataset(pristine)
    want = stored_samples(pristine)

    assert reader.rows == sorted(want) and not set(reader.rows) & set(SKIPPED_ROWS)
    assert len(reader) == manifest(pristine)["totals"]["samples"]
    for i, row in enumerate(reader.rows):
        s = reader[i]
        assert s.row == row
        assert torch.equal(s.input_ids, want[row]["input_ids"].long())
        assert torch.equal(s.loss_mask, want[row]["loss_mask"].long())
        assert s.hidden_states.dtype == torch.bfloat16
        assert torch.equal(s.hidden_states, want[row]["hidden_states"])
        assert reader.lengths[i] == len(want[row]["input_ids"])


def test_fp8_shards_are_dequantized_to_bf16_with_their_scales(tmp_path):
    fp8 = open_dataset(make_synthetic_dataset(tmp_path / "fp8", storage="fp8", rows=20, skipped=(5,)))
    bf16 = open_dataset(make_synthetic_dataset(tmp_path / "bf16", storage="bf16", rows=20, skipped=(5,)))

    assert fp8.rows == bf16.rows and fp8.lengths == bf16.lengths
    for i in range(len(fp8)):
        a, b = fp8[i].hidden_states, bf16[i].hidden_states.float()
        assert a.dtype == torch.bfloat16 and a.shape == b.shape
        rel = ((a.float() - b).abs() / b.abs().clamp(min=1e-3)).flatten()
        assert rel.median() < 0.04 and rel.quantile(0.99) < 0.08  # e4m3 keeps 3 mantissa bits
        # each layer sits at row_value + its index: the right layer is much closer than its neighbour
        means = a.float().mean(dim=(0, 2))
        want = torch.tensor([row_value(fp8.rows[i]) + j for j in range(a.shape[1])])
        assert (means - want).abs().max() < 0.2


def test_a_shard_with_another_size_is_refused_when_opened(pristine, tmp_path):
    ds = copy_dataset(pristine, tmp_path / "ds")
    with shard_path(ds, 1).open("ab") as f:
        f.write(b"\0")

    with pytest.raises(ShardRefused, match="shard-000001.*bytes, the manifest says") as e:
        open_dataset(ds)
    assert isinstance(e.value, ValidationFailed)


def test_a_shard_of_another_spec_is_refused_when_opened(pristine, tmp_path):
    ds = copy_dataset(pristine, tmp_path / "ds")
    m = manifest(ds)
    m["shards"][2]["shard_key"] = "0" * 64
    write_manifest(ds, m)

    with pytest.raises(ShardRefused, match="shard-000002.*shard key"):
        open_dataset(ds)


def test_a_shard_of_other_layers_is_refused_when_opened(tmp_path):
    ds = make_synthetic_dataset(tmp_path / "ds", rows=8)
    m = manifest(ds)
    m["spec"]["layer_ids"] = [0, 1, 2, 4]
    write_manifest(ds, m)

    with pytest.raises(ShardRefused, match="layers"):
        open_dataset(ds)


def test_a_changed_byte_is_refused_before_any_sample_of_its_shard_is_handed_out(pristine, tmp_path):
    ds = copy_dataset(pristine, tmp_path / "ds")
    p = shard_path(ds, 1)
    data = bytearray(p.read_bytes())
    data[-len(data) // 3] ^= 0x40  # inside the hidden states: header and size unchanged
    p.write_bytes(bytes(data))
    reader = open_dataset(ds)  # opening reads headers only
    in_shard_1 = [i for i, r in enumerate(reader.rows) if 8 <= r < 16]
    elsewhere = [i for i, r in enumerate(reader.rows) if r < 8]

    assert reader[elsewhere[0]].row == reader.rows[elsewhere[0]]
    for i in in_shard_1:
        with pytest.raises(ShardRefused, match="shard-000001.*sha256"):
            reader[i]
    # without the content check the same byte goes through: the check is what stops it
    unchecked = open_dataset(ds, verify=Verify.NONE)
    assert unchecked[in_shard_1[0]].row == reader.rows[in_shard_1[0]]


def test_verifying_up_front_hashes_the_shards_of_the_samples_asked_once_and_workers_inherit_it(pristine, tmp_path):
    import pickle

    ds = copy_dataset(pristine, tmp_path / "ds")
    reader = open_dataset(ds)
    in_shard_0 = [i for i, r in enumerate(reader.rows) if r < 8]
    sizes = {s.record.index: s.record.bytes for s in reader.shards}

    assert reader.verify_samples(in_shard_0[:2]) == sizes[0]  # only the shard that holds them
    assert [s.verified for s in reader.shards] == [s.record.index == 0 for s in reader.shards]
    assert reader.verify_samples(in_shard_0) == 0  # done once
    assert reader.verify_samples() == sum(sizes.values()) - sizes[0]
    # what a spawned loader worker receives reads without hashing again: a byte changed now goes through
    worker = pickle.loads(pickle.dumps(reader))
    p = shard_path(ds, 1)
    data = bytearray(p.read_bytes())
    data[-len(data) // 3] ^= 0x40
    p.write_bytes(bytes(data))
    assert all(s.verified for s in worker.shards)
    in_shard_1 = next(i for i, r in enumerate(reader.rows) if 8 <= r < 16)
    assert worker[in_shard_1].row == reader.rows[in_shard_1]
    # while a reader that checks up front refuses the changed shard before training starts
    with pytest.raises(ShardRefused, match="shard-000001.*sha256"):
        open_dataset(ds).verify_samples()


def test_a_dataset_without_a_manifest_is_refused(tmp_path):
    (tmp_path / "shards").mkdir()
    with pytest.raises(DatasetError, match="manifest"):
        open_dataset(tmp_path)


def test_stored_checksums_are_an_s3_mode(tmp_path):
    ds = make_synthetic_dataset(tmp_path / "ds", rows=4)
    with pytest.raises(DatasetError, match="S3"):
        open_dataset(ds, verify=Verify.STORED)


def test_a_manifest_path_leading_outside_the_dataset_is_refused(tmp_path):
    ds = make_synthetic_dataset(tmp_path / "ds", rows=8)
    m = manifest(ds)
    m["shards"][0]["path"] = "../elsewhere.safetensors"
    write_manifest(ds, m)

    with pytest.raises(ValueError, match="outside the dataset"):
        open_dataset(ds)


def test_a_reader_pickles_small_and_reads_the_same_after(tmp_path):
    import pickle

    ds = make_synthetic_dataset(tmp_path / "ds", rows=24, hidden=64, tokens=(30, 40))
    reader = open_dataset(ds)
    blob = pickle.dumps(reader)  # what a spawned DataLoader worker receives
    again = pickle.loads(blob)

    assert len(blob) < sum(r.bytes for r in reader.manifest.shards) / 10  # headers and offsets, not states
    for i in (0, 7, len(reader) - 1):
        assert torch.equal(again[i].hidden_states, reader[i].hidden_states)
