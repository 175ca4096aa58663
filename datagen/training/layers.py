"""Some of a dataset's layers, read as a dataset of their own (optionally under other layer ids).

One extraction at the union of several layer lists serves drafts for each of them: ``LayerView``
reads the dataset's states of the layers it takes, in that order, and everything else (rows,
tokens, loss masks, split, manifest) as the dataset has it. ``train_draft`` and
``measure_agreement`` take a view wherever they take a dataset.

``labels`` names the taken layers by other ids: the view is then what a capture that stored the
taken layers but wrote ``labels`` into its manifest would have handed training (a mislabelled
dataset). Only the proof (bench.train_proof) uses that, to train the drafts a mislabelled capture
makes; a dataset's own layers are always read under their own ids otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from datagen.errors import SpecError
from datagen.reader import DatasetReader


class LayerView:
    """``reader``'s layers ``take`` (ids of the dataset's layers, the final one last), named ``labels``."""

    def __init__(self, reader: DatasetReader, take: Sequence[int], *, labels: Sequence[int] | None = None) -> None:
        have = list(reader.layer_ids)
        missing = [k for k in take if k not in have]
        if missing:
            raise SpecError(f"the dataset {reader.location} has layers {have}, not {missing}",
                            hint="take layers the dataset stores (its manifest's layer_ids)")
        labels = list(labels if labels is not None else take)
        if len(labels) != len(take):
            raise SpecError(f"{len(take)} layers taken but {len(labels)} labels given", hint="one label per layer")
        self.reader = reader
        self.taken = tuple(take)
        self._labels = tuple(labels)
        self._columns = [have.index(k) for k in take]
        self.location = reader.location if self.taken == self._labels == tuple(have) else (
            f"{reader.location} (layers {list(take)}" + ("" if self.taken == self._labels else f" as {labels}") + ")")

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self._labels

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int):
        s = self.reader[i]
        return dataclasses.replace(s, hidden_states=s.hidden_states[:, self._columns])

    def __getattr__(self, name: str):  # manifest, hidden_size, lengths, shards, positions(), ...
        if name in _STORED_STATES:
            raise AttributeError(f"a layer view has no {name}: it reads the stored states of every layer of "
                                 f"{self.reader.location}; the view's layers are its samples' (view[i])")
        return getattr(self.reader, name)


# the reader's ways to the stored bytes of every layer (the packed loader's), which a view does not offer
_STORED_STATES = frozenset({"read_into", "read_run", "sample_in", "stored_dtype"})


def as_reader(dataset) -> DatasetReader | LayerView:
    """A dataset location opened, or a reader / view as given."""
    from datagen.reader import open_dataset

    return dataset if isinstance(dataset, DatasetReader | LayerView) else open_dataset(dataset)
