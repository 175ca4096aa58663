"""Export a validated dataset for training: what ``datagen export --format speculators DATASET OUT`` runs.

Writes the layout that ``speculators`` 0.9.x trains from (its
``speculators.train.data.ArrowDataset`` with the file transfer)::

    OUT/data-00000-of-0000N.arrow, dataset_info.json, state.json
        a Hugging Face ``datasets`` directory (``load_from_disk``), torch format, columns
        input_ids  int64 [T]   token ids of sample i
        loss_mask  int64 [T]   1 on assistant tokens
        seq_len    int64       T
    OUT/hidden_states/hs_<i>.safetensors
        token_ids      int64 [T]         equal to input_ids of row i (speculators checks it)
        hidden_states  <dtype> [T, L, H] layers in layer_ids order: aux layers first, the
                                          final layer (id N) last, as speculators splits it;
                                          fp8_e4m3 datasets are converted back to bfloat16
                                          (fp8 * hidden_states_scale), which speculators reads
    OUT/token_freq.pt        {token id: count} over loss-masked tokens (speculators builds
                             its draft vocabulary mapping from it)
    OUT/datagen_export.json  provenance: source fingerprint, manifest sha256, and the
                             source dataset row of every sample i

i numbers the stored samples in dataset-row order: skipped rows are left out and the
rest renumbered. Everything is written under a temporary sibling directory and renamed
to OUT at the end, so OUT is complete or absent. Each shard's sha256 is checked while
it is read.
"""

from __future__ import annotations

import datetime as dt
import enum
import hashlib
import json
import logging
import os
import shutil
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from datagen.data.contract import (MANIFEST_NAME, Approval, Manifest, ShardRecord, approval_of,
                                   validated_manifest_sha256)
from datagen.data.files import fsync_dir
from datagen.data.shards.kernels import dequantize_fp8
from datagen.errors import DatasetError, OutputConflictError, SpecError, UnsafePathError, ValidationFailed
from datagen.validation.scan import resolve_inside
from datagen.validation.shardfile import MappedShard, read_header

log = logging.getLogger(__name__)

EXPORT_RECORD = "datagen_export.json"
HIDDEN_STATES_DIR = "hidden_states"
# storage dtype -> dtype of the exported hidden_states, where they differ
EXPORT_DTYPE = {"fp8_e4m3": "bfloat16"}


class ExportFormat(str, enum.Enum):
    """Training-side layouts datagen can write."""

    SPECULATORS = "speculators"  # speculators 0.9.x offline hidden states (ArrowDataset)


def hs_name(i: int) -> str:
    """File of sample i, relative to the export root (speculators' FileTransfer naming)."""
    return f"{HIDDEN_STATES_DIR}/hs_{i}.safetensors"


def _load_manifest(root: Path) -> tuple[Manifest, bytes]:
    path = root / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DatasetError("no manifest.json: the dataset is incomplete or not a datagen dataset", path=str(root),
                           hint="finish `datagen extract` (it writes the manifest last), then `datagen validate`",
                           ) from None
    try:
        return Manifest.model_validate_json(raw), raw
    except ValidationError as e:
        raise DatasetError(f"manifest.json does not match the contract: {e.errors()[0]['msg']}", path=str(path),
                           hint="run `datagen validate` for details") from e


def _validated(root: Path, raw: bytes) -> bool:
    """True when a passing validation approved exactly ``raw``; False when none is recorded.

    Raises:
        ValidationFailed: a validation approved another manifest (this one changed since).
    """
    approval = approval_of(root, raw)
    if approval is Approval.STALE:
        raise ValidationFailed(
            f"{root}/{MANIFEST_NAME} changed after it was validated (validated "
            f"{str(validated_manifest_sha256(root))[:12]}, now {hashlib.sha256(raw).hexdigest()[:12]})",
            hint=f"run `datagen validate {root}` again; only the manifest it approves is exported")
    return approval is Approval.APPROVED


