"""The vLLM engine's steps written to a file when a run's rows are done (DATAGEN_STEP_TRACE), for
profiles: where a run's time goes step by step, its start above all (``bench/gpu/run.py --trace``).
"""

from __future__ import annotations

import time
from pathlib import Path

from datagen.data.files import atomic_write_json


def dump(llm, path: Path) -> int:
    """Rank 0's steps since the last call (``CaptureExtension.datagen_step_trace``; the worker keeps
    the last 65,536) to ``path`` as JSON, their times moved onto the wall clock (the engine's
    processes time them with ``perf_counter``, the machine's one monotonic clock); returns how many
    were written (0 on the public capture path, which has no internal capture to ask)."""
    steps = next((r for r in llm.collective_rpc("datagen_step_trace") if r is not None), None)
    if steps is None:
        return 0
    wall = time.time() - time.perf_counter()
    rows = [{"start": t0 + wall, "end": t1 + wall, "tokens": n, "captured": t2 + wall,
             "forward_gpu_ms": fwd, "capture_gpu_ms": cap} for t0, t1, n, t2, fwd, cap in steps]
    atomic_write_json(path, {"clock": "seconds since the epoch", "steps": rows})
    return len(rows)
