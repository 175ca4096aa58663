"""The stored plan: a plan's tokenized rows kept in the output's private state, so that a shard range
(``datagen extract --plan FILE --shards A:B``) reads its own shards' samples instead of tokenizing the
whole dataset again. The plan file names where it is (``ExtractionPlan.stored_plan``).

Layout, under ``<out>/.datagen/plan/<fingerprint>/``::

    rows.safetensors             line_sha256 uint8 [rows, 32]: sha256 of each dataset row's bytes
    shard-000000.safetensors     the samples of shard 0: sample_index int64 [S] (dataset rows),
                                 sample_offsets int64 [S+1], input_ids int32 [T], loss_mask uint8 [T]
    ...
    index.json                   written last: what the plan was made of, the shards' boundaries,
                                 skipped and truncated rows, the sha256 of every file and its own

A stored plan is used only when it is stored under the fingerprint at hand (the plan file's, or in
`datagen plan` the one computed without reading the rows: ``plan_from``), written by the same
libraries that tokenize (transformers, tokenizers, jinja2) and stored-plan format, and every file it
reads has the sha256 the index records. Anything else (missing, torn, tampered, another fingerprint)
and the rows are tokenized again, the log says why. Files are written atomically, the index last.

A plan computed where a stored plan of another dataset fingerprint is (last night's file, since
edited or appended to) takes from it every row whose bytes are those of the same row then, when
it was made with the same tokenizer, chat template and max_seq_len (``StoredRows``; the index
records them): an appended dataset tokenizes only its new rows. Those rows are checked as every
row is; their tokens are read from the verified shard files of that plan.
"""

from __future__ import annotations

import bisect
import json
import logging
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np

from datagen.data.contract import STATE_DIR, SkippedRow, TruncatedRow
from datagen.data.media import media_samples
from datagen.data.dataset import PreparedDataset, Sample, file_fingerprint, tokenizer_hashes
from datagen.data.planning import prepare_dataset
from datagen.data.files import atomic_write_bytes
from datagen.specs.extraction import ExtractSpec, canonical_json, sha256_hex
from datagen.errors import DatagenError
from datagen.extraction.plan import Header, Plan, plan_from, plan_header
from datagen.specs.plan import PLAN_DIR, ShardCut, plan_dir

log = logging.getLogger(__name__)

FORMAT = 2  # 2: the index records the shards' boundaries (shards sized by bytes)
INDEX = "index.json"
ROWS_FILE = "rows.safetensors"


def _shard_file(k: int) -> str:
    return f"shard-{k:06d}.safetensors"


