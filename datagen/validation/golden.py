"""Golden samples: re-extract a few random rows with a reference engine and compare.

Rows are drawn with ``random.Random(seed)`` from the rows the readable shards store, so a
report's seed reproduces its choice. The reference is independent of the capture it checks:

* ``transformers``: the model in plain transformers, one sample at a time (where transformers
  has a causal-LM class for the model and the host can hold it);
* ``engine``: vLLM in eager mode with forward hooks on its decoder layers, one sample per
  pass, chunked prefill off (``datagen.engines.vllm_reference``): for models transformers
  cannot load (Kimi-K2.5), run where the model fits.

``auto`` takes transformers when it knows the model's architecture, else the engine. The
comparison (``datagen.validation.compare.judge_layer``) bounds each layer's median and p90 token error and
asks that the stored states be much closer to the right layer than to its neighbours (and,
for the last layer, than to the state after the final norm): MoE routing flips in bf16 move
a few tokens by tens of percent, capture bugs move the bulk. The single worst token is
reported; the ``max-token`` criterion (worst token within a tolerance) is kept for
comparison and for float32 datasets, where it is the sharper test.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from datagen.validation.compare import (
    FP8_REL_ERROR,
    GoldenCriterion,
    fp8_allowance,
    judge_layer,
    neighbour_ids,
)
from datagen.validation.report import Findings, Problem, ProblemKind
from datagen.validation.scan import ShardScan, resolve_inside
from datagen.validation.settings import DEFAULT_TOLERANCE, GoldenCriterionName, GoldenReference
from datagen.validation.shardfile import MappedShard, read_header

log = logging.getLogger(__name__)

_EPS = 1e-6
POST_NORM = -1  # the state after the final norm, in a reference's states


@dataclass(frozen=True)
class GoldenPlan:
    """Which rows to re-extract, and where they are stored."""

    seed: int
    rows: tuple[int, ...]  # dataset rows, increasing
    where: dict[int, tuple[int, int]]  # row -> (index into scans, sample number in its shard)


def draw_rows(stored_rows, n: int, seed: int) -> tuple[int, ...]:
    """``n`` of ``stored_rows`` drawn with ``seed`` (all of them if fewer), increasing."""
    pool = sorted(stored_rows)
    return tuple(sorted(random.Random(seed).sample(pool, min(n, len(pool)))))


def choose(scans: list[ShardScan], n: int, seed: int) -> GoldenPlan:
    """Draw ``n`` of the rows the readable shards store."""
    where = {}
    for i, sc in enumerate(scans):
        if sc.readable and sc.sample_rows is not None and sc.offsets is not None:
            for s, r in enumerate(sc.sample_rows.tolist()):
                where[r] = (i, s)
    rows = draw_rows(where, n, seed)
    return GoldenPlan(seed, rows, {r: where[r] for r in rows})


def wanted_ids(layer_ids: tuple[int, ...], num_hidden_layers: int) -> tuple[int, ...]:
    """Every state the comparison needs: the stored layers, their neighbours, and the state
    after the final norm when the last layer is stored."""
    out = set(layer_ids)
    for lid in layer_ids:
        out.update(neighbour_ids(lid, num_hidden_layers))
    if num_hidden_layers in layer_ids:
        out.add(POST_NORM)
    return tuple(sorted(out))


def _transformers_knows(model_dir: Path) -> bool:
    """True when transformers has its own causal-LM class for the model (no remote code)."""
    import json

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


class _Reference:
    """A started reference engine: ``states(ids) -> {layer id: [T, H]}``."""

    def __init__(self, kind: GoldenReference, *, model_dir: Path, num_hidden_layers: int, wanted: tuple[int, ...],
                 dtype: str, max_seq_len: int, trust_remote_code: bool, tensor_parallel_size: int,
                 media: bool = False):
        self.kind = kind
        self.wanted = wanted
        t0 = time.monotonic()
        if kind is GoldenReference.TRANSFORMERS:
            from datagen.engines.hf import HFReference

            # Never the model's own code here: transformers' own class, or the engine reference.
            self._hf = HFReference(str(model_dir), layer_ids=tuple(k for k in wanted if k >= 0),
                                   num_hidden_layers=num_hidden_layers, dtype=dtype, trust_remote_code=False)
            self._engine = None
        else:
            from datagen.engines.vllm_reference import VllmReference

            self._hf = None
            self._engine = VllmReference(str(model_dir), num_hidden_layers=num_hidden_layers, wanted=wanted,
                                         dtype=dtype, max_seq_len=max_seq_len, trust_remote_code=trust_remote_code,
                                         tensor_parallel_size=tensor_parallel_size, media=media)
        self.start_seconds = time.monotonic() - t0

    def states(self, ids: torch.Tensor, images=()) -> dict[int, torch.Tensor]:
        if self._hf is not None:
            return self._hf.states_by_id(ids, self.wanted)
        return self._engine.states(ids, images) if images else self._engine.states(ids)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self._hf = self._engine = None


def _open_reference(kind: GoldenReference, model_dir: Path, **kw) -> tuple[_Reference, str]:
    """The reference to run, and why it was chosen."""
    if kind is GoldenReference.AUTO:
        if _transformers_knows(model_dir):
            kind, why = GoldenReference.TRANSFORMERS, "transformers has a causal-LM class for this model"
        else:
            kind, why = GoldenReference.ENGINE, "transformers has no causal-LM class for this model"
    else:
        why = "asked for"
    return _Reference(kind, model_dir=model_dir, **kw), why


def run(root: Path, scans: list[ShardScan], plan: GoldenPlan, *, model_dir: Path, layer_ids: tuple[int, ...],
        num_hidden_layers: int, dtype: str, trust_remote_code: bool, tolerance: float, findings: Findings,
        reference: GoldenReference = GoldenReference.AUTO,
        criterion: GoldenCriterionName = GoldenCriterionName.ROBUST, max_seq_len: int = 4096,
        tensor_parallel_size: int = 1, thresholds: GoldenCriterion = GoldenCriterion(),
        media: dict | None = None) -> dict:
    """Re-extract ``plan.rows`` with the reference and judge them. Returns details for the report.

    ``trust_remote_code`` is the caller's (the pipeline spec's), never the manifest's; only the
    engine reference uses it (transformers runs its own classes only). ``media``: row -> its images
    (``MediaItem``, from the fresh plan) for image rows, handed to the engine reference with the ids.
    """
    from datagen.data.shards.kernels import dequantize_fp8
    from datagen.errors import ModelError

    details: dict = {
        "seed": plan.seed, "rows": list(plan.rows), "tolerance": tolerance, "criterion": criterion.value,
        "thresholds": {"median": thresholds.median_max, "quantile": thresholds.quantile,
                       "quantile_max": thresholds.quantile_max, "neighbour_ratio": thresholds.neighbour_ratio},
        "max_rel_error": {}, "layers": {}, "max_token_failures": 0, "robust_failures": 0,
    }
    if not plan.rows:
        return details
    wanted = wanted_ids(layer_ids, num_hidden_layers)
    try:
        ref, why = _open_reference(reference, model_dir, num_hidden_layers=num_hidden_layers, wanted=wanted,
                                   dtype=dtype, max_seq_len=max_seq_len, trust_remote_code=trust_remote_code,
                                   tensor_parallel_size=tensor_parallel_size, media=bool(media))
    except (ModelError, ImportError) as e:
        msg = e.message if isinstance(e, ModelError) else f"{e} (the engine reference needs vLLM)"
        findings.add(Problem(ProblemKind.GOLDEN_UNAVAILABLE, f"the reference engine cannot load {model_dir}: {msg}"))
        return details
    details["reference"] = {"kind": ref.kind.value, "why": why, "start_seconds": round(ref.start_seconds, 3)}
    t0, tokens = time.monotonic(), 0
    try:
        for row in plan.rows:
            i, s = plan.where[row]
            sc = scans[i]
            full = resolve_inside(sc.root or root, sc.path)
            with MappedShard(full, read_header(full)) as m:
                a, b = int(sc.offsets[s]), int(sc.offsets[s + 1])
                ids = m.rows("input_ids", a, b).to(torch.long).clone()
                stored = m.rows("hidden_states", a, b).clone()
                fp8 = "hidden_states_scale" in m.header.tensors
                if fp8:  # fp8 storage: compare the stored values, allowing for e4m3's rounding
                    stored = dequantize_fp8(stored, m.rows("hidden_states_scale", a, b))
            images = (media or {}).get(row, ())
            refs = ref.states(ids, images)
            if images:  # an image row is judged on its text tokens (docs/decisions.md)
                text = text_positions(len(ids), images)
                stored, refs = stored[text], {k: v[text] for k, v in refs.items()}
            tokens += len(ids)
            _judge_row(row, sc, stored, refs, layer_ids, num_hidden_layers, details, findings,
                       criterion=criterion, tolerance=tolerance + FP8_REL_ERROR if fp8 else tolerance,
                       thresholds=fp8_allowance(thresholds) if fp8 else thresholds)
    finally:
        ref.close()
    details["reference"].update(seconds=round(time.monotonic() - t0, 3), tokens=tokens)
    return details


def text_positions(n: int, images) -> torch.Tensor:
    """[n] True at the tokens of a sample that are not its images' placeholders."""
    keep = torch.ones(n, dtype=torch.bool)
    for m in images:
        keep[m.offset:m.offset + m.tokens] = False
    return keep


