"""The statistics and the fp8 quantization of hidden states.

The per-token kernels run where the states are (on the GPU in the vLLM capture, before the copy
to the host), through a float32 workspace of ``WORK_ELEMENTS`` or, on CUDA, reading the states
directly; the per-layer records (``LayerStats``) are added up from their sums in float64.
"""

from __future__ import annotations

import torch

from datagen.data.contract import WORK_ELEMENTS, LayerStats
from datagen.data.shards.format import FP8_MAX, SCALE_TENSOR


def token_stats(states: torch.Tensor) -> torch.Tensor:
    """[T, L, 3] float32 per-token, per-layer (sum, sum of squares, absmax) over H.

    Computed where the states are (on the GPU, before the copy to the host), so the writer
    only adds up T x L numbers per shard instead of reading every value again. The float32
    values pass through a workspace of ``WORK_ELEMENTS`` (stats_into), never a float32 copy
    of the whole tensor.
    """
    t, L, h = states.shape
    out = torch.zeros((3, t, L), dtype=torch.float32, device=states.device)
    if states.numel():
        work = torch.empty((work_rows(h, t), h), dtype=torch.float32, device=states.device)
        for j in range(L):
            stats_into(states[:, j], out[:, :, j], work)
    return out.permute(1, 2, 0).contiguous()


