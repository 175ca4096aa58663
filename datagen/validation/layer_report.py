"""The layer report: one picture of a night's data next to the nights before it.

Per captured layer, the mean, the standard deviation and the largest absolute value of the
hidden states, and the tokens of each run. A layer whose statistics moved beyond the drift
threshold (the rule ``datagen validate`` fails on, ``datagen.validation.drift``) from the run
before the last is marked in red, and the title says so. The step ``datagen report``
(``datagen.steps.report``) is thin over ``make_report``; the Prefect flow attaches the same plot
to each run (``tasks/report.py``) and keeps each run's rows (``RunStats.to_rows``) as its history.

Datasets are directories or ``s3://`` prefixes; only their ``manifest.json`` is read.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from datagen.data.contract import MANIFEST_NAME, LayerStats, Manifest
from datagen.errors import DatasetError, SpecError
from datagen.validation.drift import DEFAULT_THRESHOLD, LayerDrift, layer_drift

log = logging.getLogger(__name__)

STATS = ("mean", "std", "absmax")


@dataclass(frozen=True)
class RunStats:
    """What the report shows of one run's dataset."""

    label: str  # the run's name on the x axis (date and fingerprint)
    fingerprint: str
    created_at: str  # ISO 8601, UTC
    tokens: int
    samples: int
    layers: tuple[LayerStats, ...]  # per captured layer, layer_ids order

    def to_rows(self) -> list[dict]:
        """One plain row per layer (what the flow keeps as the run's history record)."""
        return [{"label": self.label, "fingerprint": self.fingerprint, "created_at": self.created_at,
                 "tokens": self.tokens, "samples": self.samples, **s.model_dump()} for s in self.layers]

    @classmethod
    def from_rows(cls, rows: list[dict]) -> "RunStats":
        first = rows[0]
        fields = set(LayerStats.model_fields)
        return cls(label=first["label"], fingerprint=first["fingerprint"], created_at=first["created_at"],
                   tokens=int(first["tokens"]), samples=int(first["samples"]),
                   layers=tuple(LayerStats(**{k: v for k, v in r.items() if k in fields}) for r in rows))


def run_stats(m: Manifest, *, label: str | None = None) -> RunStats:
    return RunStats(label=label or f"{m.created_at[5:16].replace('T', ' ')} {m.fingerprint[:6]}",
                    fingerprint=m.fingerprint, created_at=m.created_at, tokens=int(m.totals.get("tokens", 0)),
                    samples=int(m.totals.get("samples", 0)), layers=tuple(m.layer_stats))


def load_manifest(location: str | Path) -> Manifest:
    """The manifest of a dataset directory or ``s3://`` prefix."""
    from datagen.reader._store import open_store

    raw = open_store(location).read_text(MANIFEST_NAME)
    try:
        return Manifest.model_validate_json(raw)
    except ValidationError as e:
        raise DatasetError(f"manifest.json does not match the contract: {e.errors()[0]['msg']}", path=str(location),
                           hint="run `datagen validate` for details") from e


def drift_of(runs: list[RunStats], *, threshold: float, reference: RunStats | None = None) -> list[LayerDrift]:
    """Drift of the last run from ``reference`` (default: the run before it); [] with one run."""
    ref = reference or (runs[-2] if len(runs) > 1 else None)
    if ref is None or [s.layer_id for s in ref.layers] != [s.layer_id for s in runs[-1].layers]:
        return []
    return layer_drift(list(runs[-1].layers), list(ref.layers), threshold=threshold)


