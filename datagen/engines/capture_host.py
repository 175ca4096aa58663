"""The capture's pinned host memory: one buffer of the rank's host budget, pinned once when the
engine starts, handed out to the steps' device-to-host copies as a ring (``HostArena``), each
step's piece held by the requests it holds until their shards are written (``HostBlock``).
"""

from __future__ import annotations

import collections
import threading
import time
import weakref

import torch


class HostBlock:
    """One step's pinned host copy, shared by the requests it holds; its piece of the arena is
    held until the packer has moved the last of those requests' pieces into its shard's image."""

    __slots__ = ("arena", "region", "refs", "lock")

    def __init__(self, arena: "HostArena", region: list | None, refs: int):
        self.arena, self.region, self.refs = arena, region, refs
        self.lock = threading.Lock()

    def release(self) -> None:
        with self.lock:
            self.refs -= 1
            last = self.refs == 0
        if last and self.region is not None:
            self.arena.free(self.region)


def _unpin(buf: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


class HostArena:
    """The pinned host memory of the steps' copies: one buffer of the rank's host budget, pinned
    once when the engine starts (pinning per step cost a run's first groups seconds of the
    worker's time, until PyTorch's pinned cache held enough blocks), handed out as a ring.

    Steps take pieces in order and the packer frees them in that order (a piece is reused once it
    and every older piece are free). A step waits (backpressure) while the ring is full and the
    packer has pieces to free; when it has none, the step's copy goes outside the ring (PyTorch's
    pinned allocator) so the run goes on over the budget rather than stalls."""

    ALIGN = 4096  # every piece starts on a page: views of any dtype stay aligned

    def __init__(self, nbytes: int, pin: bool):
        self.capacity, self.pin = nbytes, pin
        self.buf = torch.empty(nbytes, dtype=torch.uint8) if nbytes else None
        if pin and nbytes:
            # registered, not pin_memory=True: PyTorch's pinned allocator rounds every block up
            # to a power of two (a 12 GiB budget would pin 16 GiB)
            err = int(torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), nbytes, 0))
            if err:
                raise RuntimeError(f"pinning the capture's {nbytes / (1 << 30):.1f} GiB of host memory failed "
                                   f"(cudaError {err}); lower DATAGEN_CAPTURE_HOST_GIB")
            weakref.finalize(self, _unpin, self.buf)
        self.head = 0  # end of the newest piece
        self.live: collections.deque = collections.deque()  # [start, end, freed], oldest first
        self.cond = threading.Condition()
        self.outside_bytes = 0  # copies that did not fit (over the budget), for profiles

    @classmethod
    def size(cls, n: int) -> int:
        return -(-n // cls.ALIGN) * cls.ALIGN

    def _fit(self, n: int) -> int | None:
        if not self.live:
            self.head = 0
            return 0 if n <= self.capacity else None
        tail = self.live[0][0]
        if self.head > tail:  # in use: [tail, head)
            if self.head + n <= self.capacity:
                return self.head
            return 0 if n <= tail else None
        return self.head if self.head + n <= tail else None  # wrapped: in use [tail, end) and [0, head)

    def take(self, like: list[torch.Tensor | None], pending) -> tuple[list | None, list, float]:
        """Host tensors shaped as the device tensors ``like`` (None stays None): views of one piece
        of the ring, or, when none is to be had, tensors of PyTorch's pinned allocator (the
        piece is then None). Also the seconds waited for the writers."""
        sizes = [self.size(t.numel() * t.element_size()) if t is not None else 0 for t in like]
        n = sum(sizes)
        t0 = time.perf_counter()
        with self.cond:
            while True:
                off = self._fit(n)
                if off is not None:
                    region = [off, off + n, False]
                    self.live.append(region)
                    self.head = off + n
                    break
                if not self.live or not pending():  # nothing held would free it, or no write is on the way
                    self.outside_bytes += n
                    region = None
                    break
                self.cond.wait(0.05)
        waited = time.perf_counter() - t0
        out, at = [], 0
        for t, size in zip(like, sizes):
            if t is None:
                out.append(None)
            elif region is None:
                out.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin))
            else:
                start = region[0] + at
                out.append(self.buf[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
            at += size
        return region, out, waited

    def free(self, region: list) -> None:
        with self.cond:
            region[2] = True
            while self.live and self.live[0][2]:
                self.live.popleft()
            self.cond.notify_all()