def export(dataset: str | Path, out: str | Path, *, fmt: ExportFormat = ExportFormat.SPECULATORS,
        workers: int | None = None) -> dict:
    """Export ``dataset`` to ``out`` in layout ``fmt``. Returns a result record.

    Raises:
        DatasetError: the dataset has no (valid) manifest.
        SpecError: the dataset lacks the final layer speculators needs.
        OutputConflictError: ``out`` exists and is not this dataset's export.
        ValidationFailed: a shard is corrupt (checksum, header) while being read.
    """
    import hashlib

    root, out = Path(dataset), Path(out)
    m, raw = _load_manifest(root)
    msha = hashlib.sha256(raw).hexdigest()
    validated = _validated(root, raw)
    layer_ids, n_layers = list(m.spec.layer_ids), m.spec.model.num_hidden_layers
    if not layer_ids:
        raise DatasetError(
            "the manifest's spec names no layers (layer_ids is empty)",
            path=str(root / MANIFEST_NAME), hint="this is not a dataset written by datagen extract; run datagen validate",
        )
    if layer_ids[-1] != n_layers:
        raise SpecError(
            f"speculators takes the last captured layer as the verifier's final hidden state, but this dataset's "
            f"layers {layer_ids} do not include the final layer {n_layers}",
            hint=f"extract with the final layer in --layers (e.g. the EAGLE-3 default ending in {n_layers})")
    if out.exists():
        prior = _prior_export(out)
        if prior is not None and prior.get("manifest_sha256") == msha and prior.get("format") == fmt.value:
            log.info("%s already holds this export: nothing to do", out)
            return {**_result(prior, out), "cached": True}
        raise OutputConflictError(f"export output {out} exists and is not an export of this dataset",
                                  hint="choose a new OUT, or delete the old one first")
    if not validated:
        log.warning("dataset %s has no passing validation for this manifest: run `datagen validate` first", root)

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / HIDDEN_STATES_DIR).mkdir(parents=True)
    try:
        rows, freq = _write_hidden_states(root, m, tmp, workers or min(8, os.cpu_count() or 1))
        _write_arrow(root, m, tmp)
        torch.save(dict(sorted(freq.items())), tmp / "token_freq.pt")
        record = {
            "format": fmt.value,
            "source": str(root.resolve()),
            "fingerprint": m.fingerprint,
            "manifest_sha256": msha,
            "validated": validated,
            "layer_ids": layer_ids,
            "hidden_size": m.spec.model.hidden_size,
            "dtype": EXPORT_DTYPE.get(m.spec.storage_dtype, m.spec.dtype),
            "storage_dtype": m.spec.storage_dtype,
            "samples": len(rows),
            "tokens": int(m.totals.get("tokens", 0)),
            "rows": rows,
            # image rows: hs_<index>'s input_ids hold each image's placeholder tokens (loss_mask 0)
            "media": _media(m, rows),
            "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        os.sync()  # every file of the export on disk before the rename makes it visible
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %d samples to %s (%s)", len(rows), out, fmt.value)
    return {**_result(record, out), "cached": False}


def _result(record: dict, out: Path) -> dict:
    return {k: v for k, v in record.items() if k not in ("rows", "media")} | {"out": str(out.resolve())}


def _media(m: Manifest, rows: list[int]) -> list[dict]:
    """The manifest's image rows under their export index: which images, where, how many tokens."""
    images = {r.row: r.images for r in m.media}
    return [{"index": i, "row": row, "images": [x.model_dump() for x in images[row]]}
            for i, row in enumerate(rows) if row in images]


def _prior_export(out: Path) -> dict | None:
    try:
        return json.loads((out / EXPORT_RECORD).read_text())
    except (OSError, ValueError):
        return None


def _open_shard(root: Path, rec: ShardRecord) -> MappedShard:
    full = resolve_inside(root, rec.path)
    if full is None:
        raise UnsafePathError(f"shard path {rec.path!r} escapes the dataset directory {root}",
                              hint="the manifest is corrupt or hostile; run `datagen validate`")
    if not full.is_file():
        raise ValidationFailed(f"shard {rec.path} does not exist", hint="run `datagen validate`, re-extract")
    return MappedShard(full, read_header(full))


def _sample_order(m: MappedShard) -> tuple[np.ndarray, np.ndarray]:
    rows = m.tensor("sample_index").numpy().copy()
    off = m.tensor("sample_offsets").numpy().copy()
    return rows, off


def _write_hidden_states(root: Path, man: Manifest, tmp: Path, workers: int) -> tuple[list[int], Counter]:
    """Write hs_<i> for every stored sample; returns the source row of each i and token counts."""
    counts = [rec.samples for rec in man.shards]
    bases = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()

    def one(k: int) -> tuple[list[int], Counter]:
        rec = man.shards[k]
        freq: Counter = Counter()
        with _open_shard(root, rec) as m:
            sha = m.scan()  # also brings the file into the page cache for the slicing below
            if sha != rec.sha256:
                raise ValidationFailed(f"shard {rec.path}: sha256 differs from the manifest",
                                       hint="run `datagen validate`; re-extract the shard")
            rows, off = _sample_order(m)
            order = np.argsort(rows, kind="stable")
            if len(rows) != rec.samples:
                raise ValidationFailed(f"shard {rec.path}: {len(rows)} samples, the manifest says {rec.samples}",
                                       hint="run `datagen validate`")
            ids = m.tensor("input_ids")
            mask = m.tensor("loss_mask")
            fp8 = "hidden_states_scale" in m.header.tensors
            for n, s in enumerate(order.tolist()):
                a, b = int(off[s]), int(off[s + 1])
                tok = ids[a:b].to(torch.int64)
                path = tmp / hs_name(bases[k] + n)
                hs = m.rows("hidden_states", a, b)
                if fp8:  # the trainer reads bfloat16: fp8 * scale, rounded once
                    hs = dequantize_fp8(hs, m.rows("hidden_states_scale", a, b)).to(torch.bfloat16)
                save_file({"token_ids": tok, "hidden_states": hs.contiguous()}, str(path))
                os.chmod(path, 0o644)  # safetensors creates 0600; training jobs run as other users
                sel = tok[mask[a:b].to(torch.bool)]
                u, c = torch.unique(sel, return_counts=True)
                freq.update(dict(zip(u.tolist(), c.tolist())))
            del ids, mask
        return rows[order].tolist(), freq

    all_rows: list[int] = []
    total: Counter = Counter()
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="export") as ex:
        for rows, freq in ex.map(one, range(len(man.shards))):
            all_rows.extend(rows)
            total.update(freq)
    return all_rows, total


