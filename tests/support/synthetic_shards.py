"""Datasets that follow the data contract exactly (shard keys, layers, statistics), without a model.

The hidden states are random; every sample's values are a function of its row (``row_value``),
so a test can tell which sample it was handed. ``storage="fp8"`` writes the fp8 layout:
``hidden_states`` float8_e4m3fn [T, L, H] plus ``hidden_states_scale`` float32 [T, L]
(value = fp8 * scale) and ``spec.storage_dtype``. Used by the reader's tests and benchmarks.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import save_file

from datagen.data.contract import MANIFEST_NAME, Manifest, ShardRecord, shard_name
from datagen.data.shards.kernels import combine_stats, layer_stats

SHARD_FORMAT = "datagen-shard-1"
FP8_MAX = 448.0


def row_value(row: int) -> float:
    """The value every hidden state of dataset row ``row`` is centred on."""
    return float((row % 97) - 48) / 8.0


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def _states(row: int, tokens: int, layers: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(tokens, layers, hidden, generator=gen) * 0.01
    layer = torch.arange(layers, dtype=torch.float32).view(1, layers, 1)
    return row_value(row) + layer + noise  # float32; layer j adds j, so a layer swap shows


def make_synthetic_dataset(
    root: str | Path,
    *,
    rows: int = 24,
    samples_per_shard: int = 8,
    tokens: int | tuple[int, int] = (5, 40),
    layer_ids: tuple[int, ...] = (1, 2, 3, 4),
    num_hidden_layers: int = 4,
    hidden: int = 32,
    skipped: tuple[int, ...] = (),
    storage: str = "bf16",
    seed: int = 0,
) -> Path:
    """Write shards then ``manifest.json`` (last). ``tokens``: a fixed length or a (min, max) range."""
    root = Path(root)
    (root / "shards").mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    layers = len(layer_ids)
    records, per_shard = [], []
    for k in range(0, -(-rows // samples_per_shard)):
        first = k * samples_per_shard
        kept = [r for r in range(first, min(rows, first + samples_per_shard)) if r not in skipped]
        if isinstance(tokens, int):
            lengths = [tokens] * len(kept)
        else:
            lengths = torch.randint(tokens[0], tokens[1] + 1, (len(kept),), generator=gen).tolist()
        t = sum(lengths)
        states = torch.cat([_states(r, n, layers, hidden, gen) for r, n in zip(kept, lengths)]) if kept \
            else torch.zeros(0, layers, hidden)
        offsets = torch.zeros(len(kept) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
        tensors = {
            "input_ids": torch.randint(3, 500, (t,), generator=gen, dtype=torch.int32),
            "loss_mask": torch.randint(0, 2, (t,), generator=gen, dtype=torch.uint8),
            "sample_index": torch.tensor(kept, dtype=torch.int64),
            "sample_offsets": offsets,
        }
        if storage == "fp8":
            amax = states.abs().amax(-1)
            scale = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)  # the writer's rule
            tensors["hidden_states"] = (states / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
            tensors["hidden_states_scale"] = scale.to(torch.float32)
            stored = tensors["hidden_states"].float() * scale.unsqueeze(-1)
        else:
            tensors["hidden_states"] = states.to(torch.bfloat16)
            stored = tensors["hidden_states"]
        rel = shard_name(k)
        key = f"synthetic-{seed}-{k}"
        stamp = {"format": SHARD_FORMAT, "shard_key": key, "layer_ids": list(layer_ids)}
        if storage == "fp8":
            stamp["storage_dtype"] = "fp8_e4m3"
        meta = {"datagen": json.dumps(stamp, sort_keys=True)}
        save_file(tensors, str(root / rel), metadata=meta)
        stats = layer_stats(stored, tuple(layer_ids))
        if t:
            per_shard.append(stats)
        records.append(ShardRecord(index=k, path=rel, first_sample=first, rows=min(rows, first + samples_per_shard) - first,
                                   samples=len(kept), tokens=t, bytes=(root / rel).stat().st_size,
                                   sha256=_sha256(root / rel), shard_key=key, layer_stats=stats))
    spec = {"model": {"source": "synthetic", "architecture": "LlamaForCausalLM", "num_hidden_layers": num_hidden_layers,
                      "hidden_size": hidden},
            "layer_ids": list(layer_ids), "dtype": "bfloat16", "samples_per_shard": samples_per_shard}
    if storage == "fp8":
        spec["storage_dtype"] = "fp8_e4m3"
    manifest = Manifest(
        fingerprint=f"synthetic-{seed}", extraction_fingerprint=f"synthetic-x-{seed}", spec=spec, shards=records,
        totals={"rows": rows, "samples": sum(r.samples for r in records), "tokens": sum(r.tokens for r in records),
                "bytes": sum(r.bytes for r in records), "shards": len(records), "skipped": len(skipped),
                "truncated": 0},
        skipped=[{"row": r, "reason": "empty"} for r in skipped], truncated=[],
        layer_stats=combine_stats(per_shard, tuple(layer_ids)),
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    (root / MANIFEST_NAME).write_text(manifest.model_dump_json(indent=1) + "\n")
    return root


def manifest_of(root: Path) -> dict:
    return json.loads((Path(root) / MANIFEST_NAME).read_text())


def write_manifest(root: Path, m: dict) -> None:
    (Path(root) / MANIFEST_NAME).write_text(json.dumps(m, indent=1) + "\n")
