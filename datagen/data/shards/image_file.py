"""A file image's temporary file: written in order from the image's memory, hashed from the same
memory while it is written, fsynced once (``ShardImage`` streams and finishes through it)."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import threading
from pathlib import Path

ALIGN = 4096  # direct I/O: buffer address, length and file offset aligned to this
WRITE_PIECE = 64 << 20  # bytes per write call (and per hash update)


def _open_tmp(tmp: Path, direct: bool) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(tmp, flags | os.O_DIRECT, 0o644), True
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    return os.open(tmp, flags, 0o644), False


class ImageFile:
    """A file image's temporary file, written in order from the image's memory and hashed
    (sha256) from the same memory by a thread of its own while each write runs (never read back
    from the file).

    Direct I/O (O_DIRECT) where the filesystem takes it: the pages go from the image to the
    device, not through the page cache. Every write but the last ends on the alignment; the
    last is padded to it and the file truncated to its size. Filesystems without it (tmpfs,
    some network ones) get buffered writes. One thread at a time.
    """

    def __init__(self, tmp: Path, buf: mmap.mmap, *, direct: bool = True):
        self.tmp, self.buf = tmp, buf
        self.fd, self.direct = _open_tmp(tmp, direct)
        self.pos = 0  # bytes written and hashed
        self._h = hashlib.sha256()
        self._mv = memoryview(buf)

    def write(self, end: int, *, final: bool = False) -> None:
        """Write and hash bytes [pos, end). ``end`` is on the alignment unless ``final`` (the file's
        size: padded, then truncated to it)."""
        start, mv = self.pos, self._mv
        if end <= start:
            return

        def hash_range() -> None:  # alongside the writes: both release the GIL, so they overlap
            for a in range(start, end, WRITE_PIECE):
                self._h.update(mv[a:min(end, a + WRITE_PIECE)])

        before = self._h.copy()  # a write that fails leaves the hash where it was: the range is redone
        hasher = threading.Thread(target=hash_range, name="datagen-shard-hash", daemon=True)
        hasher.start()
        ok = False
        try:
            pos = start
            while pos < end:
                stop = min(end, pos + WRITE_PIECE)
                wend = -(-stop // ALIGN) * ALIGN if self.direct else stop
                if wend > stop:
                    self.buf[stop:wend] = bytes(wend - stop)  # zero the padding of a reused image
                while pos < wend:
                    try:
                        n = os.pwrite(self.fd, mv[pos:wend], pos)  # at its place: a failed write is redone there
                    except OSError as e:
                        if not self.direct or e.errno != errno.EINVAL or pos != 0:
                            raise
                        # the filesystem accepted O_DIRECT at open but not this alignment: start over buffered
                        os.close(self.fd)
                        self.fd, self.direct = _open_tmp(self.tmp, False)
                        wend = stop
                        continue
                    pos += n
                pos = stop
            ok = True
        finally:
            hasher.join()
            if not ok:
                self._h = before
        self.pos = end
        if final and self.direct and end % ALIGN:
            os.ftruncate(self.fd, end)

    def close(self) -> str:
        """Readable by others whatever the umask, fsynced once, closed; the sha256 of what was written."""
        try:
            os.fchmod(self.fd, 0o644)
            os.fsync(self.fd)
        finally:
            self._release()
        return self._h.hexdigest()

    def discard(self) -> None:
        """Close and remove the temporary file (idempotent)."""
        self._release()
        self.tmp.unlink(missing_ok=True)

    def _release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self._mv.release()
