"""Validating a dataset: ``validate``, the work of the `validate` step (``datagen validate DATASET``,
``datagen/steps/validate.py``), over the checks of this package.

Nothing reaches training unless it is provably right. Checks, in order:

1. manifest: present, parses, contract version, fingerprints match the recorded
   spec, shard ranges tile the rows, totals and statistics add up;
2. shards (in parallel, memory-mapped, one read per file): inside the dataset,
   present, size and sha256, tensor names/dtypes/shapes, shard key and layers of
   this spec, offsets, sample rows, token ids and loss masks against a fresh
   tokenization of the source rows (when the model and dataset are reachable),
   NaN/Inf, per-layer statistics recomputed;
3. rows: each in exactly one shard or listed as skipped with a reason;
4. golden samples: N rows drawn with a recorded seed, re-extracted with the
   reference engine and compared per token;
5. drift: per-layer statistics against ``--previous`` (the last good dataset).

The JSON report lists every problem with its shard and row. When, and only when,
there is none, the report is also written to ``<dataset>/.datagen/validation.json``
(``ok`` and ``manifest_sha256`` are what ``datagen publish`` checks); a stale one is
removed before validation starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from datagen.data.contract import validation_path
from datagen.data.files import atomic_write_json
from datagen.data.shards.kernels import combine_stats
from datagen.specs.extraction import DEFAULT_MAX_SEQ_LEN
from datagen.errors import SpecError, StorageError
from datagen.validation import drift, golden, manifest, scan, source
from datagen.validation.settings import ValidationSettings
from datagen.validation.report import Findings, Problem, ProblemKind

log = logging.getLogger(__name__)

K = ProblemKind
# check name -> the problem kinds that fail it (the report's "checks" section)
CHECKS: dict[str, set[ProblemKind]] = {
    "manifest": {K.MANIFEST_MISSING, K.MANIFEST_INVALID, K.MANIFEST_CHANGED, K.FORMAT_VERSION, K.SPEC_INVALID,
                 K.FINGERPRINT, K.TOTALS, K.SHARD_RANGES, K.SKIPPED},
    "shard_files": {K.UNSAFE_PATH, K.SHARD_MISSING, K.SHARD_SIZE, K.SHARD_CHECKSUM, K.SHARD_HEADER},
    "shard_contents": {K.SHARD_TENSORS, K.SHARD_FOREIGN, K.SHARD_RECORD, K.OFFSETS, K.SAMPLE_INDEX,
                       K.LOSS_MASK_VALUES},
    "rows": {K.ROW_MISSING, K.ROW_DUPLICATED, K.ROW_SKIPPED_AND_STORED},
    "tokenization": {K.SOURCE_CHANGED, K.SOURCE_UNAVAILABLE, K.TOKENS, K.LOSS_MASK},
    "finite": {K.NON_FINITE},
    "statistics": {K.STATS},
    "golden": {K.GOLDEN_MISMATCH, K.GOLDEN_UNAVAILABLE},
    "drift": {K.DRIFT, K.PREVIOUS_INCOMPATIBLE},
}


def validate(dataset: str | Path, settings: ValidationSettings = ValidationSettings(), *, seed: int | None = None,
             workers: int | None = None, model: str | None = None, source_rows: str | None = None,
             tokenizer: str | None = None, trust_remote_code: bool = False) -> dict:
    """Validate the dataset at ``dataset`` and return the report (``report["ok"]``).

    Args:
        settings: the checks' settings (golden rows and their reference and criterion, the drift
            check's previous dataset and threshold), as a pipeline spec gives them.
        seed: seed of the golden rows' draw; a random one is drawn (and reported) if None.
        workers: shards scanned in parallel (default: the number of CPUs, at most 8).
        model, source_rows: the source model directory and dataset (a file or a folder, with the
            ``#options`` it was extracted with), when they are no longer where the manifest's spec says.
        tokenizer: the tokenizer directory the extraction's spec named instead of the model's own
            (its ``tokenizer``); None when it used the model's.
        trust_remote_code: the pipeline spec's permission to run the model's own code (its
            tokenizer, the engine reference's model); never read from the manifest.

    Returns:
        The report (JSON-ready). When ``ok`` it is also written to
        ``<dataset>/.datagen/validation.json``.

    Raises:
        SpecError: ``dataset`` is not a directory.
        StorageError: the passing report cannot be written into the dataset.
    """
    t0 = time.monotonic()
    root = Path(dataset)
    if not root.is_dir():
        raise SpecError(f"dataset {root} is not a directory", hint="pass the directory that holds manifest.json")
    marker = validation_path(root)
    _remove_stale(marker)
    seed = secrets.randbelow(2**31) if seed is None else seed
    findings = Findings()
    report: dict = {"ok": False, "dataset": str(root.resolve()), "manifest_sha256": None}

    lm = manifest.load(root, findings)
    if lm is not None:
        _validate(root, lm, findings, report, settings, seed=seed, workers=workers or min(8, os.cpu_count() or 1),
                  model=model, source_rows=source_rows, tokenizer=tokenizer, trust_remote_code=trust_remote_code)
    for name, kinds in CHECKS.items():
        if name not in findings.checks:
            if lm is None and name != "manifest":
                findings.not_run(name, "no readable manifest")
            else:
                findings.outcome(name, kinds)
    problems = [p.to_json() for p in findings.problems]
    counts: dict[str, int] = {}
    for p in findings.problems:
        counts[p.kind.value] = counts.get(p.kind.value, 0) + 1
    report.update(
        ok=not problems,
        validated_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        seconds=round(time.monotonic() - t0, 3),
        checks={k: c.to_json() for k, c in findings.checks.items()},
        problem_counts=counts,
        problems=problems,
    )
    if report["ok"]:
        try:
            atomic_write_json(marker, report)
        except OSError as e:
            raise StorageError(f"validation passed but {marker} cannot be written: {e}",
                               hint="make the dataset directory writable and validate again") from e
    return report


def _validate(root: Path, lm: manifest.LoadedManifest, findings: Findings, report: dict, settings: ValidationSettings,
              *, seed, workers, model, source_rows, tokenizer, trust_remote_code) -> None:
    m = lm.manifest
    report.update(manifest_sha256=lm.sha256, fingerprint=m.fingerprint,
                  extraction_fingerprint=m.extraction_fingerprint, layer_ids=list(lm.expected.layer_ids),
                  shards=len(m.shards), rows=lm.rows, samples=m.totals.get("samples"),
                  tokens=m.totals.get("tokens"))
    manifest.check(lm, findings)

    src = source.locate(lm, model=model, dataset=source_rows, tokenizer=tokenizer)
    report["sources"] = {"model": str(src.model), "model_found": src.model_found,
                         "dataset": str(src.dataset), "dataset_found": src.dataset_found}
    fresh = None
    if src.model_found and src.dataset_found:
        t = time.monotonic()
        fresh = source.read_fresh(lm, src, findings, trust_remote_code=trust_remote_code)
        log.info("source rows re-read and tokenized in %.1fs", time.monotonic() - t)
    else:
        missing = [str(p) for p, ok in ((src.model, src.model_found), (src.dataset, src.dataset_found)) if not ok]
        findings.not_run("tokenization", f"source not reachable here: {', '.join(missing)} "
                         "(pass --model/--source where they moved)")

    t = time.monotonic()
    scans = _scan_all(root, lm, fresh, workers)
    scan_s = time.monotonic() - t
    read = sum(s.bytes_read for s in scans)
    report.update(bytes_read=read, scan_seconds=round(scan_s, 3),
                  scan_gb_per_s=round(read / scan_s / 1e9, 3) if scan_s > 0 else None, workers=workers)
    log.info("scanned %d shards, %.2f GB in %.1fs (%.2f GB/s, %d workers)", len(scans), read / 1e9, scan_s,
             read / scan_s / 1e9 if scan_s else 0.0, workers)
    for sc in scans:
        findings.extend(sc.problems)
    manifest.check_coverage(lm, scans, findings)
    _check_dataset_stats(lm, scans, findings)

    if settings.golden_samples > 0:
        _golden(root, lm, scans, findings, report, n=settings.golden_samples, seed=seed, src=src,
                tolerance=settings.golden_tolerance, fresh=fresh, reference=settings.golden_reference,
                criterion=settings.golden_criterion, trust_remote_code=trust_remote_code)
    else:
        findings.not_run("golden", "--golden 0")
    if settings.previous is not None:
        report["drift"] = drift.check(m, Path(settings.previous), threshold=settings.drift_threshold, findings=findings)
    else:
        findings.not_run("drift", "no --previous dataset given")
    if manifest.manifest_sha256(root) != lm.sha256:
        findings.add(Problem(ProblemKind.MANIFEST_CHANGED, "manifest.json changed while it was validated; "
                                      "validate again"))


@contextlib.contextmanager
def _torch_threads(n: int):
    # Worker threads each reduce their own shard; torch's own intra-op threads on top of
    # that only contend for the same cores (measured: 1 thread per worker is fastest).
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _scan_all(root: Path, lm: manifest.LoadedManifest, fresh: source.FreshRows | None,
              workers: int) -> list[scan.ShardScan]:
    recs = lm.manifest.shards

    def one(rec):
        return scan.scan_shard(root, rec, lm.expected, fresh=fresh.samples if fresh else None,
                               fresh_key=fresh.shard_keys.get(rec.index) if fresh else None,
                               volumes=lm.manifest.volumes)

    out = []
    with _torch_threads(1), ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="validate") as ex:
        for i, sc in enumerate(ex.map(one, recs)):
            out.append(sc)
            log.debug("shard %d: %d problems", sc.index, len(sc.problems))
            if (i + 1) % 100 == 0:
                log.info("scanned %d/%d shards", i + 1, len(recs))
    return out


def _check_dataset_stats(lm: manifest.LoadedManifest, scans: list[scan.ShardScan], findings: Findings) -> None:
    if not scans or not all(s.readable and s.stats is not None for s in scans):
        return  # a shard could not be read: its own problem says so
    bad = set().union(*(s.non_finite_layers for s in scans))
    combined = combine_stats([s.stats for s in scans if s.stats and s.stats[0].count], lm.expected.layer_ids)
    for msg, lid in scan.compare_stats(combined, lm.manifest.layer_stats, skip=bad):
        findings.add(Problem(ProblemKind.STATS, "dataset " + msg, layer_id=lid))


def _golden(root, lm, scans, findings, report, *, n, seed, src, tolerance, fresh, reference, criterion,
            trust_remote_code) -> None:
    plan = golden.choose(scans, n, seed)
    # image rows are re-extracted with their images (from the fresh plan), and left out without one
    images = {r: s.media for r, s in fresh.samples.items() if s.media} if fresh is not None else {}
    blind = {m.row for m in lm.manifest.media} - set(images)
    if blind & set(plan.rows):
        plan = dataclasses.replace(plan, rows=tuple(r for r in plan.rows if r not in blind))
    report["golden"] = {"seed": seed, "rows": list(plan.rows), "tolerance": tolerance}
    if not src.model_found:
        findings.add(Problem(ProblemKind.GOLDEN_UNAVAILABLE, f"model {src.model} is not reachable here, so "
                                      "no golden sample can be re-extracted (pass --model, or --golden 0 to skip)"))
        return
    t = time.monotonic()
    report["golden"] = golden.run(
        root, scans, plan, model_dir=src.model, layer_ids=lm.expected.layer_ids,
        num_hidden_layers=lm.num_hidden_layers, dtype=lm.compute_dtype,
        # The caller's word (the pipeline spec), never the manifest's: a manifest is data, not
        # permission to run a model's own code.
        trust_remote_code=trust_remote_code,
        tolerance=tolerance, findings=findings, reference=reference, criterion=criterion,
        max_seq_len=lm.manifest.spec.preprocessing.max_seq_len or DEFAULT_MAX_SEQ_LEN,
        tensor_parallel_size=lm.manifest.spec.engine.tensor_parallel_size or 1, media=images)
    if fresh is not None and not fresh.model_matches:
        report["golden"]["note"] = "the model found is not the one extracted from (see source_changed)"
    ref = report["golden"].get("reference") or {}
    log.info("golden: %d rows re-extracted with %s in %.1fs (engine start %.1fs; seed %d)", len(plan.rows),
             ref.get("kind", "no reference"), time.monotonic() - t, ref.get("start_seconds", 0.0), seed)


def _remove_stale(marker: Path) -> None:
    try:
        marker.unlink(missing_ok=True)
    except OSError as e:  # a read-only dataset: nothing stale can be written there either
        log.warning("cannot remove %s: %s", marker, e)
