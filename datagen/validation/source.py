"""A fresh read of the source rows, to compare with what the shards store.

The recorded spec is turned back into an extraction spec and planned with the
extraction step's own ``plan`` (same reader, same tokenizer, same truncation), so
"the stored token ids equal a fresh tokenization" is checked with the code that
produced them. The engine is always described as the reference engine here: the
validation image need not have vLLM, and the engine only enters fingerprints,
which are checked from the manifest itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from datagen.data import dataset_files
from datagen.data.dataset import Sample
from datagen.errors import DatagenError
from datagen.validation.manifest import LoadedManifest
from datagen.validation.report import Findings, Problem, ProblemKind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sources:
    """Where the model and the source rows are, and whether they exist here."""

    model: Path  # local model directory
    dataset: str  # the rows as a spec names them: a path, optionally '#' and options (datagen.data.dataset_files)
    model_found: bool
    dataset_found: bool  # its path is a file or a folder, as the loader reads one (dataset_files.exists)
    tokenizer: Path | None = None  # the tokenizer the extraction named instead of the model's (spec `tokenizer`)

    @property
    def dataset_path(self) -> Path:
        """The dataset's path, without its options."""
        return dataset_files.parse_ref(self.dataset).path


@dataclass(frozen=True)
class FreshRows:
    """The source rows as extraction would read them today."""

    samples: dict[int, Sample]  # row -> tokens and loss mask (rows not skipped)
    shard_keys: dict[int, str]  # shard index -> cache key from the spec and the source rows
    model_matches: bool  # the model directory is the one extracted from (revision or content)


def locate(lm: LoadedManifest, *, model: str | None, dataset: str | None, tokenizer: str | None = None) -> Sources:
    """The source model and dataset: the overrides, else the paths recorded in the spec; and the
    tokenizer directory the extraction named instead of the model's, if it did (not recorded: only
    its content is, in the fingerprint).

    Raises:
        DatasetError: the dataset's options (after ``#``) are not ones the loader knows.
    """
    spec = lm.manifest.spec
    mdir = Path(model or spec.model.source or "")
    data = dataset or (spec.dataset.source if spec.dataset else None) or ""
    found = bool(data) and dataset_files.exists(dataset_files.parse_ref(data))
    return Sources(mdir, data, mdir.is_dir() and str(mdir) != ".", found, Path(tokenizer) if tokenizer else None)


def read_fresh(lm: LoadedManifest, src: Sources, findings: Findings, *,
               trust_remote_code: bool = False) -> FreshRows | None:
    """Plan extraction again from the sources; None when they differ from the recorded ones.

    ``trust_remote_code`` is the caller's permission (a tokenizer shipped as code, Kimi's).
    """
    from datagen.specs.extraction import parse_spec
    from datagen.extraction.plan import plan, shard_key

    spec = lm.manifest.spec
    revision = spec.model.revision
    raw = {
        "model": str(src.model),
        "model_revision": None if str(revision or "").startswith("content:") else revision,
        "dataset": src.dataset,
        "out": str(src.dataset_path.parent / ".datagen-validate-unused"),  # plan() writes nothing
        "tokenizer": str(src.tokenizer) if src.tokenizer else None,
        "layer_ids": list(lm.expected.layer_ids),
        "max_seq_len": spec.preprocessing.max_seq_len,
        "samples_per_shard": lm.samples_per_shard,
        "shard_bytes": lm.shard_bytes,
        "engine": {"name": "hf", "dtype": lm.compute_dtype, "storage_dtype": lm.expected.dtype,
                   # never taken from the manifest: a manifest is data, not permission to run code
                   "trust_remote_code": trust_remote_code},
    }
    try:
        p = plan(parse_spec(raw, source="the manifest's spec"))
    except DatagenError as e:
        findings.add(Problem(ProblemKind.SOURCE_CHANGED, f"the source no longer plans as it did: {e.message}"))
        return None
    recorded_sha256 = spec.dataset.sha256 if spec.dataset else None
    if p.data.fingerprint != recorded_sha256 or p.data.rows != lm.rows:
        findings.add(Problem(ProblemKind.SOURCE_CHANGED, f"source dataset {src.dataset} is not the one extracted "
                             f"(sha256 {p.data.fingerprint[:16]}... vs {str(recorded_sha256)[:16]}..., "
                             f"{p.data.rows} vs {lm.rows} rows)"))
        return None
    pre = spec.preprocessing
    for key, fresh in (("chat_template_sha256", p.data.chat_template_hash),
                       ("tokenizer_sha256", p.data.tokenizer_hash)):
        if getattr(pre, key) != fresh:
            which = f"tokenizer {src.tokenizer}" if src.tokenizer else "the model's tokenizer"
            findings.add(Problem(ProblemKind.SOURCE_CHANGED, f"{which} differs from the one extracted with ({key}); "
                                 "if the extraction's spec named a `tokenizer`, validate with that one (--tokenizer)"))
            return None
    model_matches = p.resolved_spec.model.revision == revision
    if not model_matches:
        findings.add(Problem(ProblemKind.SOURCE_CHANGED, f"model {src.model} is not the one extracted from "
                             f"(revision {str(p.resolved_spec.model.revision)[:24]} vs {str(revision)[:24]})"))
    _compare_lists(lm, p.data.skipped, p.data.truncated, findings)
    efp = lm.manifest.extraction_fingerprint
    keys = {}
    for k in range(p.num_shards):
        first, count = p.shard_range(k)
        keys[k] = shard_key(efp, k, first, count, p.data.shard_rows_hash(first, count))
    return FreshRows(samples=p.data.samples, shard_keys=keys, model_matches=model_matches)


def _compare_lists(lm: LoadedManifest, skipped, truncated, findings: Findings) -> None:
    rec_skip = {s.row: s.reason for s in lm.manifest.skipped}
    new_skip = {s.row: s.reason for s in skipped}
    for r in sorted(set(rec_skip) | set(new_skip)):
        if rec_skip.get(r) != new_skip.get(r):
            findings.add(Problem(ProblemKind.SKIPPED, f"recorded as skipped ({rec_skip.get(r)}), a fresh read says "
                                 f"{new_skip.get(r) or 'keep'}", row=r))
    rec_tr = {t.row: (t.original_tokens, t.kept_tokens) for t in lm.manifest.truncated}
    new_tr = {t.row: (t.original_tokens, t.kept_tokens) for t in truncated}
    for r in sorted(set(rec_tr) | set(new_tr)):
        if rec_tr.get(r) != new_tr.get(r):
            findings.add(Problem(ProblemKind.TOKENS, f"recorded truncation {rec_tr.get(r)} differs from a fresh "
                                 f"read {new_tr.get(r)} (original, kept tokens)", row=r))