def library_versions() -> dict:
    """Versions of what turns a row into tokens (a chat template renders with jinja2)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("transformers", "tokenizers", "jinja2", "tiktoken"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


class StoredPlanError(Exception):
    """Why a stored plan cannot be used (the run plans instead)."""


class RangeSamples(Mapping):
    """The samples of some shards of a stored plan. A row outside them is an error, not a skipped
    row: a job built from rows that were never loaded must not look like a shard of skipped rows."""

    without_media = True  # a plan with image rows is never stored (store_plan): no sample has images

    def __init__(self, samples: dict[int, Sample], rows: range):
        self._samples, self._rows = samples, rows

    def _check(self, row: int) -> None:
        if row not in self._rows:
            raise RuntimeError(f"row {row} is outside the stored plan's loaded rows {self._rows.start}:{self._rows.stop}")

    def __contains__(self, row) -> bool:
        self._check(row)
        return row in self._samples

    def __getitem__(self, row: int) -> Sample:
        self._check(row)
        return self._samples[row]

    def __iter__(self) -> Iterator[int]:
        raise RuntimeError("a stored plan's samples are loaded for some shards only: iterate over shard rows")

    def __len__(self) -> int:
        raise RuntimeError("a stored plan's samples are loaded for some shards only")


# --- writing ------------------------------------------------------------------------------------

def _index_digest(index: dict) -> str:
    return sha256_hex(canonical_json({k: v for k, v in index.items() if k != "index_sha256"}))


def store_plan(p: Plan) -> Path | None:
    """Write a computed plan's tokenized samples into its output's private state (over a stored
    plan of the same fingerprint, which was not usable), and remove the stored plans of other
    fingerprints. A failure is logged, never raised: the stored plan only saves time."""
    from safetensors.numpy import save

    if media_samples(p.data):  # its images are not in the stored form: planned again
        log.info("plan not stored: the dataset has image rows (they are planned again each run)")
        return None
    d = plan_dir(p.spec.out, p.fingerprint)
    digests: dict[str, str] = {}

    def write(name: str, b: bytes) -> None:  # one file in memory at a time
        atomic_write_bytes(d / name, b)
        digests[name] = sha256_hex(b)

    try:
        data = p.data
        line = np.frombuffer(b"".join(data.line_hashes), dtype=np.uint8).reshape(data.rows, 32)
        write(ROWS_FILE, save({"line_sha256": line}))
        shards = []
        for k in range(p.num_shards):
            rows = [r for r in range(p.boundaries[k], p.boundaries[k + 1]) if r in data.samples]
            lens = [len(data.samples[r].input_ids) for r in rows]
            tensors = {
                "sample_index": np.asarray(rows, dtype=np.int64),
                "sample_offsets": np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                "input_ids": (np.concatenate([data.samples[r].input_ids for r in rows]) if rows
                              else np.zeros(0, np.int32)).astype(np.int32),
                "loss_mask": (np.concatenate([data.samples[r].loss_mask for r in rows]) if rows
                              else np.zeros(0, np.uint8)).astype(np.uint8),
            }
            write(_shard_file(k), save(tensors))
            shards.append({"file": _shard_file(k), "samples": len(rows), "tokens": int(sum(lens))})
        index = {
            "format": FORMAT,
            "fingerprint": p.fingerprint,
            "libraries": library_versions(),
            "dataset_sha256": data.fingerprint,
            "rows": data.rows,
            "tokens": data.tokens,
            "kinds": sorted(data.kinds),
            "dataset_format": data.format,  # recorded in the manifest's dataset part
            "tokenizer": data.tokenizer_hash is not None,  # a chat row was tokenized
            # what decides a chat row's tokens besides its bytes: a later plan of an edited or
            # appended dataset with the same takes its unchanged rows from here
            "preprocessing": {"chat_template_sha256": data.chat_template_hash, "tokenizer_sha256": data.tokenizer_hash,
                              "max_seq_len": p.spec.max_seq_len},
            "boundaries": list(p.boundaries),
            "skipped": [s.model_dump(mode="json") for s in data.skipped],
            "truncated": [t.model_dump(mode="json") for t in data.truncated],
            "shards": shards,
            "sha256": digests,
        }
        index["index_sha256"] = _index_digest(index)
        atomic_write_bytes(d / INDEX, (json.dumps(index, indent=1, sort_keys=True) + "\n").encode())
    except OSError as e:
        log.warning("plan: could not store the plan in %s (%s); ranges will tokenize the dataset", d, e)
        return None
    for other in (Path(p.spec.out) / PLAN_DIR).iterdir():
        if other.name != p.fingerprint and other.is_dir():
            shutil.rmtree(other, ignore_errors=True)
    log.info("plan: stored in %s", d.relative_to(Path(p.spec.out)))
    return d


# --- reading ------------------------------------------------------------------------------------

def read_index(d: Path, fingerprint: str) -> dict | None:
    """The index of ``d`` when it is whole, for ``fingerprint``, this format and these libraries."""
    try:
        index = json.loads((d / INDEX).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or index.get("index_sha256") != _index_digest(index):
        return None
    if (index.get("format") != FORMAT or index.get("fingerprint") != fingerprint
            or index.get("libraries") != library_versions()):
        return None
    return index


def _read_verified(d: Path, name: str, index: dict) -> dict[str, np.ndarray]:
    from safetensors.numpy import load

    want = index["sha256"].get(name)
    try:
        raw = (d / name).read_bytes()
    except OSError as e:
        raise StoredPlanError(f"{name} cannot be read ({e.strerror})") from None
    if want is None or sha256_hex(raw) != want:
        raise StoredPlanError(f"{name} does not have the sha256 its index records")
    try:
        return load(raw)
    except Exception as e:  # a verified file that does not parse: written by another format
        raise StoredPlanError(f"{name} is not a safetensors file ({e})") from None


def _load_shard(d: Path, index: dict, k: int, first: int, stop: int) -> dict[int, Sample]:
    t = _read_verified(d, _shard_file(k), index)
    rows, off, ids, mask = t["sample_index"], t["sample_offsets"], t["input_ids"], t["loss_mask"]
    ok = (rows.dtype == np.int64 and off.dtype == np.int64 and ids.dtype == np.int32 and mask.dtype == np.uint8
          and off.shape == (len(rows) + 1,) and ids.shape == mask.shape and off[0] == 0 and off[-1] == len(ids)
          and bool(np.all(np.diff(off) > 0)) and bool(np.all(np.diff(rows) > 0))
          and (len(rows) == 0 or (rows[0] >= first and rows[-1] < stop)))
    if not ok:
        raise StoredPlanError(f"{_shard_file(k)} does not hold shard {k}'s samples")
    return {int(r): Sample(row=int(r), input_ids=ids[a:b].copy(), loss_mask=mask[a:b].copy())
            for r, a, b in zip(rows, off[:-1], off[1:])}


def _cut(index: dict) -> ShardCut:
    """The stored plan's shards (boundaries and tokens), checked."""
    try:
        return ShardCut.checked(index["boundaries"], [s["tokens"] for s in index["shards"]], index["rows"])
    except ValueError as e:
        raise StoredPlanError(str(e)) from None


