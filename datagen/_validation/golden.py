"""Golden samples: re-extract a few random rows with the reference engine and compare.

Rows are drawn with ``random.Random(seed)`` from the rows the readable shards store,
so a report's seed reproduces its choice. The comparison is per token and per
layer: relative L2 error ``||stored - ref|| / ||ref||``. On a tiny Llama in
bfloat16 the vLLM engine and the reference differ by 1-2% at most per token; a
state of the neighbouring layer or of another sample differs by 40-130%.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from datagen._validation.report import Findings, Problem, ProblemKind
from datagen._validation.scan import ShardScan, resolve_inside
from datagen._validation.shardfile import MappedShard, read_header

log = logging.getLogger(__name__)

DEFAULT_TOLERANCE = 0.05
_EPS = 1e-6


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


def relative_errors(stored: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[T, L] relative L2 error of each token's state in each layer."""
    s, r = stored.float(), ref.float()
    return torch.linalg.vector_norm(s - r, dim=-1) / torch.linalg.vector_norm(r, dim=-1).clamp_min(_EPS)


def run(root: Path, scans: list[ShardScan], plan: GoldenPlan, *, model_dir: Path, layer_ids: tuple[int, ...],
        num_hidden_layers: int, dtype: str, trust_remote_code: bool, tolerance: float,
        findings: Findings) -> dict:
    """Re-extract ``plan.rows`` and compare. Returns per-row details for the report."""
    from datagen.engines.hf import HFReference
    from datagen.errors import ModelError

    details: dict = {"seed": plan.seed, "rows": list(plan.rows), "tolerance": tolerance, "max_rel_error": {}}
    if not plan.rows:
        return details
    try:
        ref = HFReference(str(model_dir), layer_ids=layer_ids, num_hidden_layers=num_hidden_layers, dtype=dtype,
                          trust_remote_code=trust_remote_code)
    except ModelError as e:
        findings.add(Problem(ProblemKind.GOLDEN_UNAVAILABLE,
                             f"the reference engine cannot load {model_dir}: {e.message}"))
        return details
    for row in plan.rows:
        i, s = plan.where[row]
        sc = scans[i]
        full = resolve_inside(root, sc.path)
        with MappedShard(full, read_header(full)) as m:
            a, b = int(sc.offsets[s]), int(sc.offsets[s + 1])
            ids = m.rows("input_ids", a, b).to(torch.long).clone()
            stored = m.rows("hidden_states", a, b).clone()
        err = relative_errors(stored, ref.states(ids))  # [T, L]
        per_layer = {}
        for j, lid in enumerate(layer_ids):
            e = err[:, j]
            worst = int(torch.argmax(torch.nan_to_num(e, nan=float("inf"))))
            per_layer[str(lid)] = round(float(e[worst]), 6)
            if not bool(e[worst] <= tolerance):
                findings.add(Problem(
                    ProblemKind.GOLDEN_MISMATCH,
                    f"stored states differ from a re-extraction by {float(e[worst]):.1%} at token {worst} "
                    f"(tolerance {tolerance:.1%}; {int((e > tolerance).sum())}/{len(e)} tokens over it)",
                    shard=sc.index, path=sc.path, row=row, layer_id=lid))
        details["max_rel_error"][str(row)] = per_layer
        log.debug("golden row %d: %s", row, per_layer)
    return details
