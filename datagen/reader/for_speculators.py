"""speculators (0.9.x) trains from the shards without ``datagen export``.

``SpeculatorsDataset`` is a ``speculators.train.data.BaseDataset``: it hands speculators'
``CollateFn`` exactly what its ``ArrowDataset`` hands it from an export (the same keys, dtypes
and shapes: aux layers flattened into ``hidden_states`` [T, (L-1)*H], the final layer as
``verifier_last_hidden_states`` [T, H], int64 ``input_ids`` and ``loss_mask``, plus
``lengths`` and ``position_ids``), with the same train/val split by ``train_ratio``. So
speculators' multipack sampler, collate function and trainer run unchanged::

    from datagen.reader import open_dataset
    from datagen.reader.for_speculators import SpeculatorsDataset

    data = SpeculatorsDataset(open_dataset("s3://bucket/ds"), max_len=4096, train_ratio=0.9, split="train")
    loader = speculators.train.dataloader._setup_dataloader(data, 4096, data.hidden_size, ...)

``packed_loader`` hands speculators' Trainer the same batches with less work per batch: the same
multipack sampler and DataLoader settings, but each batch is packed where it is read
(``datagen.reader.packed.PackedBatches``: the states read straight into their rows, in reused memory).
speculators' path reads each sample into a buffer of its own, flattens its aux layers (a copy),
zero-fills the batch and copies each sample into it, and a worker's batch is copied once more into
shared memory when it is sent. Its spawned workers import the packing alone, not speculators.

Of the reader, only this module imports speculators.
"""

from __future__ import annotations

from typing import Literal

import torch
from speculators.train.data import BaseDataset
from torch.utils.data import DataLoader

from datagen.errors import SpecError
from datagen.reader._dataset import DatasetReader
from datagen.reader.packed import PackedBatches, SplitOfReader, as_packed, pack, worker_init

__all__ = ["PackedBatches", "SpeculatorsDataset", "pack", "packable", "packed_loader"]


class SpeculatorsDataset(SplitOfReader, BaseDataset):
    """The reader's samples in speculators' ``ArrowDataset`` form (module docstring).

    Raises:
        SpecError: the dataset's last layer is not the model's final layer (speculators takes the
            last captured layer as the verifier's final hidden state), or the split is empty.
    """

    def __init__(self, reader: DatasetReader, *, max_len: int, train_ratio: float = 1.0,
                 split: Literal["train", "val"] = "train", hidden_states_dtype: torch.dtype = torch.bfloat16) -> None:
        final = reader.manifest.spec.model.num_hidden_layers
        if reader.layer_ids[-1] != final:
            raise SpecError(f"speculators needs the final layer {final} last; this dataset has {list(reader.layer_ids)}",
                            hint=f"extract with the final layer in --layers (the EAGLE-3 default ends in {final})")
        if not 0.0 < train_ratio <= 1.0:
            raise SpecError(f"train_ratio must be in (0, 1], got {train_ratio}", hint="pass e.g. 0.9")
        cut = int(len(reader) * train_ratio)  # speculators' ArrowDataset splits the same way
        self.indices = range(0, cut) if split == "train" else range(cut, len(reader))
        if not len(self.indices):
            raise SpecError(f"the {split} split of {len(reader)} samples with train_ratio={train_ratio} is empty",
                            hint="use more samples or another train_ratio")
        self.reader = reader
        super().__init__(max_len, hidden_states_dtype)

    def _compute_approx_lengths(self) -> list[int]:
        return [self.reader.lengths[i] for i in self.indices]

    def _get_raw_data(self, index: int) -> dict:
        s = self.reader[self.indices[index]]
        hs = s.hidden_states.to(self.hidden_states_dtype)
        return {
            "hidden_states": hs[:, :-1].flatten(1),  # [T, (L-1) * H]
            "input_ids": s.input_ids,  # int64 [T]
            "verifier_last_hidden_states": hs[:, -1],  # [T, H]
            "loss_mask": s.loss_mask,  # int64 [T]
        }


def packable(data) -> bool:
    """True when ``data`` hands out its shards' samples unchanged (a ``SpeculatorsDataset`` whose
    ``_get_raw_data`` is not replaced), which is what a batch packed from the shards holds."""
    return (isinstance(data, SpeculatorsDataset) and "_get_raw_data" not in vars(data)
            and type(data)._get_raw_data is SpeculatorsDataset._get_raw_data)


def packed_loader(data: SpeculatorsDataset, total_seq_len: int, *, num_workers: int, prefetch_factor: int | None,
                  seed: int, buffers: int | None = None) -> DataLoader:
    """``speculators.train.dataloader._setup_dataloader(data, total_seq_len, ..., preprocess=shift_batch)``
    with ``PackedBatches`` in place of its per-sample collate: the same sampler (this rank's share, the
    seed's order), workers, prefetch, pinning and batches. ``buffers``: ``PackedBatches``' (None: as many
    as a process has batches in flight)."""
    from speculators.train.distributed import get_dp_rank, get_dp_size
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    if not packable(data):
        raise TypeError("PackedBatches reads a SpeculatorsDataset's own samples; this one hands out others")
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=data.approx_lengths,
                                                 num_replicas=get_dp_size(), rank=get_dp_rank(), seed=seed)
    use_workers = num_workers > 0
    # a worker's batches in flight: its prefetch, the one the training process is pinning, the one it packs
    if buffers is None:
        buffers = (prefetch_factor or 2) + 2 if use_workers else 3
    return DataLoader(PackedBatches(data, total_seq_len, buffers=buffers), batch_sampler=sampler,
                      num_workers=num_workers, prefetch_factor=prefetch_factor if use_workers else None,
                      pin_memory=True, collate_fn=as_packed, persistent_workers=use_workers,
                      multiprocessing_context="spawn" if use_workers else None,
                      worker_init_fn=worker_init if use_workers else None)