def stored_dataset(spec: ExtractSpec, d: Path, index: dict, shards: tuple[int, int], b, *,
                   hashes: Callable[[], tuple[str | None, str | None]]) -> PreparedDataset:
    """The dataset as the stored plan ``d`` holds it (shard boundaries ``b``), with the samples of
    ``shards`` only. ``hashes``: the chat template's and the tokenizer's, asked for when a chat row was tokenized."""
    rows = index["rows"]
    line = _read_verified(d, ROWS_FILE, index)["line_sha256"]
    if line.shape != (rows, 32) or line.dtype != np.uint8:
        raise StoredPlanError(f"{ROWS_FILE} does not hold {rows} row hashes")
    lo, hi = shards
    samples: dict[int, Sample] = {}
    for k in range(lo, hi):
        samples.update(_load_shard(d, index, k, b[k], b[k + 1]))
    template_hash, tok_hash = hashes() if index["tokenizer"] else (None, None)
    return PreparedDataset(
        path=str(Path(spec.dataset)),
        rows=rows,
        fingerprint=index["dataset_sha256"],
        samples=RangeSamples(samples, range(b[lo], b[hi])),
        skipped=[SkippedRow.model_validate(s) for s in index["skipped"]],
        truncated=[TruncatedRow.model_validate(t) for t in index["truncated"]],
        line_hashes=[bytes(x) for x in line],
        chat_template_hash=template_hash,
        tokenizer_hash=tok_hash,
        kinds=set(index["kinds"]),
        format=index["dataset_format"],
        total_tokens=index["tokens"],
    )


def load_plan(spec: ExtractSpec, shards: tuple[int, int] | None) -> tuple[Plan | None, str]:
    """The plan of ``spec`` from its output's stored plan, with the samples of ``shards`` (all
    shards when None), or (None, why not). Reads the dataset file once to hash it; tokenizes nothing."""
    root = Path(spec.out) / PLAN_DIR
    try:
        candidates = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    except OSError:
        candidates = []
    if not candidates:
        return None, f"no stored plan in {PLAN_DIR}"
    h = plan_header(spec)
    dataset_sha256 = file_fingerprint(spec.dataset)
    why = "stored for another dataset, tokenizer or spec"
    for d in candidates:
        index = read_index(d, d.name)
        if index is None:
            why = f"{PLAN_DIR}/{d.name[:12]} is incomplete, damaged or of other library versions"
            continue
        if index["dataset_sha256"] != dataset_sha256:
            continue
        try:
            cut = _cut(index)
            lo, hi = shards if shards is not None else (0, len(cut.tokens))
            if not (0 <= lo <= hi <= len(cut.tokens)):
                return None, f"--shards {lo}:{hi} is outside the stored plan's 0:{len(cut.tokens)}"
            data = stored_dataset(spec, d, index, (lo, hi), cut.boundaries,
                                  hashes=lambda: tokenizer_hashes(h.load_tokenizer()))
        except StoredPlanError as e:
            why = f"{PLAN_DIR}/{d.name[:12]}: {e}"
            continue
        except (KeyError, TypeError, ValueError) as e:
            why = f"{PLAN_DIR}/{d.name[:12]}: unreadable index ({e!r})"
            continue
        p = plan_from(h, data, cut=cut)
        if p.fingerprint != d.name:  # the tokenizer, template or settings differ from the stored plan's
            continue
        return p, f"loaded from {PLAN_DIR}/{d.name[:12]} (shards {lo}:{hi})"
    return None, why


# --- an earlier plan's unchanged rows ----------------------------------------------------------