def _rows_generator(root: str, manifest_json: str):
    man = Manifest.model_validate_json(manifest_json)
    for rec in man.shards:
        with _open_shard(Path(root), rec) as m:
            rows, off = _sample_order(m)
            ids = m.tensor("input_ids").numpy()
            mask = m.tensor("loss_mask").numpy()
            for s in np.argsort(rows, kind="stable").tolist():
                a, b = int(off[s]), int(off[s + 1])
                yield {"input_ids": ids[a:b].astype(np.int64), "loss_mask": mask[a:b].astype(np.int64),
                       "seq_len": b - a}
            del ids, mask


def _write_arrow(root: Path, man: Manifest, tmp: Path) -> None:
    # from_generator streams rows to Arrow files on disk (a cache under tmp) instead of
    # holding every token of the dataset in memory; save_to_disk then writes the layout.
    import datasets

    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int64")),
        "loss_mask": datasets.Sequence(datasets.Value("int64")),
        "seq_len": datasets.Value("int64"),
    })
    cache = tmp / ".arrow-cache"
    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        ds = datasets.Dataset.from_generator(
            _rows_generator, features=features, cache_dir=str(cache),
            gen_kwargs={"root": str(root.resolve()), "manifest_json": man.model_dump_json()},
        )
        ds.set_format(type="torch")  # speculators compares torch tensors read from it
        ds.save_to_disk(str(tmp))
        del ds
    finally:
        if was:
            datasets.enable_progress_bars()
    shutil.rmtree(cache, ignore_errors=True)
