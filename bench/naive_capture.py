"""The naive capture that figure 1 compares against: states shipped through the RPC pipe.

``NaiveCaptureExtension`` is datagen's worker extension plus one method. The datagen path is
untouched (the benchmark's datagen rows run through it); the naive path asks the worker for
each request's states after ``generate``, copies them per request, returns the tensors through
``collective_rpc`` (serialized to the engine core and on to the driver) and writes the shard in
the driver, synchronously. That is the design DESIGN.md warns against ("shipping every tensor
through the RPC pipe will not scale"), measured here at 1.16x on a ~100M model before datagen's
engine was built.

vLLM imports this module in its worker process when it resolves ``worker_extension_cls``
(the bench runs from the project's root, so ``bench`` is importable there).
"""

from __future__ import annotations

import torch

from datagen.engines.vllm_worker import CaptureExtension

EXTENSION = "bench.naive_capture.NaiveCaptureExtension"


class NaiveCaptureExtension(CaptureExtension):
    def bench_naive_take(self, request_ids: list[str]) -> list[tuple[list[int], bytes]] | None:
        """Each request's [T, L, H] states as (shape, raw bytes), one copy per request (rank 0;
        None elsewhere). Bytes, because vLLM's utility results carry no type information unless
        VLLM_ALLOW_INSECURE_SERIALIZATION is set, so a returned tensor would not be rebuilt."""
        capture = self._datagen()
        if capture is None:
            return None
        out = []
        for ext in request_ids:  # requests of no announced shard: the capture keeps them apart
            t = torch.cat([c.host for c in capture.take_loose(ext)], dim=0).contiguous()
            out.append((list(t.shape), t.view(torch.uint8).numpy().tobytes()))
        return out


def from_wire(item: tuple[list[int], bytes], dtype: torch.dtype) -> torch.Tensor:
    """The driver's side of ``bench_naive_take``: one request's tensor."""
    shape, data = item
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