class StoredRows:
    """The rows of an earlier stored plan (another dataset fingerprint: yesterday's file, edited or
    appended to) planned with the same tokenizer, chat template and max_seq_len: a row whose bytes
    are those of the same row then has the tokens it had then (``datagen.data.planning_rows.Reuse``)."""

    def __init__(self, d: Path, index: dict, line_sha256: np.ndarray):
        self._d, self._index, self._line = d, index, line_sha256
        self._boundaries = _cut(index).boundaries
        self._skipped = {s["row"]: s["reason"] for s in index["skipped"]}
        self._truncated = {t["row"]: TruncatedRow.model_validate(t) for t in index["truncated"]}
        self.name = d.name[:12]

    def known(self, first: int, line_hashes: list[bytes]):
        from datagen.data.planning_rows import Known

        n, b = len(self._line), self._boundaries
        same = [first + i for i, h in enumerate(line_hashes) if first + i < n and self._line[first + i].tobytes() == h]
        shard_of = {r: bisect.bisect_right(b, r) - 1 for r in same}
        out = {}
        for k in sorted(set(shard_of.values())):
            try:
                samples = _load_shard(self._d, self._index, k, b[k], b[k + 1])
            except (StoredPlanError, KeyError, OSError, ValueError):  # damaged: those rows are tokenized
                continue
            for r in (r for r in same if shard_of[r] == k):
                if r in samples:
                    out[r] = Known(samples[r], truncated=self._truncated.get(r))
                elif r in self._skipped:
                    out[r] = Known(None, skipped=SkippedRow(row=r, reason=self._skipped[r]))
        return out


def earlier_rows(h: Header) -> tuple[StoredRows | None, object | None]:
    """The stored plan in ``h``'s output of the same tokenizer, template and max_seq_len, whole and
    of these library versions (or None), and the tokenizer when it was loaded to compare them."""
    root = Path(h.spec.out) / PLAN_DIR
    try:
        candidates = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    except OSError:
        return None, None
    if not candidates:
        return None, None
    # a stored plan of this very file that was not used is damaged or of other settings: not read
    this = file_fingerprint(h.spec.dataset)
    indexes = [(d, index) for d in candidates if (index := read_index(d, d.name)) is not None
               and index.get("dataset_sha256") != this
               and (index.get("preprocessing") or {}).get("tokenizer_sha256")
               and index["preprocessing"].get("max_seq_len") == h.spec.max_seq_len]
    if not indexes:
        return None, None
    try:
        tokenizer = h.load_tokenizer()
    except DatagenError:  # planning says why, when a chat row needs it
        return None, None
    template_hash, tok_hash = tokenizer_hashes(tokenizer)
    for d, index in indexes:
        pre = index["preprocessing"]
        if (pre.get("chat_template_sha256"), pre.get("tokenizer_sha256")) != (template_hash, tok_hash):
            continue
        try:
            line = _read_verified(d, ROWS_FILE, index)["line_sha256"]
            if line.dtype == np.uint8 and line.shape == (index["rows"], 32):
                return StoredRows(d, index, line), tokenizer
        except (StoredPlanError, KeyError, TypeError, ValueError):
            continue
    return None, tokenizer


def _plan_reusing(spec: ExtractSpec) -> Plan:
    """``plan(spec)``, with the rows an earlier stored plan has unchanged taken from it."""
    h = plan_header(spec)
    reuse, tokenizer = earlier_rows(h)
    if reuse is not None:
        log.info("plan: the stored plan %s has the same tokenizer and settings: its unchanged rows are not "
                 "tokenized again", reuse.name)
    load = (lambda: tokenizer) if tokenizer is not None else h.load_tokenizer
    return plan_from(h, prepare_dataset(h.spec.dataset, load_tokenizer=load, vocab_size=h.info.vocab_size,
                                        max_seq_len=h.spec.max_seq_len, reuse=reuse))


def plan_shards(spec: ExtractSpec, shards: tuple[int, int] | None = None) -> tuple[Plan, bool]:
    """The plan of ``spec`` for ``shards``, and whether it came from the stored plan: stored when
    it is this spec's, else computed (every row read and tokenized). Logs which."""
    try:
        p, how = load_plan(spec, shards)
    except DatagenError:  # a spec, model or dataset the plan refuses: plan() says why
        p, how = None, "the spec, model or dataset is refused"
    except Exception as e:  # noqa: BLE001 - anything else in a stored plan: computing it is always right
        p, how = None, f"the stored plan cannot be read ({e!r})"
    if p is not None:
        log.info("plan: %s", how)
        return p, True
    log.info("plan: %s; tokenizing the whole dataset", how)
    return _plan_reusing(spec), False