def work_rows(hidden: int, tokens: int | None = None) -> int:
    """Tokens per chunk of the float32 workspace: WORK_ELEMENTS // hidden (at most ``tokens``)."""
    rows = max(1, WORK_ELEMENTS // max(1, hidden))
    return max(1, min(rows, tokens)) if tokens is not None else rows


def _chunks(x: torch.Tensor, work: torch.Tensor):
    """(start, end, float32 copy of x[start:end] in the workspace) over ``x`` in chunks of work's rows."""
    n, c = x.shape[0], work.shape[0]
    for a in range(0, n, c):
        b = min(n, a + c)
        w = work[: b - a]
        w.copy_(x[a:b])
        yield a, b, w


def _sums_into(w: torch.Tensor, out: torch.Tensor, a: int, b: int, s: torch.Tensor | None = None) -> None:
    """out[:, a:b] = (sum, sum of squares, absmax) of the chunk ``w`` (consumed), times the scale s."""
    out[0, a:b] = w.sum(-1) if s is None else w.sum(-1) * s
    w.abs_()
    out[2, a:b] = w.amax(-1) if s is None else w.amax(-1) * s
    w.square_()
    out[1, a:b] = w.sum(-1) if s is None else w.sum(-1) * (s * s)


def _norms_into(x: torch.Tensor, out: torch.Tensor, a: int, b: int, s: torch.Tensor | None = None) -> None:
    """_sums_into without the workspace, for CUDA tensors: the reductions read ``x`` (bf16, fp16 or
    float32) once each and accumulate in float32 without a float32 copy (PyTorch's mixed-precision
    reductions on CUDA); the sum of squares is the squared 2-norm. Three kernels per call, however
    many tokens: the GPU path of the capture (CPU tensors would be cast whole, so they go through
    the chunked workspace instead)."""
    f32 = torch.float32
    su = torch.sum(x, -1, dtype=f32)
    sq = torch.linalg.vector_norm(x, 2, -1, dtype=f32).square_()
    mx = torch.linalg.vector_norm(x, float("inf"), -1, dtype=f32)
    if s is not None:
        su.mul_(s)
        mx.mul_(s)
        sq.mul_(s * s)
    out[0, a:b] = su
    out[1, a:b] = sq
    out[2, a:b] = mx


def stats_into(x: torch.Tensor, out: torch.Tensor, work: torch.Tensor) -> None:
    """Statistics of ``x`` [n, H] into ``out`` [3, n] (sum, sum of squares, absmax), through the
    float32 workspace ``work`` [C, H] in chunks of C tokens: nothing is allocated but the sums.
    On CUDA the reductions read ``x`` directly (_norms_into): no workspace pass, no chunks."""
    if x.is_cuda:
        _norms_into(x, out, 0, x.shape[0])
        return
    for a, b, w in _chunks(x, work):
        _sums_into(w, out, a, b)


def quantize_into(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None,
                  work: torch.Tensor) -> None:
    """fp8 of ``x`` [n, H] into ``q`` [n, H] (float8_e4m3fn) with its per-token ``scale`` [n]
    (absmax / 448, 1 for an all-zero vector) and, when ``out`` [3, n] is given, the statistics of
    the stored (dequantized) values, chunked through ``work`` [C, H] as stats_into."""
    if x.is_cuda:
        _quantize_cuda(x, q, scale, out, work)
        return
    for a, b, w in _chunks(x, work):
        s = torch.linalg.vector_norm(w, float("inf"), -1)  # absmax, no |w| copy
        s = torch.where(s == 0, torch.ones_like(s), s / FP8_MAX)
        scale[a:b] = s
        w.div_(s.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
        q[a:b] = w
        if out is not None:
            w.copy_(q[a:b])
            _sums_into(w, out, a, b, s)


_FP8_OUT: dict[str, bool] = {}


def _fp8_division_stores(device: torch.device) -> bool:
    """True when a division can store float8 directly (``torch.div(..., out=fp8)``: computed in
    float32, rounded once on store, as ``.to(float8)`` rounds) on this device; probed once."""
    key = str(device)
    if key not in _FP8_OUT:
        x = torch.tensor([[1.0, -3.0, 0.3]], device=device, dtype=torch.bfloat16)
        s = torch.tensor([0.01], device=device)
        try:
            q = torch.empty((1, 3), dtype=torch.float8_e4m3fn, device=device)
            torch.div(x, s.unsqueeze(-1), out=q)
            ref = (x.float() / s.unsqueeze(-1)).to(torch.float8_e4m3fn)
            _FP8_OUT[key] = bool(torch.equal(q.view(torch.uint8), ref.view(torch.uint8)))
        except (RuntimeError, TypeError):
            _FP8_OUT[key] = False
    return _FP8_OUT[key]


def _quantize_cuda(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None,
                   work: torch.Tensor) -> None:
    """quantize_into on CUDA with few passes over memory and few kernels: the scales from one
    absmax reduction of ``x`` itself (float32 accumulation, no copy); one division of the whole
    [n, H] that stores fp8 directly (no clamp: |x / (absmax / 448)| exceeds 448 by float32 rounding
    at most, which fp8 rounds to 448); the statistics of the stored values read back through the
    workspace as bfloat16 (every fp8 value is exact in bfloat16: twice the rows per chunk of a
    float32 copy), unscaled sums per chunk, scaled once at the end. Where a division cannot store
    fp8, it goes through the float32 workspace in chunks."""
    s = torch.linalg.vector_norm(x, float("inf"), -1, dtype=torch.float32)
    s = torch.where(s == 0, 1.0, s / FP8_MAX)
    scale.copy_(s)
    n = x.shape[0]
    if _fp8_division_stores(x.device):
        torch.div(x, s.unsqueeze(-1), out=q)
    else:
        c = work.shape[0]
        for a in range(0, n, c):
            b = min(n, a + c)
            w = work[: b - a]
            torch.div(x[a:b], s[a:b].unsqueeze(-1), out=w)
            q[a:b] = w
    if out is None:
        return
    wb = work.view(-1)[: work.numel()].view(torch.bfloat16).view(-1, x.shape[1])
    c = wb.shape[0]
    for a in range(0, n, c):
        b = min(n, a + c)
        w = wb[: b - a]
        w.copy_(q[a:b])
        _norms_into(w, out, a, b)
    out[0].mul_(s)
    out[2].mul_(s)
    out[1].mul_(s * s)


def layer_stats(hidden_states: torch.Tensor, layer_ids: tuple[int, ...],
                per_token: torch.Tensor | None = None) -> list[LayerStats]:
    """Per-layer count, mean, std, absmax of a [T, L, H] tensor, with float64 sums.

    ``per_token`` ([T, L, 3] from ``token_stats``) saves the pass over the values.
    """
    t, _, h = hidden_states.shape
    if per_token is None:
        per_token = token_stats(hidden_states) if t else torch.zeros((0, len(layer_ids), 3))
    p = per_token.to(torch.float64)
    out = []
    for j, lid in enumerate(layer_ids):
        n = t * h
        if t == 0:
            out.append(stats_from_sums(lid, 0, 0.0, 0.0, 0.0))
            continue
        out.append(stats_from_sums(lid, n, float(p[:, j, 0].sum()), float(p[:, j, 1].sum()), float(p[:, j, 2].max())))
    return out


def stats_from_sums(layer_id: int, count: int, s: float, ss: float, absmax: float) -> LayerStats:
    mean = s / count if count else 0.0
    var = max(ss / count - mean * mean, 0.0) if count else 0.0
    return LayerStats(layer_id=layer_id, count=count, mean=mean, std=var**0.5, absmax=absmax, sum=s, sumsq=ss)


def combine_stats(per_shard: list[list[LayerStats]], layer_ids: tuple[int, ...]) -> list[LayerStats]:
    """Dataset statistics from shard statistics (exact: sums add)."""
    out = []
    for j, lid in enumerate(layer_ids):
        parts = [s[j] for s in per_shard if s]
        n = sum(p.count for p in parts)
        out.append(
            stats_from_sums(
                lid, n, sum(p.sum for p in parts), sum(p.sumsq for p in parts),
                max((p.absmax for p in parts), default=0.0),
            )
        )
    return out


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, L, H] states -> (float8_e4m3fn [n, L, H], float32 scale [n, L]), on x's device.

    A vector holding NaN or Inf gets a non-finite scale, so it dequantizes to NaN and
    validation still finds it. Chunked through a float32 workspace (quantize_into).
    """
    n, L, h = x.shape
    q = torch.empty((n, L, h), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.ones((n, L), dtype=torch.float32, device=x.device)
    if x.numel():
        work = torch.empty((work_rows(h, n), h), dtype=torch.float32, device=x.device)
        for j in range(L):
            quantize_into(x[:, j], q[:, j], scale[:, j], None, work)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [n, L, H] values of stored fp8 states and their [n, L] scales."""
    return q.float().mul_(scale.float().unsqueeze(-1))


def fp8_token_stats(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """token_stats of the dequantized values without materializing them: s*sum, s^2*sumsq, s*absmax."""
    st = token_stats(q)
    if not st.numel():
        return st
    s = scale.float()
    return torch.stack([st[..., 0] * s, st[..., 1] * (s * s), st[..., 2] * s], dim=-1)


def stored_states(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """hidden_states of a loaded shard as stored values: fp8 shards are dequantized (float32)."""
    hs = tensors["hidden_states"]
    if hs.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(hs, tensors[SCALE_TENSOR])
    return hs
