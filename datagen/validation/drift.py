"""Per-layer statistics compared with a previous dataset of the same model and layers.

A nightly re-extraction over new rows of the same distribution moves a layer's
mean by a small fraction of its standard deviation and its standard deviation by a
few percent. A different checkpoint, a changed chat template or a captured layer
off by one moves them by tens of percent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from datagen.data.contract import MANIFEST_NAME, LayerStats, Manifest
from datagen.validation.report import Findings, Problem, ProblemKind
from datagen.validation.settings import DEFAULT_DRIFT_THRESHOLD

DEFAULT_THRESHOLD = DEFAULT_DRIFT_THRESHOLD


def _identity(m: Manifest) -> dict:
    model = m.spec.model
    return {"architecture": model.architecture, "num_hidden_layers": model.num_hidden_layers,
            "hidden_size": model.hidden_size, "layer_ids": list(m.spec.layer_ids), "dtype": m.spec.dtype}


def check(current: Manifest, previous: Path, *, threshold: float, findings: Findings) -> dict:
    """Compare ``current``'s per-layer mean and std with the dataset at ``previous``.

    A layer drifts when its mean moved by more than ``threshold`` previous standard
    deviations, or its standard deviation changed by more than ``threshold`` (relative).
    """
    details: dict = {"previous": str(previous), "threshold": threshold, "layers": {}}
    try:
        prev = Manifest.model_validate_json((previous / MANIFEST_NAME).read_bytes())
    except (OSError, ValidationError) as e:
        findings.add(Problem(ProblemKind.PREVIOUS_INCOMPATIBLE, f"cannot read the previous dataset's manifest at "
                             f"{previous}: {str(e).splitlines()[0]}"))
        return details
    details["previous_fingerprint"] = prev.fingerprint
    a, b = _identity(current), _identity(prev)
    differ = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    if differ:
        findings.add(Problem(ProblemKind.PREVIOUS_INCOMPATIBLE, "the previous dataset is of another model or "
                             "layer set: " + ", ".join(f"{k} {v[0]} vs {v[1]}" for k, v in differ.items())))
        return details
    for d in layer_drift(current.layer_stats, prev.layer_stats, threshold=threshold):
        details["layers"][str(d.layer_id)] = {
            "mean": d.mean, "previous_mean": d.previous_mean, "std": d.std, "previous_std": d.previous_std,
            "mean_shift_in_std": round(d.mean_shift, 6), "std_ratio": round(d.std_ratio, 6),
        }
        if d.drifted:
            findings.add(Problem(ProblemKind.DRIFT, f"mean moved by {d.mean_shift:.2f} previous std, std changed by "
                                 f"{d.std_ratio - 1.0:+.1%} (threshold {threshold:.0%})", layer_id=d.layer_id))
    return details


@dataclass(frozen=True)
class LayerDrift:
    """How far one layer's statistics moved from the previous dataset's."""

    layer_id: int
    mean: float
    previous_mean: float
    std: float
    previous_std: float
    mean_shift: float  # |mean - previous mean| in previous standard deviations
    std_ratio: float  # std / previous std
    drifted: bool  # either beyond the threshold


def layer_drift(current: list[LayerStats], previous: list[LayerStats], *, threshold: float) -> list[LayerDrift]:
    """Per-layer drift of ``current`` from ``previous`` (the rule of ``check``); layers without values skipped."""
    out = []
    for cur, old in zip(current, previous):
        if not cur.count or not old.count:
            continue
        scale = max(old.std, 1e-12)
        shift = abs(cur.mean - old.mean) / scale
        ratio = cur.std / scale
        out.append(LayerDrift(layer_id=cur.layer_id, mean=cur.mean, previous_mean=old.mean, std=cur.std,
                              previous_std=old.std, mean_shift=shift, std_ratio=ratio,
                              drifted=shift > threshold or abs(ratio - 1.0) > threshold))
    return out