def _judge_row(row, sc, stored, refs, layer_ids, n, details, findings, *, criterion, tolerance, thresholds) -> None:
    worst_by_layer, verdicts = {}, {}
    for j, lid in enumerate(layer_ids):
        neighbours = {f"layer {k}": refs[k] for k in neighbour_ids(lid, n)}
        if lid == n:
            neighbours["the state after the final norm"] = refs[POST_NORM]
        v = judge_layer(stored[:, j], refs[lid], neighbours, layer_id=lid, criterion=thresholds)
        worst_by_layer[str(lid)] = round(v.worst, 6)
        verdicts[str(lid)] = v.to_json()
        max_token_ok = v.worst <= tolerance
        details["max_token_failures"] += not max_token_ok
        details["robust_failures"] += not v.ok
        if criterion is GoldenCriterionName.ROBUST and not v.ok:
            findings.add(Problem(ProblemKind.GOLDEN_MISMATCH,
                                 "stored states differ from a re-extraction: " + "; ".join(v.problems),
                                 shard=sc.index, path=sc.path, row=row, layer_id=lid))
        elif criterion is GoldenCriterionName.MAX_TOKEN and not max_token_ok:
            findings.add(Problem(
                ProblemKind.GOLDEN_MISMATCH,
                f"stored states differ from a re-extraction by {v.worst:.1%} at token {v.worst_token} "
                f"(tolerance {tolerance:.1%})", shard=sc.index, path=sc.path, row=row, layer_id=lid))
    details["max_rel_error"][str(row)] = worst_by_layer
    details["layers"][str(row)] = verdicts
    log.debug("golden row %d: %s", row, verdicts)
