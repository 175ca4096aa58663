"""A draft's measurements night after night: the record kept per night, the plot, the drop check.

Each night's measurement becomes a ``NightMeasurement`` (one row per speculated position in the
table the orchestration stores); the plot shows agreement per position and the acceptance length
over the last nights; ``drop_of`` compares tonight with the night before: a relative fall of the
acceptance length beyond the threshold fails the night, naming the dataset.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

# a 5% fall of the acceptance length against the night before fails. By vLLM's own acceptance on the GPU (SmolLM2,
# 2,000 steps, 3 seeds, both recipes; docs/performance.md 10h) right datasets' drafts spread by 1.6-2.5% between
# seeds and a grossly wrong layer set fell 37-40%; an off-by-one layer set fell 1.0-2.5%, inside the seeds' spread,
# so feature_error catches it, not this. The implied figure (10c) gave the same: seeds within 2.3%, gross 40-44%.
DEFAULT_DROP_THRESHOLD = 0.05


@dataclass(frozen=True)
class NightMeasurement:
    """One night's draft measured on its dataset's held-out rows."""

    label: str  # what the plot's axis says (the dataset's name or the run's date)
    dataset: str  # the dataset the draft was trained and measured on
    fingerprint: str  # its manifest fingerprint
    agreement: tuple[float, ...]  # positions 1..k
    acceptance_length: float  # implied by the agreement
    spec_decode_acceptance: float | None  # vLLM's, where it ran

    def to_rows(self) -> list[dict]:
        return [{"label": self.label, "dataset": self.dataset, "fingerprint": self.fingerprint, "position": j + 1,
                 "agreement": a, "acceptance_length": self.acceptance_length,
                 "spec_decode_acceptance": self.spec_decode_acceptance} for j, a in enumerate(self.agreement)]

    @classmethod
    def from_rows(cls, rows: list[dict]) -> NightMeasurement:
        rows = sorted(rows, key=lambda r: int(r["position"]))
        first = rows[0]
        sd = first.get("spec_decode_acceptance")
        return cls(label=str(first["label"]), dataset=str(first["dataset"]), fingerprint=str(first["fingerprint"]),
                   agreement=tuple(float(r["agreement"]) for r in rows),
                   acceptance_length=float(first["acceptance_length"]),
                   spec_decode_acceptance=None if sd in (None, "", "None") else float(sd))


@dataclass(frozen=True)
class Drop:
    """Tonight's acceptance length against the night before."""

    previous: float
    current: float
    threshold: float

    @property
    def fall(self) -> float:
        """Relative fall (positive: worse)."""
        return (self.previous - self.current) / self.previous if self.previous > 0 else 0.0

    @property
    def failed(self) -> bool:
        return self.fall > self.threshold


def drop_of(nights: list[NightMeasurement], *, threshold: float = DEFAULT_DROP_THRESHOLD) -> Drop | None:
    """The last night against the one before it; None for a first night."""
    if len(nights) < 2:
        return None
    return Drop(previous=nights[-2].acceptance_length, current=nights[-1].acceptance_length, threshold=threshold)


def markdown_table(nights: list[NightMeasurement], drop: Drop | None) -> str:
    k = max(len(n.agreement) for n in nights)
    head = "| night | dataset | " + " | ".join(f"agreement {j + 1}" for j in range(k)) + \
        " | acceptance length (implied) | acceptance length (vLLM) |"
    lines = [head, "|" + " --- |" * (k + 4)]
    for n in nights:
        sd = f"{n.spec_decode_acceptance:.3f}" if n.spec_decode_acceptance is not None else "-"
        lines.append(f"| {n.label} | {n.fingerprint[:12]} | " + " | ".join(f"{a:.3f}" for a in n.agreement) +
                     f" | {n.acceptance_length:.3f} | {sd} |")
    if drop is not None:
        lines += ["", f"acceptance length {drop.previous:.3f} -> {drop.current:.3f} ({-drop.fall:+.1%}; "
                      f"fails beyond -{drop.threshold:.0%}): {'DROP' if drop.failed else 'ok'}"]
    return "\n".join(lines)


def plot(nights: list[NightMeasurement], drop: Drop | None, *, title: str = "") -> bytes:
    """PNG: agreement per position over the nights (a line per position), and the acceptance length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(nights)))
    labels = [n.label for n in nights]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    k = max(len(n.agreement) for n in nights)
    for j in range(k):
        a1.plot(x, [n.agreement[j] if j < len(n.agreement) else float("nan") for n in nights], marker="o",
                label=f"position {j + 1}")
    a1.set_title("top-1 agreement with the target's greedy tokens")
    a1.set_ylim(0, 1)
    a1.legend(fontsize=8)
    bad = drop is not None and drop.failed
    a2.plot(x, [n.acceptance_length for n in nights], marker="o", color="red" if bad else "tab:blue",
            label="implied by agreement")
    sd = [n.spec_decode_acceptance if n.spec_decode_acceptance is not None else float("nan") for n in nights]
    if any(v == v for v in sd):
        a2.plot(x, sd, marker="s", color="tab:green", label="vLLM EAGLE-3")
    a2.set_title("acceptance length (tokens per target step)")
    a2.legend(fontsize=8)
    for ax in (a1, a2):
        ax.set_xticks(x, labels, fontsize=7, rotation=40, ha="right")
        ax.grid(alpha=0.3)
    head = title or "draft on the held-out rows, last nights"
    if bad:
        head += f"  --  DROP {drop.fall:.0%} (threshold {drop.threshold:.0%})"
    fig.suptitle(head, color="red" if bad else "black")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()
