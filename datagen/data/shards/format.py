"""What a shard is: its format name, the storage dtypes, the fp8 layout, the job that describes one
shard to write (the message an engine's driver sends its workers), and the safetensors header.

Shared by the writer (``writer.py``), the kernels (``kernels.py``) and every engine that hands
shard jobs to the process holding the hidden states.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import numpy as np
import torch

from datagen.data.contract import STORED_CODES, ShardFormat

# safetensors dtype code -> torch dtype: the codes a shard or any safetensors file read here may hold
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
    "F32": torch.float32, "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
# storage dtype name (the spec's storage_dtype) -> dtype of the stored hidden_states (contract.STORED_FORMS)
STORAGE_DTYPES = {name: SAFETENSORS_DTYPES[code] for name, code in STORED_CODES.items()}
# compute dtype name (the spec's dtype) -> torch dtype
TORCH_DTYPES = {name: STORAGE_DTYPES[name] for name in ("bfloat16", "float16", "float32")}
SHARD_FORMAT = "datagen-shard-1"

# --- fp8 storage ------------------------------------------------------------------------------
# ``storage_dtype`` fp8_e4m3: hidden_states float8_e4m3fn [T, L, H] and hidden_states_scale
# float32 [T, L], value = float(fp8) * scale, scale = absmax over H of that token's layer / 448
# (1 where the vector is all zeros). Statistics and validation describe the stored values.
FP8 = "fp8_e4m3"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_TENSOR = "hidden_states_scale"


@dataclass(frozen=True)
class ShardJob:
    """Everything needed to write one shard except its hidden states: what is the shard's own, and the
    run's ``ShardFormat`` (the layer axis, the stored dtype, H), which a job holds but does not carry
    to a worker: the worker has it from the engine's start (``CaptureConfig.shard``)."""

    index: int  # shard number k
    path: str  # absolute final path of the shard file
    first_row: int  # k * samples_per_shard
    rows: int  # rows in the shard's range (kept + skipped)
    sample_rows: tuple[int, ...]  # dataset rows stored, in order
    input_ids: tuple[np.ndarray, ...]  # int32 [T_i] per stored row
    loss_masks: tuple[np.ndarray, ...]  # uint8 [T_i] per stored row
    format: ShardFormat  # the run's: captured layers (the order of the L axis), stored dtype, H
    shard_key: str  # cache key of this shard
    # per stored row: its images (datagen.data.media.MediaItem), () for a text row; () for none at all
    media: tuple = ()

    @property
    def tokens(self) -> int:
        return int(sum(len(x) for x in self.input_ids))

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.format.layer_ids

    @property
    def storage_dtype(self) -> str:
        """The stored dtype of hidden_states (a STORAGE_DTYPES name)."""
        return self.format.storage_dtype

    @property
    def hidden_size(self) -> int:
        return self.format.hidden_size

    def to_wire(self) -> dict:
        """The shard's own fields as plain lists and numbers, for an RPC that serializes with msgpack;
        not the format, which the worker has (``from_wire`` takes it back)."""
        d = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "format"}
        d["input_ids"] = [x.tolist() for x in self.input_ids]
        d["loss_masks"] = [x.tolist() for x in self.loss_masks]
        d["sample_rows"] = list(self.sample_rows)
        d["media"] = [[m.to_wire() for m in items] for items in self.media]
        return d

    @classmethod
    def from_wire(cls, d: dict, format: ShardFormat) -> "ShardJob":
        return cls(**{
            **d,
            "input_ids": tuple(np.asarray(x, dtype=np.int32) for x in d["input_ids"]),
            "loss_masks": tuple(np.asarray(x, dtype=np.uint8) for x in d["loss_masks"]),
            "sample_rows": tuple(int(r) for r in d["sample_rows"]),
            "media": _media_from_wire(d.get("media") or []),
            "format": format,
        })


def _media_from_wire(rows: list) -> tuple:
    if not any(rows):
        return tuple(() for _ in rows)
    from datagen.data.media import MediaItem

    return tuple(tuple(MediaItem.from_wire(m) for m in items) for items in rows)


# --- serialization ----------------------------------------------------------------------------
# The safetensors layout, written here so that the bytes go from the states to the disk once:
# an 8-byte little-endian header length, the JSON header padded with spaces to a multiple of 8,
# then the tensors ordered by safetensors' dtype order (descending) and name. The output is
# byte-identical to ``safetensors.torch.save_file`` (a test holds it to that).
_ST_CODE = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
_ST_ORDER = {"U8": 4, "F8_E4M3": 7, "F16": 11, "BF16": 12, "I32": 13, "F32": 15, "I64": 18}  # Rust enum order


def safetensors_layout(entries: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                       metadata: dict[str, str]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The header bytes (length prefix included) and each tensor's [start, end) in the file."""
    order = sorted(entries, key=lambda n: (-_ST_ORDER[_ST_CODE[entries[n][0]]], n))
    header: dict = {"__metadata__": metadata} if metadata else {}
    spans, pos = {}, 0
    for name in order:
        dtype, shape = entries[name]
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_CODE[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
        spans[name] = (pos, pos + n)
        pos += n
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    return head, {k: (a + len(head), b + len(head)) for k, (a, b) in spans.items()}
