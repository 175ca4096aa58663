"""The worker's tensor-parallel rank, as vLLM's distributed state has it (worker processes only)."""

from __future__ import annotations


def tp_rank() -> tuple[int, int]:
    """(rank, world size) of this worker's tensor-parallel group; pipeline parallelism is refused."""
    from vllm.distributed import parallel_state as ps

    try:
        if ps.get_pp_group().world_size != 1:
            raise RuntimeError("the capture does not support pipeline parallelism")
        return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    except (AssertionError, AttributeError):  # no distributed state (a single process)
        return 0, 1
