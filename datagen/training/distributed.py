"""Data-parallel training across the processes ``torchrun`` starts: speculators' topology, GPU and CPU.

``torchrun --nproc-per-node N -m datagen train ...`` trains ONE draft on N processes, as
``torchrun ... speculators train`` does: speculators' ``Trainer`` wraps the draft in DDP (rank 0's
initial weights broadcast to every rank) when its topology module says the run is distributed, and
its multipack sampler (``_setup_dataloader``) gives each rank its own share of every packed batch
by ``get_dp_rank()`` / ``get_dp_size()``, read when the loader is built. So the topology must be set
before the loader exists, and that is all this module does.

On CUDA it is speculators' own ``maybe_setup_distributed()`` (NCCL, one GPU per local rank). On the
CPU speculators refuses ("No accelerator found"), so the same state is filled here the way that
function fills it: ``torch.distributed`` initialised with gloo from torchrun's environment, then
speculators' ``_init_sp_process_groups`` (sequence-parallel size 1: one data-parallel group of all
ranks) and its module-level ``_rank``, ``_world_size``, ``_is_distributed``. This is the one reach
into speculators' private state; it was read from speculators 0.9.0
(``speculators/train/distributed.py``), and ``tests/training/test_distributed.py`` pins the names it
sets. ``maybe_destroy_distributed()`` (speculators' own) takes both apart at the end.

A process not started by torchrun (torch's ``is_torchelastic_launched()``) trains alone: world size 1,
nothing initialised.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from datagen.errors import CannotRunHereError
from datagen.training.settings import Device

log = logging.getLogger(__name__)

# speculators' topology module state that the CPU path sets (speculators 0.9.0)
SPECULATORS_STATE = ("_rank", "_world_size", "_is_distributed", "_init_sp_process_groups")


@dataclass(frozen=True)
class Topology:
    """Where this process stands in the training run."""

    rank: int  # this process's global rank; rank 0 writes the draft
    world_size: int  # data-parallel training processes (1: not launched by torchrun)
    device: Device  # where every rank trains

    @property
    def writes(self) -> bool:
        """Rank 0 writes the draft directory; the others wait for it (``barrier``)."""
        return self.rank == 0

    def barrier(self) -> None:
        """Every rank waits here for the others (nothing to wait for in a run of one)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def sum(self, value: int) -> int:
        """``value`` summed over the ranks (itself in a run of one)."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64,
                         device=torch.device("cuda", torch.cuda.current_device()) if self.device is Device.CUDA else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return int(t.item())


def check_device(device: Device) -> None:
    """The draft can train on ``device`` here (checked before a model is built).

    Raises:
        CannotRunHereError: ``cuda`` on a machine where torch sees no CUDA device.
    """
    if device is Device.CUDA and not torch.cuda.is_available():
        raise CannotRunHereError(f"--device cuda, but torch {torch.__version__} sees no CUDA device here",
                                 hint="run on a GPU host, or pass --device cpu")


@contextlib.contextmanager
def data_parallel(device: Device) -> Iterator[Topology]:
    """This process's place in the run, with speculators' topology set for its duration.

    Raises:
        CannotRunHereError: no CUDA device for ``cuda``, or torchrun started more processes on this
            node than it has GPUs (or the process group could not be formed).
    """
    check_device(device)
    from torch.distributed import is_torchelastic_launched

    if not is_torchelastic_launched():
        yield Topology(rank=0, world_size=1, device=device)
        return
    import torch.distributed as dist
    from speculators.train import distributed as spec_dist

    try:
        if device is Device.CUDA:
            spec_dist.maybe_setup_distributed()
        else:
            _setup_cpu(spec_dist)
    except (RuntimeError, ValueError) as e:
        if dist.is_initialized():
            spec_dist.maybe_destroy_distributed()
        raise CannotRunHereError(
            f"cannot form the {device.value} training process group: {type(e).__name__}: {e}",
            hint="launch with torchrun --nproc-per-node at most the GPUs of the node (--device cuda), "
                 "or --device cpu") from e
    topology = Topology(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)
    log.info("training rank %d of %d (%s, %s)", topology.rank, topology.world_size, device.value, dist.get_backend())
    try:
        dist.barrier()  # every rank passed its checks before any writes
        yield topology
    finally:
        spec_dist.maybe_destroy_distributed()


def _setup_cpu(spec_dist) -> None:
    """What ``maybe_setup_distributed()`` does, with gloo and no device: torchrun's environment
    (``MASTER_ADDR``, ``RANK``, ``WORLD_SIZE``...) read by ``init_process_group`` itself. On the CPU
    speculators' ``local_rank`` (its device index) stays 0: datagen's Trainer puts the draft on "cpu"."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec_dist._rank, spec_dist._world_size, spec_dist._is_distributed = rank, world, True
    spec_dist._init_sp_process_groups(rank, world, 1)
