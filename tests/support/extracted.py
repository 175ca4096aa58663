"""A real tiny dataset (extracted with the reference engine) and helpers that corrupt copies of it.

``extracted_dataset`` builds, once per test session, a 4-layer random Llama, a chat
dataset of 24 rows plus four hand-made rows, and extracts it with the HF engine in
shards of 8 rows:

    rows 0-23   chat rows (make-tiny)
    row 24      pre-tokenized, 50 tokens     } equal lengths: two samples whose states
    row 26      pre-tokenized, 50 tokens     } can be swapped without changing shapes
    row 25      empty chat       -> skipped "empty"
    row 27      no assistant turn -> skipped "no_target"

Tests copy it (``copy_dataset``) before changing anything. The helpers that rewrite a
shard leave it self-consistent at the level the test asks for: ``fix_checksums``
updates only sizes and sha256s (so the checks of contents must find the change), and
``fix_records`` also recomputes counts, statistics and totals (so only checks that look
at the values themselves, such as golden samples, can).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from datagen.data.contract import MANIFEST_NAME
from datagen.data.shards.kernels import combine_stats, layer_stats

ROWS_PER_SHARD = 8
EQUAL_LENGTH_ROWS = (24, 26)
SKIPPED_ROWS = {25: "empty", 27: "no_target"}


def _extra_rows() -> list[dict]:
    g = torch.Generator().manual_seed(7)
    a = torch.randint(3, 390, (50,), generator=g).tolist()
    b = torch.randint(3, 390, (50,), generator=g).tolist()
    mask = [0] * 10 + [1] * 40
    return [
        {"input_ids": a, "loss_mask": mask},
        {"messages": []},
        {"input_ids": b, "loss_mask": mask},
        {"messages": [{"role": "user", "content": "a question with no answer"}]},
    ]


def _build(base: Path) -> Path:
    from datagen.specs.extraction import parse_spec
    from datagen.testmodels.tiny import TinyArch, make_chat_dataset, make_model
    from datagen.extraction.run import extract

    model = make_model(base / "model", arch=TinyArch.LLAMA, num_layers=4, seed=0)
    rows = make_chat_dataset(base / "chat.jsonl", rows=24, seed=0)
    with rows.open("a") as f:
        for r in _extra_rows():
            f.write(json.dumps(r) + "\n")
    out = base / "dataset"
    spec = parse_spec({"model": str(model.resolve()), "dataset": str(rows.resolve()), "out": str(out.resolve()),
                       "samples_per_shard": ROWS_PER_SHARD, "engine": {"name": "hf"}})
    extract(spec)
    return out


def extracted_dataset(tmp_path_factory) -> Path:
    """The session's pristine dataset (built on first use). Never modify it: copy it."""
    base = tmp_path_factory.getbasetemp() / "extracted-tiny"
    done = base / "dataset" / MANIFEST_NAME
    if not done.exists():
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        _build(base)
    return base / "dataset"


def foreign_shard(tmp_path_factory) -> Path:
    """Shard 0 of the same model and rows extracted with other layers (same shapes): another spec."""
    from datagen.specs.extraction import parse_spec
    from datagen.extraction.run import extract

    ds = extracted_dataset(tmp_path_factory)
    base = ds.parent
    out = base / "foreign"
    shard = out / "shards" / "shard-000000.safetensors"
    if not shard.exists():
        spec = parse_spec({"model": str(base / "model"), "dataset": str(base / "chat.jsonl"), "out": str(out),
                           "samples_per_shard": ROWS_PER_SHARD, "layer_ids": [0, 2, 4], "engine": {"name": "hf"}})
        extract(spec, shards=(0, 1))
    return shard


def copy_dataset(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def manifest(ds: Path) -> dict:
    return json.loads((ds / MANIFEST_NAME).read_text())


def write_manifest(ds: Path, m: dict) -> None:
    (ds / MANIFEST_NAME).write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")


def shard_path(ds: Path, k: int) -> Path:
    return ds / manifest(ds)["shards"][k]["path"]


def read_shard(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def write_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)


def rewrite_shard(ds: Path, k: int, change) -> None:
    """Apply ``change(tensors) -> tensors`` to shard k's tensors and write it back (metadata kept)."""
    path = shard_path(ds, k)
    tensors, meta = read_shard(path)
    write_shard(path, change(tensors), meta)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fix_checksums(ds: Path) -> None:
    """Make every shard record's size and sha256 match the file (nothing else)."""
    m = manifest(ds)
    for rec in m["shards"]:
        p = ds / rec["path"]
        rec["bytes"], rec["sha256"] = p.stat().st_size, _sha(p)
    m["totals"]["bytes"] = sum(r["bytes"] for r in m["shards"])
    write_manifest(ds, m)


def fix_records(ds: Path) -> None:
    """Make every record agree with its shard file: size, sha256, samples, tokens, statistics, totals."""
    m = manifest(ds)
    layer_ids = tuple(m["spec"]["layer_ids"])
    per_shard = []
    for rec in m["shards"]:
        p = ds / rec["path"]
        t, _ = read_shard(p)
        rec["bytes"], rec["sha256"] = p.stat().st_size, _sha(p)
        rec["samples"], rec["tokens"] = int(t["sample_index"].numel()), int(t["input_ids"].numel())
        stats = layer_stats(t["hidden_states"], layer_ids)
        rec["layer_stats"] = [s.model_dump() for s in stats]
        if rec["tokens"]:
            per_shard.append(stats)
    m["layer_stats"] = [s.model_dump() for s in combine_stats(per_shard, layer_ids)]
    for key in ("samples", "tokens", "bytes"):
        m["totals"][key] = sum(r[key] for r in m["shards"])
    write_manifest(ds, m)


def sample_span(tensors: dict[str, torch.Tensor], row: int) -> tuple[int, int]:
    """Token range [a, b) of dataset row ``row`` in a shard's tensors."""
    s = tensors["sample_index"].tolist().index(row)
    off = tensors["sample_offsets"]
    return int(off[s]), int(off[s + 1])


def stored_samples(ds: Path) -> dict[int, dict[str, torch.Tensor]]:
    """row -> that sample's tensors, read straight from the shards."""
    out = {}
    for k in range(len(manifest(ds)["shards"])):
        t, _ = read_shard(shard_path(ds, k))
        off = t["sample_offsets"].tolist()
        for s, row in enumerate(t["sample_index"].tolist()):
            a, b = off[s], off[s + 1]
            out[row] = {"input_ids": t["input_ids"][a:b], "loss_mask": t["loss_mask"][a:b],
                        "hidden_states": t["hidden_states"][a:b]}
    return out
