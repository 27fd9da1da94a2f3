"""Reusable, page-aligned I/O buffers.

Fresh memory costs page faults on first touch (0.7 - 2.3 GB/s here, against 3.5 - 7 GB/s
for a copy into memory already mapped), and O_DIRECT needs aligned buffers: both are
reasons to keep a few buffers and reuse them. Buffers are anonymous ``mmap`` regions
(page-aligned). The pool keeps at most ``max_free`` idle buffers and ``max_free_bytes``
idle bytes; it never limits how many are in use, the callers' own bounds (thread pools,
batch sizes) do.
"""

from __future__ import annotations

import mmap
import os
import threading

ALIGN = 4096  # O_DIRECT alignment for offsets, lengths and addresses


def round_up(n: int, multiple: int = ALIGN) -> int:
    return -(-n // multiple) * multiple


class BufferPool:
    def __init__(self, max_free: int = 8, granularity: int = 64 * 1024, max_free_bytes: int = 1 << 62) -> None:
        self.max_free = max_free
        self.max_free_bytes = max_free_bytes
        self._free_bytes = 0
        self.granularity = granularity
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []
        self.outstanding = 0  # buffers handed out and not yet released (for leak checks)

    def acquire(self, nbytes: int) -> mmap.mmap:
        """A buffer of at least ``nbytes`` (page-aligned, contents undefined)."""
        want = round_up(max(nbytes, 1), self.granularity)
        with self._lock:
            if self._pid != os.getpid():  # a forked child starts with no buffers
                self._pid, self._free, self._free_bytes, self.outstanding = os.getpid(), [], 0, 0
            self.outstanding += 1
            for i, buf in enumerate(self._free):
                if want <= len(buf) <= 2 * want:
                    self._free_bytes -= len(buf)
                    return self._free.pop(i)
        return mmap.mmap(-1, want)

    def release(self, buf: mmap.mmap) -> None:
        with self._lock:
            if self._pid == os.getpid():
                self.outstanding -= 1
            if (
                self._pid == os.getpid()
                and len(self._free) < self.max_free
                and self._free_bytes + len(buf) <= self.max_free_bytes
            ):
                self._free.append(buf)
                self._free_bytes += len(buf)