def plot(runs: list[RunStats], drift: list[LayerDrift], *, threshold: float, title: str = "") -> bytes:
    """The report as PNG bytes: a panel per statistic (a line per layer over the runs) and the tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drifted = {d.layer_id for d in drift if d.drifted}
    layer_ids = [s.layer_id for s in runs[-1].layers]
    x = list(range(len(runs)))
    fig, axes = plt.subplots(1, 4, figsize=(4.2 * 4, 4.4), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, stat in zip(axes, STATS):
        for j, lid in enumerate(layer_ids):
            ys = [next((getattr(s, stat) for s in r.layers if s.layer_id == lid), float("nan")) for r in runs]
            bad = lid in drifted
            ax.plot(x, ys, marker="o", color="red" if bad else colors[j % len(colors)], lw=2.5 if bad else 1.5,
                    label=f"layer {lid}" + (" DRIFT" if bad else ""))
            if bad:
                ax.scatter([x[-1]], [ys[-1]], s=180, facecolors="none", edgecolors="red", linewidths=2, zorder=5)
        ax.set_title(f"{stat} per layer")
        ax.set_xticks(x, [r.label for r in runs], fontsize=7, rotation=40, ha="right")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    ax = axes[3]
    ax.bar(x, [r.tokens for r in runs], color=["red" if drifted and i == x[-1] else "tab:gray" for i in x])
    ax.set_title("tokens per run")
    ax.set_xticks(x, [r.label for r in runs], fontsize=7, rotation=40, ha="right")
    ax.grid(alpha=0.3, axis="y")
    head = title or "per-layer statistics of the last runs"
    if drifted:
        worst = max((d for d in drift if d.drifted), key=lambda d: max(d.mean_shift, abs(d.std_ratio - 1)))
        head += (f"  --  DRIFT in layers {sorted(drifted)} (threshold {threshold:.0%}; layer {worst.layer_id}: "
                 f"mean moved {worst.mean_shift:.2f} std, std {worst.std_ratio - 1:+.0%})")
        fig.suptitle(head, color="red", fontweight="bold")
    else:
        fig.suptitle(head + (f"  --  no drift beyond {threshold:.0%}" if drift else ""))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def markdown_table(runs: list[RunStats], drift: list[LayerDrift], *, threshold: float) -> str:
    """The last run's statistics and drift as a markdown table."""
    by_layer = {d.layer_id: d for d in drift}
    lines = ["| layer | mean | std | absmax | mean moved (std) | std change | drift |", "|---|---|---|---|---|---|---|"]
    for s in runs[-1].layers:
        d = by_layer.get(s.layer_id)
        moved = f"{d.mean_shift:.3f}" if d else "-"
        change = f"{d.std_ratio - 1:+.1%}" if d else "-"
        flag = ("**DRIFT**" if d.drifted else "ok") if d else "-"
        lines.append(f"| {s.layer_id} | {s.mean:.4g} | {s.std:.4g} | {s.absmax:.4g} | {moved} | {change} | {flag} |")
    lines.append("")
    lines.append(f"Runs: {len(runs)}; tokens of this run: {runs[-1].tokens:,}; drift threshold {threshold:.0%} "
                 "(mean moved in previous std, or std changed by more).")
    return "\n".join(lines)


def make_report(dataset: str | Path, *, previous: list[str] | None = None, out: str | Path = "report.png",
        threshold: float = DEFAULT_THRESHOLD, history: list[RunStats] | None = None, title: str = "") -> dict:
    """Write the report of ``dataset`` after ``history`` (earlier runs' statistics, oldest first) and
    ``previous`` (earlier runs' datasets, oldest first) to ``out`` (PNG); drift is measured against
    the run drawn before ``dataset``. With a history, a previous dataset is labelled as such and
    drawn only where it is not the history's last run already.

    Raises:
        DatasetError: a dataset has no (valid) manifest.
        SpecError: ``out`` is not a .png path, or the threshold is not positive.
    """
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise SpecError(f"--out {out} is not a .png file", hint="name the plot FILE.png")
    if threshold <= 0:
        raise SpecError(f"--threshold {threshold} must be positive", hint="e.g. 0.25 (the validation default)")
    runs = list(history or [])
    for path in previous or []:
        earlier = run_stats(load_manifest(path))
        if history is None:
            runs.append(earlier)
        elif not runs or runs[-1].layers != earlier.layers:  # not the history's last run already
            runs.append(RunStats(**{**earlier.__dict__, "label": f"previous {earlier.label}"}))
    current = run_stats(load_manifest(dataset))
    runs.append(current)
    drift = drift_of(runs, threshold=threshold)
    png = plot(runs, drift, threshold=threshold, title=f"{title}: last {len(runs)} runs" if title else "")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_bytes(png)
    tmp.replace(out)
    drifted = [d.layer_id for d in drift if d.drifted]
    log.info("report of %d runs written to %s%s", len(runs), out, f"; DRIFT in layers {drifted}" if drifted else "")
    return {"plot": str(out.resolve()), "runs": len(runs), "threshold": threshold, "drifted_layers": drifted,
            "layers": {str(d.layer_id): {"mean_shift_in_std": round(d.mean_shift, 6), "std_ratio": round(d.std_ratio, 6)}
                       for d in drift},
            "table": markdown_table(runs, drift, threshold=threshold), "rows": current.to_rows()}


def read_history(path: str | Path) -> list[RunStats]:
    """Earlier runs' statistics from a JSON file: a list (oldest first) of each run's per-layer rows."""
    import json

    try:
        raw = json.loads(Path(path).read_text())
        return [RunStats.from_rows(rows) for rows in raw if rows]
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise SpecError(f"--history {path} is not a list of runs' per-layer rows: {e}",
                        hint="write a JSON list, oldest run first, of RunStats.to_rows() lists") from e
