"""Whether a file's bytes are in the page cache, asked without reading them.

    resident(fd, offset, length) -> bool | None   None: this kernel cannot say
    write_back(fd, offset, length)                start writing dirty pages out, now

The disk tier reads what the page cache holds through it (a copy out of memory, several
times faster than the disk) and the rest with O_DIRECT (no second copy in the cache, no
room taken from it). It asks about three pages of a run (its first, middle and last): a
run was written or read as one, and the cache drops it as one, from its oldest pages; a
page guessed wrong only costs the slower of the two reads, never a wrong byte.

``cachestat(2)`` (Linux 6.5+) answers for a range of a file descriptor in one system call
(0.7 us per page asked here); older kernels answer through ``mincore(2)`` on a one-page
mapping (which reports pages only to processes that may write the file: ours do). A
``preadv2(RWF_NOWAIT)`` probe would not do: on a miss it starts readahead of the whole
range into the cache, which the O_DIRECT read would then duplicate.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import platform

_SYS_CACHESTAT = {"x86_64": 451, "aarch64": 451}.get(platform.machine())  # one number since the tables merged
_PAGE = mmap.PAGESIZE


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return libc


_LIBC = _libc()
_use_cachestat = _SYS_CACHESTAT is not None


def resident(fd: int, offset: int, length: int) -> bool | None:
    """Whether the first, middle and last pages of ``length`` bytes at ``offset`` (a
    multiple of the page size) are in the page cache; None when the kernel cannot say."""
    last = (offset + max(length, 1) - 1) // _PAGE * _PAGE
    pages = {offset, (offset + last) // 2 // _PAGE * _PAGE, last}
    answers = [_page_cached(fd, page) for page in pages]
    return None if None in answers else all(answers)


def _page_cached(fd: int, offset: int) -> bool | None:
    global _use_cachestat
    if _use_cachestat:
        rng, stat = _Range(offset, _PAGE), _Stat()
        if _LIBC.syscall(_SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(stat), 0) == 0:
            return stat.cache > 0
        if ctypes.get_errno() not in (38, 1):  # ENOSYS, EPERM (seccomp): fall back for good
            return None
        _use_cachestat = False
    return _mincore(fd, offset)


def _mincore(fd: int, offset: int) -> bool | None:
    addr = _LIBC.mmap(None, _PAGE, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        vec = ctypes.c_ubyte()
        if _LIBC.mincore(addr, _PAGE, ctypes.byref(vec)) != 0:
            return None
        return bool(vec.value & 1)
    finally:
        _LIBC.munmap(addr, _PAGE)


SYNC_FILE_RANGE_WRITE = 2


def write_back(fd: int, offset: int, length: int) -> None:
    """Start writing back the dirty pages of a range, without waiting for them: a batch
    appended through the page cache goes to the disk while the next one is copied in,
    instead of all at the next sync (or when the kernel's dirty limit stalls a writer),
    and what a writer leaves dirty stays bounded. The pages stay cached."""
    _LIBC.sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE)  # best effort: errors show at fsync
