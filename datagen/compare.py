"""Comparing hidden states from two engines, per token and per layer.

The measure is the relative L2 error of each token's state vector:
``|a - b| / |b|``. bf16 rounding gives about 0.5-2% on the tiny test models;
a state of the neighbouring layer, of another token or after the final norm is
40-130% away, so a threshold of a few percent separates right from wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Per-token relative error allowed between two bf16 engines (worst token / median token).
MAX_TOKEN_REL_ERR = 0.06
MEDIAN_TOKEN_REL_ERR = 0.02


@dataclass(frozen=True)
class LayerComparison:
    layer: int  # position on the L axis
    max_rel: float  # worst token's relative error
    median_rel: float  # median token's relative error

    @property
    def ok(self) -> bool:
        return self.max_rel <= MAX_TOKEN_REL_ERR and self.median_rel <= MEDIAN_TOKEN_REL_ERR


def token_rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T] relative L2 error of a against reference b, both [T, H]."""
    a, b = a.float(), b.float()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)


def compare_states(got: torch.Tensor, ref: torch.Tensor) -> list[LayerComparison]:
    """Compare [T, L, H] states layer by layer. Shapes must match."""
    if got.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(got.shape)} vs {tuple(ref.shape)}")
    out = []
    for j in range(got.shape[1]):
        e = token_rel_err(got[:, j], ref[:, j])
        out.append(LayerComparison(j, float(e.max()) if e.numel() else 0.0, float(e.median()) if e.numel() else 0.0))
    return out


def states_match(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return all(c.ok for c in compare_states(got, ref))
