"""Builders of small datasets that follow the data contract (``datagen.data.contract``), without a model.

The hidden states are random: these datasets are for tests of storage and transfer steps
(publish, download, validation gates), not of numerics.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path

from datagen.data.contract import MANIFEST_NAME, STATE_DIR, LayerStats, Manifest, ShardRecord, shard_name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def make_dataset(
    root: str | Path,
    *,
    shards: int = 3,
    samples_per_shard: int = 4,
    tokens_per_sample: int = 16,
    layer_ids: tuple[int, ...] = (2, 4, 5, 8),
    hidden: int = 64,
    seed: int = 0,
    validated: bool = True,
) -> Path:
    """Write ``root/shards/shard-NNNNNN.safetensors`` and ``root/manifest.json`` (last), plus
    ``root/.datagen/validation.json`` approving the manifest when ``validated``."""
    import torch
    from safetensors.torch import save_file

    root = Path(root)
    (root / "shards").mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    records = []
    for k in range(shards):
        t = samples_per_shard * tokens_per_sample
        tensors = {
            "input_ids": torch.randint(0, 500, (t,), generator=gen, dtype=torch.int32),
            "loss_mask": torch.randint(0, 2, (t,), generator=gen, dtype=torch.uint8),
            "hidden_states": torch.randn(t, len(layer_ids), hidden, generator=gen).to(torch.bfloat16),
            "sample_index": torch.arange(k * samples_per_shard, (k + 1) * samples_per_shard, dtype=torch.int64),
            "sample_offsets": torch.arange(0, t + 1, tokens_per_sample, dtype=torch.int64),
        }
        rel = shard_name(k)
        path = root / rel
        save_file(tensors, str(path))
        stats = [
            LayerStats(layer_id=lid, count=t * hidden, mean=0.0, std=1.0, absmax=4.0, sum=0.0, sumsq=float(t * hidden))
            for lid in layer_ids
        ]
        records.append(
            ShardRecord(
                index=k,
                path=rel,
                first_sample=k * samples_per_shard,
                rows=samples_per_shard,
                samples=samples_per_shard,
                tokens=t,
                bytes=path.stat().st_size,
                sha256=_sha256(path),
                shard_key=f"test-{seed}-{k}",
                layer_stats=stats,
            )
        )
    manifest = Manifest(
        fingerprint=f"test-dataset-{seed}",
        extraction_fingerprint=f"test-extraction-{seed}",
        spec={"model": {"source": "test", "num_hidden_layers": max(layer_ids), "hidden_size": hidden},
              "layer_ids": list(layer_ids), "dtype": "bfloat16", "seed": seed},
        shards=records,
        totals={"rows": shards * samples_per_shard, "shards": shards, "bytes": sum(r.bytes for r in records)},
        skipped=[],
        truncated=[],
        layer_stats=[],
        created_at=datetime.now(timezone.utc).isoformat(),
    )
    raw = manifest.model_dump_json(indent=1).encode()
    (root / MANIFEST_NAME).write_bytes(raw)
    if validated:
        approve(root)
    return root


def approve(root: str | Path) -> None:
    """Write the validation report that `datagen publish` requires, for the current manifest."""
    root = Path(root)
    digest = hashlib.sha256((root / MANIFEST_NAME).read_bytes()).hexdigest()
    (root / STATE_DIR).mkdir(exist_ok=True)
    (root / STATE_DIR / "validation.json").write_text(json.dumps({"ok": True, "manifest_sha256": digest}))
