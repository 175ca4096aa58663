"""Writing shards: packing samples, atomic writes, checksums and statistics.

Used by every engine, in whichever process holds the hidden states (the vLLM
worker writes its shards itself). A shard appears under its final name only
when it is complete and fsynced: a reader never sees half a shard, and a crash
never leaves a truncated file that a resume would count as done.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from datagen.contract import LayerStats, ShardRecord

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SHARD_FORMAT = "datagen-shard-1"


@dataclass(frozen=True)
class ShardJob:
    """Everything needed to write one shard except its hidden states."""

    index: int  # shard number k
    path: str  # absolute final path of the shard file
    first_row: int  # k * samples_per_shard
    rows: int  # rows in the shard's range (kept + skipped)
    sample_rows: tuple[int, ...]  # dataset rows stored, in order
    input_ids: tuple[np.ndarray, ...]  # int32 [T_i] per stored row
    loss_masks: tuple[np.ndarray, ...]  # uint8 [T_i] per stored row
    layer_ids: tuple[int, ...]  # captured layers, the order of the L axis
    dtype: str  # storage dtype of hidden_states
    hidden_size: int  # H
    shard_key: str  # cache key of this shard

    @property
    def tokens(self) -> int:
        return int(sum(len(x) for x in self.input_ids))

    def to_wire(self) -> dict:
        """Plain lists and numbers, for an RPC that serializes with msgpack."""
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["input_ids"] = [x.tolist() for x in self.input_ids]
        d["loss_masks"] = [x.tolist() for x in self.loss_masks]
        d["sample_rows"] = list(self.sample_rows)
        d["layer_ids"] = list(self.layer_ids)
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "ShardJob":
        return cls(**{
            **d,
            "input_ids": tuple(np.asarray(x, dtype=np.int32) for x in d["input_ids"]),
            "loss_masks": tuple(np.asarray(x, dtype=np.uint8) for x in d["loss_masks"]),
            "sample_rows": tuple(int(r) for r in d["sample_rows"]),
            "layer_ids": tuple(int(i) for i in d["layer_ids"]),
        })


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary name in the same directory, fsync, rename, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk must not keep the half-written file
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    return h.hexdigest()


def token_stats(states: torch.Tensor) -> torch.Tensor:
    """[T, L, 3] float32 per-token, per-layer (sum, sum of squares, absmax) over H.

    Computed where the states are (on the GPU, before the copy to the host), so the writer
    only adds up T x L numbers per shard instead of reading every value again.
    """
    f = states.float()
    return torch.stack([f.sum(-1), (f * f).sum(-1), f.abs().amax(-1)], dim=-1) if f.numel() else \
        torch.zeros((states.shape[0], states.shape[1], 3), dtype=torch.float32)


def layer_stats(hidden_states: torch.Tensor, layer_ids: tuple[int, ...],
                per_token: torch.Tensor | None = None) -> list[LayerStats]:
    """Per-layer count, mean, std, absmax of a [T, L, H] tensor, with float64 sums.

    ``per_token`` ([T, L, 3] from ``token_stats``) saves the pass over the values.
    """
    t, _, h = hidden_states.shape
    if per_token is None:
        per_token = token_stats(hidden_states) if t else torch.zeros((0, len(layer_ids), 3))
    p = per_token.to(torch.float64)
    out = []
    for j, lid in enumerate(layer_ids):
        n = t * h
        if t == 0:
            out.append(stats_from_sums(lid, 0, 0.0, 0.0, 0.0))
            continue
        out.append(stats_from_sums(lid, n, float(p[:, j, 0].sum()), float(p[:, j, 1].sum()), float(p[:, j, 2].max())))
    return out


def stats_from_sums(layer_id: int, count: int, s: float, ss: float, absmax: float) -> LayerStats:
    mean = s / count if count else 0.0
    var = max(ss / count - mean * mean, 0.0) if count else 0.0
    return LayerStats(layer_id=layer_id, count=count, mean=mean, std=var**0.5, absmax=absmax, sum=s, sumsq=ss)


def combine_stats(per_shard: list[list[LayerStats]], layer_ids: tuple[int, ...]) -> list[LayerStats]:
    """Dataset statistics from shard statistics (exact: sums add)."""
    out = []
    for j, lid in enumerate(layer_ids):
        parts = [s[j] for s in per_shard if s]
        n = sum(p.count for p in parts)
        out.append(
            stats_from_sums(
                lid, n, sum(p.sum for p in parts), sum(p.sumsq for p in parts),
                max((p.absmax for p in parts), default=0.0),
            )
        )
    return out


def write_shard(job: ShardJob, per_sample_states: list[torch.Tensor],
                per_sample_stats: list[torch.Tensor] | None = None) -> ShardRecord:
    """Pack the samples of ``job`` with their [T_i, L, H] states and write the shard atomically.

    ``per_sample_stats`` ([T_i, L, 3] from ``token_stats``), when the caller has them, spares
    a pass over the states for the statistics.
    """
    if len(per_sample_states) != len(job.sample_rows):
        raise ValueError(f"shard {job.index}: {len(per_sample_states)} state tensors for {len(job.sample_rows)} samples")
    for row, ids, st in zip(job.sample_rows, job.input_ids, per_sample_states):
        if st.shape[0] != len(ids) or st.shape[1] != len(job.layer_ids):
            raise ValueError(
                f"shard {job.index} row {row}: states of shape {tuple(st.shape)} for {len(ids)} tokens "
                f"and {len(job.layer_ids)} layers"
            )
    dtype = TORCH_DTYPES[job.dtype]
    lengths = [len(x) for x in job.input_ids]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if per_sample_states:
        hs = torch.cat([s.to(dtype) for s in per_sample_states], dim=0).contiguous()
        ids = np.concatenate(job.input_ids).astype(np.int32)
        mask = np.concatenate(job.loss_masks).astype(np.uint8)
    else:
        hs = torch.zeros((0, len(job.layer_ids), job.hidden_size), dtype=dtype)
        ids = np.zeros(0, dtype=np.int32)
        mask = np.zeros(0, dtype=np.uint8)
    tensors = {
        "input_ids": torch.from_numpy(ids),
        "loss_mask": torch.from_numpy(mask),
        "hidden_states": hs,
        "sample_index": torch.tensor(job.sample_rows, dtype=torch.int64),
        "sample_offsets": torch.from_numpy(offsets),
    }
    final = Path(job.path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        save_file(
            tensors,
            str(tmp),
            # One metadata key: safetensors writes a map's keys in no fixed order, and shards must be
            # byte-identical across runs.
            metadata={
                "datagen": json.dumps(
                    {"format": SHARD_FORMAT, "shard_key": job.shard_key, "layer_ids": list(job.layer_ids)},
                    sort_keys=True,
                )
            },
        )
        os.chmod(tmp, 0o644)  # safetensors creates 0600; the dataset is meant to be read by others
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
    except Exception as e:
        tmp.unlink(missing_ok=True)  # a full disk must not keep the half-written file
        if not isinstance(e, OSError) and "os error 28" in str(e):
            # safetensors reports I/O errors as SafetensorError: give callers the OSError they handle
            raise OSError(errno.ENOSPC, f"No space left on device writing {final.name}") from e
        raise
    digest = file_sha256(tmp)
    size = tmp.stat().st_size
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return ShardRecord(
        index=job.index,
        path=f"shards/{final.name}",
        first_sample=job.first_row,
        rows=job.rows,
        samples=len(job.sample_rows),
        tokens=int(offsets[-1]),
        bytes=size,
        sha256=digest,
        shard_key=job.shard_key,
        layer_stats=layer_stats(
            hs, job.layer_ids, torch.cat(per_sample_stats, dim=0) if per_sample_stats else None
        ),
    )
