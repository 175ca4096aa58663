"""`datagen export --format speculators`: the real speculators training dataset loads every sample."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from datagen import cli
from datagen.errors import DatasetError, OutputConflictError, ValidationFailed
from datagen.export import speculators as export
from tests.support.extracted import (
    SKIPPED_ROWS, copy_dataset, extracted_dataset, manifest, shard_path, stored_samples,
)


@pytest.fixture(scope="session")
def pristine(tmp_path_factory) -> Path:
    return extracted_dataset(tmp_path_factory)


@pytest.fixture(scope="session")
def exported(pristine, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "speculators"
    assert cli.main(["export", "--format", "speculators", str(pristine), str(out)]) == 0
    return out


def test_speculators_loads_every_exported_sample_as_stored(pristine, exported):
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.recovery import SampleUnavailable

    m = manifest(pristine)
    hidden, layers = m["spec"]["model"]["hidden_size"], len(m["spec"]["layer_ids"])
    stored = stored_samples(pristine)
    record = json.loads((exported / export.EXPORT_RECORD).read_text())
    assert record["rows"] == sorted(stored) and not set(record["rows"]) & set(SKIPPED_ROWS)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # speculators warns, then skips, on a token mismatch
        data = ArrowDataset(max_len=4096, datapath=str(exported), on_missing="raise")
        assert len(data) == len(stored) == m["totals"]["samples"]
        items = [data[i] for i in range(len(data))]

    for i, (item, row) in enumerate(zip(items, record["rows"])):
        assert not isinstance(item, SampleUnavailable), i
        want = stored[row]
        assert torch.equal(item["input_ids"], want["input_ids"].long())
        assert torch.equal(item["loss_mask"], want["loss_mask"].long())
        hs = want["hidden_states"]  # [T, L, H]: aux layers, then the final layer
        assert torch.equal(item["hidden_states"], hs[:, :-1].flatten(1))
        assert torch.equal(item["verifier_last_hidden_states"], hs[:, -1])
        assert data.approx_lengths[i] == len(want["input_ids"])

    batch = CollateFn(4096, hidden, num_target_layers=layers - 1)(items[:4])
    assert batch["hidden_states"].shape == (1, 4096, (layers - 1) * hidden)
    assert batch["error_records"] == 0


def test_token_frequencies_count_the_assistant_tokens(pristine, exported):
    freq = torch.load(exported / "token_freq.pt", weights_only=True)
    stored = stored_samples(pristine)
    assert sum(freq.values()) == sum(int(s["loss_mask"].sum()) for s in stored.values())


def test_a_dataset_without_a_manifest_is_refused(pristine, tmp_path):
    ds = copy_dataset(pristine, tmp_path / "ds")
    (ds / "manifest.json").unlink()

    with pytest.raises(DatasetError, match="no manifest.json"):
        export.export(ds, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_corrupt_shard_stops_the_export_and_leaves_nothing(pristine, tmp_path):
    ds = copy_dataset(pristine, tmp_path / "ds")
    p = shard_path(ds, 2)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))

    with pytest.raises(ValidationFailed, match="sha256"):
        export.export(ds, tmp_path / "out")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ds"]  # no output, no temporary directory


def test_a_crash_midway_leaves_no_output(pristine, tmp_path, monkeypatch):
    calls = []

    def failing_save(tensors, path, **kw):
        calls.append(path)
        if len(calls) == 5:
            raise OSError("disk full")
        return real(tensors, path, **kw)

    real = export.save_file
    monkeypatch.setattr(export, "save_file", failing_save)

    with pytest.raises(OSError, match="disk full"):
        export.export(pristine, tmp_path / "out", workers=1)
    assert list(tmp_path.iterdir()) == []


def test_exporting_again_is_a_no_op_and_another_output_is_refused(pristine, exported, tmp_path):
    again = export.export(pristine, exported)
    assert again["cached"] is True

    other = tmp_path / "other"
    other.mkdir()
    (other / "something").write_text("x")
    with pytest.raises(OutputConflictError):
        export.export(pristine, other)


def test_a_manifest_changed_after_its_validation_is_refused_and_nothing_is_written(pristine, tmp_path):
    from datagen.validation.dataset import validate

    ds = copy_dataset(pristine, tmp_path / "ds")
    from datagen.validation.settings import ValidationSettings

    assert validate(ds, ValidationSettings(golden_samples=0))["ok"]
    m = manifest(ds)
    m["totals"]["tokens"] += 0  # the same values, other bytes: validation approved the bytes
    (ds / "manifest.json").write_text(json.dumps(m) + "\n")
    with pytest.raises(ValidationFailed, match="changed after it was validated") as e:
        export.export(ds, tmp_path / "out")
    assert "datagen validate" in e.value.hint and not (tmp_path / "out").exists()
    assert validate(ds, ValidationSettings(golden_samples=0))["ok"]  # validated again: exported
    assert export.export(ds, tmp_path / "out")["validated"]
