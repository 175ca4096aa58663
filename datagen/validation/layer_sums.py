"""Per-layer statistics of a shard's hidden states, recomputed from the values by validation.

``LayerSums`` adds up each (token, layer) vector in float32 while the scan reads the file
(``datagen.validation.scan``), then per layer in float64; the result is compared with the
statistics the writer recorded.
"""

from __future__ import annotations

import math

import torch

from datagen.data.contract import LayerStats
from datagen.data.shards.kernels import stats_from_sums

# Float32 work buffer per reduction step (bytes): stays in the CPU cache.
_STEP_BYTES = 2 << 20


class LayerSums:
    """Per-layer sum, sum of squares, min and max of a shard's [T, L, H] hidden states.

    Each (token, layer) vector is reduced in float32 into preallocated [T*L] result
    arrays (``add``, a few ops per block with ``out=``: no allocation, little Python per
    byte, so worker threads scale); ``finish`` then adds them up per layer in float64. A
    NaN or Inf makes its vector's max or min non-finite: only such vectors, and finite
    ones whose float32 sums overflowed, are read again, element by element.
    """

    def __init__(self, n_tokens: int, n_layers: int, hidden: int, scale: torch.Tensor | None = None):
        self.T, self.L, self.H = n_tokens, n_layers, hidden
        self.scale = None if scale is None else scale.reshape(-1, 1)  # [T*L, 1]: fp8 values times it
        self.step = max(1, _STEP_BYTES // max(1, 4 * n_layers * hidden))  # tokens per reduction
        self.buf = torch.empty(self.step * n_layers, hidden, dtype=torch.float32)
        rows = n_tokens * n_layers
        self.s, self.ss, self.mx, self.mn = (torch.empty(rows, dtype=torch.float32) for _ in range(4))
        self.bad: dict[int, list[int]] = {}  # layer index j -> tokens with non-finite values
        self.bad_layers: set[int] = set()

    def add(self, x: torch.Tensor, first_token: int) -> None:
        """Reduce tokens [first_token, first_token + len(x)) given as an [n, L, H] tensor."""
        L, H = self.L, self.H
        for a in range(0, x.shape[0], self.step):
            xs = x[a:a + self.step]
            m = xs.shape[0]
            buf = self.buf[: m * L]
            buf.copy_(xs.reshape(m * L, H))
            r0 = (first_token + a) * L
            r1 = r0 + m * L
            if self.scale is not None:
                buf.mul_(self.scale[r0:r1])
            torch.sum(buf, -1, out=self.s[r0:r1])
            torch.linalg.vecdot(buf, buf, out=self.ss[r0:r1])
            torch.amax(buf, -1, out=self.mx[r0:r1])
            torch.amin(buf, -1, out=self.mn[r0:r1])

    def finish(self, fetch) -> None:
        """Redo, in float64 over finite values, the vectors whose float32 results are not finite.

        ``fetch(token)`` returns that token's [L, H] states.
        """
        L = self.L
        bad = ~(torch.isfinite(self.s) & torch.isfinite(self.ss) & torch.isfinite(self.mx) & torch.isfinite(self.mn))
        self.count = torch.full((self.T, L), self.H, dtype=torch.int64)
        self.s, self.ss = self.s.double(), self.ss.double()
        self.mx, self.mn = self.mx.double(), self.mn.double()
        for i in torch.nonzero(bad).flatten().tolist():
            t, j = i // L, i % L
            v = fetch(t)[j].double()
            if self.scale is not None:
                v = v * float(self.scale[i])
            ok = torch.isfinite(v)
            if not bool(ok.all()):
                self.bad.setdefault(j, []).append(t)
                self.bad_layers.add(j)
                v = v[ok]
                self.count[t, j] = v.numel()
            self.s[i], self.ss[i] = float(v.sum()), float((v * v).sum())
            self.mx[i] = float(v.max()) if v.numel() else -math.inf
            self.mn[i] = float(v.min()) if v.numel() else math.inf

    def stats(self, layer_ids: tuple[int, ...]) -> list[LayerStats]:
        L = self.L
        s = self.s.view(-1, L).sum(0)
        ss = self.ss.view(-1, L).sum(0)
        mx = self.mx.view(-1, L).amax(0) if self.T else torch.full((L,), -math.inf)
        mn = self.mn.view(-1, L).amin(0) if self.T else torch.full((L,), math.inf)
        count = self.count.sum(0)
        out = []
        for j, lid in enumerate(layer_ids):
            n = int(count[j])
            absmax = max(float(mx[j]), -float(mn[j])) if n else 0.0
            out.append(stats_from_sums(lid, n, float(s[j]), float(ss[j]), absmax))
        return out
