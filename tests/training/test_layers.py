"""A dataset's layers read as a dataset of their own (``datagen.training.layers.LayerView``): one
extraction at the union of layer lists serves a draft for each list, and under other ids it is the
mislabelled dataset the training proof trains its wrong drafts on; on the tiny model's dataset."""

from __future__ import annotations

import json

import pytest
import torch

from datagen.errors import SpecError
from datagen.reader import open_dataset
from datagen.training.agreement import TargetStates, measure_agreement
from datagen.training.draft import train_draft
from datagen.training.layers import LayerView
from datagen.training.settings import DraftSettings
from tests.support.extracted import extracted_dataset

TINY = DraftSettings(steps=2, total_seq_len=256, train_ratio=0.75, ttt_steps=2)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return extracted_dataset(tmp_path_factory)


def test_a_view_reads_the_layers_it_takes_in_its_order_and_everything_else_as_stored(dataset):
    reader = open_dataset(dataset)
    *aux, final = reader.layer_ids
    view = LayerView(reader, [aux[1], aux[0], final])
    assert view.layer_ids == (aux[1], aux[0], final) and len(view) == len(reader)
    assert view.lengths == reader.lengths and view.manifest.fingerprint == reader.manifest.fingerprint
    for i in (0, len(reader) - 1):
        s, v = reader[i], view[i]
        assert torch.equal(v.input_ids, s.input_ids) and torch.equal(v.loss_mask, s.loss_mask)
        assert torch.equal(v.hidden_states, s.hidden_states[:, [1, 0, 2]])
    assert str(aux[1]) in view.location and " as " not in view.location
    assert LayerView(reader, reader.layer_ids).location == reader.location


def test_a_view_offers_no_way_to_the_stored_states_of_every_layer(dataset):
    """The reader's raw reads hand out every stored layer; through a view they would bypass its layers."""
    reader = open_dataset(dataset)
    view = LayerView(reader, reader.layer_ids[1:])
    for name in ("read_into", "read_run", "sample_in", "stored_dtype"):
        assert not hasattr(view, name), name
    with pytest.raises(AttributeError, match="view\\[i\\]"):
        view.read_into(0, 0, [])


def test_a_view_of_layers_the_dataset_lacks_is_refused(dataset):
    reader = open_dataset(dataset)
    with pytest.raises(SpecError, match="not \\[99\\]"):
        LayerView(reader, [99, reader.layer_ids[-1]])
    with pytest.raises(SpecError, match="labels"):
        LayerView(reader, reader.layer_ids, labels=reader.layer_ids[:-1])


def test_a_relabelled_view_trains_the_draft_a_mislabelled_capture_makes_and_its_states_are_caught(dataset, tmp_path):
    """Layers 0 and 1 of the aux layers taken under each other's ids: the draft's config names the
    labels (what vLLM would feed it), and against the target's states the view's stored states are far
    off at the swapped ids, as a capture that stored them so would be (tests/test_train.py rewrites the
    shards for the same case)."""
    reader = open_dataset(dataset)
    *aux, final = reader.layer_ids
    view = LayerView(reader, [aux[1], aux[0], final], labels=reader.layer_ids)
    draft = train_draft(view, tmp_path / "draft", verifier=dataset.parent / "model", settings=TINY)
    config = json.loads((draft.path / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == aux and draft.lineage.layer_ids == list(reader.layer_ids)
    assert draft.lineage.dataset == view.location and " as " in view.location
    target = TargetStates(dataset.parent / "model")
    errors = {e.layer: e.median for e in measure_agreement(draft.path, view, target=target).feature_error}
    assert errors[aux[0]] > 0.3 and errors[aux[1]] > 0.3 and errors[final] < 0.01, errors
    right = {e.layer: e.median for e in measure_agreement(draft.path, reader, target=target).feature_error}
    assert max(right.values()) < 0.01, right
