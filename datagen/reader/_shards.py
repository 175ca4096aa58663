"""One shard as a training job sees it: its header and small tensors, checked against the manifest.

Opening a shard reads its safetensors header and the small tensors (sample index and offsets,
token ids, loss mask, the fp8 scales) with two or three ranged reads; the hidden states, which are
nearly all of the bytes, are read one sample at a time later. A shard is refused (``ShardRefused``)
when its size, its header, its shard key, its layers or its tensors disagree with the manifest.
The sha256 is checked according to ``Verify`` (see ``datagen.reader``).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch

from datagen.data.contract import STORED_CODES, ShardRecord
from datagen.data.shards.format import SAFETENSORS_DTYPES
from datagen.errors import ValidationFailed
from datagen.reader._store import FileInfo, Store

HEADER_LIMIT = 1 << 20  # a shard's header holds a handful of tensors: anything larger is hostile
FIRST_READ = 64 << 10  # the first ranged read: the header and, on small shards, everything before the states

FP8_CODES = {"F8_E4M3", "F8_E5M2"}
SCALE = "hidden_states_scale"  # float32 [T, L] beside fp8 states: value = fp8 * scale


class ShardRefused(ValidationFailed):
    """A shard disagrees with the manifest: it is never read for training."""

    def __init__(self, path: str, what: str) -> None:
        self.path = path
        super().__init__(f"shard {path} refused: {what}",
                         hint="run `datagen validate` on the dataset and re-extract (or re-publish) the shard")


@dataclass(frozen=True)
class Expected:
    """What every shard of a dataset must hold, from its manifest."""

    layer_ids: tuple[int, ...]  # order of the L axis
    hidden_size: int  # H
    storage_code: str  # safetensors dtype code of hidden_states


@dataclass(frozen=True)
class Entry:
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


@dataclass
class OpenShard:
    """A checked shard: where its states are, and its small tensors in memory."""

    record: ShardRecord  # the manifest's record
    info: FileInfo  # size, and on S3 the ETag every read is pinned to
    states: Entry  # hidden_states [T, L, H]
    sample_index: torch.Tensor  # int64 [S] dataset row of each sample
    offsets: torch.Tensor  # int64 [S+1]
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    scale: torch.Tensor | None  # float32 [T, L] for fp8 states, else None
    verified: bool = False  # sha256 checked in this process (or vouched for by the store)

    @property
    def row_bytes(self) -> int:
        t = self.states.shape[0]
        return (self.states.end - self.states.start) // t if t else 0


def _entries(raw: bytes, base: int, path: str) -> tuple[dict[str, Entry], dict[str, str]]:
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ShardRefused(path, f"header is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ShardRefused(path, "header is not a JSON object")
    meta = obj.pop("__metadata__", None) or {}
    out: dict[str, Entry] = {}
    for name, e in obj.items():
        try:
            dtype, shape, (a, b) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
            if dtype not in SAFETENSORS_DTYPES or not all(type(d) is int and d >= 0 for d in shape) or not 0 <= a <= b:
                raise ValueError(name)
        except (TypeError, KeyError, ValueError):
            raise ShardRefused(path, f"header entry of {name!r} is malformed") from None
        out[name] = Entry(dtype, shape, base + a, base + b)
    return out, meta if isinstance(meta, dict) else {}


def _check_layout(entries: dict[str, Entry], size: int, base: int, path: str) -> None:
    pos = base
    for e in sorted(entries.values(), key=lambda e: e.start):
        if e.start != pos:
            raise ShardRefused(path, f"tensor data has a hole or overlap at byte {pos}")
        n = 1
        for d in e.shape:
            n *= d
        if e.end - e.start != n * SAFETENSORS_DTYPES[e.dtype].itemsize:
            raise ShardRefused(path, f"a tensor of shape {list(e.shape)} has {e.end - e.start} bytes")
        pos = e.end
    if pos != size:
        raise ShardRefused(path, f"the header describes {pos} bytes, the file has {size}")


def _check_tensors(t: dict[str, Entry], rec: ShardRecord, exp: Expected, path: str) -> None:
    want = {"input_ids": ("I32", (rec.tokens,)), "loss_mask": ("U8", (rec.tokens,)),
            "sample_index": ("I64", (rec.samples,)), "sample_offsets": ("I64", (rec.samples + 1,)),
            "hidden_states": (exp.storage_code, (rec.tokens, len(exp.layer_ids), exp.hidden_size))}
    if exp.storage_code in FP8_CODES:
        want[SCALE] = ("F32", (rec.tokens, len(exp.layer_ids)))
    if set(t) != set(want):
        raise ShardRefused(path, f"tensors {sorted(t)}, the contract has {sorted(want)}")
    for name, (dtype, shape) in want.items():
        if (t[name].dtype, t[name].shape) != (dtype, shape):
            raise ShardRefused(path, f"{name} is {t[name].dtype} {list(t[name].shape)}, the manifest says "
                                     f"{dtype} {list(shape)}")


def _tensor(buf: bytes | bytearray, base: int, e: Entry) -> torch.Tensor:
    raw = bytearray(buf[e.start - base:e.end - base])
    if not raw:
        return torch.empty(e.shape, dtype=SAFETENSORS_DTYPES[e.dtype])
    return torch.frombuffer(raw, dtype=SAFETENSORS_DTYPES[e.dtype]).view(e.shape)


def open_shard(store: Store, rec: ShardRecord, exp: Expected, *, stored_sha256_required: bool) -> OpenShard:
    """Read and check shard ``rec``'s header and small tensors (module docstring).

    ``stored_sha256_required``: the store must vouch for the content (S3 object metadata equal to
    the manifest's sha256); the shard then counts as verified without reading it whole.
    """
    path = rec.path
    info = store.info(path)
    if info.size != rec.bytes:
        raise ShardRefused(path, f"{info.size} bytes, the manifest says {rec.bytes}")
    if stored_sha256_required:
        if info.sha256 is None:
            raise ShardRefused(path, "the object records no sha256 to check against the manifest (it was not "
                                     "uploaded by `datagen publish`); open the dataset with verify=Verify.FULL "
                                     "to hash each shard as it is first read")
        if info.sha256 != rec.sha256:
            raise ShardRefused(path, f"the object's sha256 {info.sha256[:16]}... differs from the manifest's "
                                     f"{rec.sha256[:16]}...")
    head = store.read(path, 0, min(info.size, FIRST_READ), etag=info.etag)
    if len(head) < 8:
        raise ShardRefused(path, "too short to hold a safetensors header")
    (n,) = struct.unpack("<Q", bytes(head[:8]))
    if n > HEADER_LIMIT or 8 + n > info.size:
        raise ShardRefused(path, f"the header claims {n} bytes")
    if 8 + n > len(head):
        head = head + store.read(path, len(head), 8 + n, etag=info.etag)
    base = 8 + n
    t, meta = _entries(bytes(head[8:base]), base, path)
    _check_layout(t, info.size, base, path)
    try:
        stamp = json.loads(meta.get("datagen", "{}"))
    except json.JSONDecodeError:
        stamp = {}
    if stamp.get("shard_key") != rec.shard_key:
        raise ShardRefused(path, "its shard key is not the manifest's: the file belongs to another spec or rows")
    if tuple(stamp.get("layer_ids") or ()) != exp.layer_ids:
        raise ShardRefused(path, f"layers {stamp.get('layer_ids')}, the manifest says {list(exp.layer_ids)}")
    _check_tensors(t, rec, exp, path)
    states = t["hidden_states"]
    # Everything but the states lies before or after them: at most two more reads.
    before = [e for e in t.values() if e.end <= states.start]
    after = [e for e in t.values() if e.start >= states.end]
    small: dict[str, torch.Tensor] = {}
    for group in (before, after):
        if not group:
            continue
        lo, hi = min(e.start for e in group), max(e.end for e in group)
        buf = head[lo:hi] if hi <= len(head) else store.read(path, lo, hi, etag=info.etag)
        for name, e in t.items():
            if e in group:
                small[name] = _tensor(buf, lo, e)
    shard = OpenShard(record=rec, info=info, states=states, sample_index=small["sample_index"],
                      offsets=small["sample_offsets"], input_ids=small["input_ids"], loss_mask=small["loss_mask"],
                      scale=small.get(SCALE), verified=stored_sha256_required)
    _check_samples(shard, path)
    return shard


def _check_samples(s: OpenShard, path: str) -> None:
    off, rows, rec = s.offsets, s.sample_index, s.record
    if len(off) and (int(off[0]) != 0 or int(off[-1]) != rec.tokens or bool((off[1:] <= off[:-1]).any())):
        raise ShardRefused(path, "sample_offsets do not split the tokens into non-empty samples")
    if len(rows) and (int(rows.min()) < rec.first_sample or int(rows.max()) >= rec.first_sample + rec.rows
                      or len(set(rows.tolist())) != len(rows)):
        raise ShardRefused(path, "sample_index holds rows outside the shard's range, or a row twice")


def verify_content(store: Store, s: OpenShard) -> None:
    """Hash the whole shard (streamed, pinned to the ETag on S3); refuse it if it is not the manifest's."""
    got = store.sha256(s.record.path, etag=s.info.etag)
    if got != s.record.sha256:
        raise ShardRefused(s.record.path, f"sha256 {got[:16]}... differs from the manifest's "
                                          f"{s.record.sha256[:16]}...")
    s.verified = True
