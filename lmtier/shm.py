"""Shared-memory segments: the same-host data plane between the grpc:// tier and the server.

    Segment(directory, size, slot_bytes)    the client's: created, locked, cut into slots
    SegmentMaps(directory)                  the server's: segments mapped by name, bounded; prune()
    sweep(directory)                        removes segments whose client died

Python gRPC moves bulk bytes at well under 1 GB/s; a memory copy runs at several GB/s.
When client and server share a host (a sidecar in the engine's pod, with an in-memory
``/dev/shm`` shared between the containers), the client creates a segment, writes the
frames it puts into slots of it and lets the server write the frames it gets into other
slots; gRPC carries only the slot references.

Ownership keeps it safe. The segment is the client's: the server maps it only while a call
runs and never hands out its own memory, so a client that dies mid-transfer strands
nothing on the server. The client holds a shared ``flock`` on its segment for as long as
it lives; ``sweep`` (run by the server now and then) removes segments nobody holds, which
is how the memory of a killed client comes back. Frames carry their checksums, so bytes
that change under a reader are a miss, never wrong KV.

Names are ``lmtier-`` and 32 random hex digits: a server opens nothing else, and nothing
outside its shared-memory directory.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path

from lmtier.errors import ConfigError, FormatError, LmtierError

log = logging.getLogger(__name__)

NAME = re.compile(r"lmtier-[0-9a-f]{32}\Z")
DEFAULT_DIR = "/dev/shm"
QUARANTINE_S = 30.0  # slots of a call that ended abnormally rest this long before reuse
GROW_STEP = 32 << 20  # a growing segment reserves this much at a time
SWEEP_MIN_AGE_S = 60.0  # a segment younger than this is never swept (it may be starting)


class SegmentUnavailable(LmtierError):
    """The named segment cannot be mapped here (another host, removed, not ours)."""


class Segment:
    """A client's segment: ``size`` bytes cut into ``slot_bytes`` slots.

    ``acquire()`` hands out a free slot (or None when all are in use); ``release(slot)``
    returns it; ``quarantine(slots)`` returns slots only after ``QUARANTINE_S``, for a call
    that ended abnormally while the server might still touch them.

    The memory is reserved before it is used (``posix_fallocate``), so that a full tmpfs
    is an error here rather than a SIGBUS in a writer later. Reserving costs about 0.1 s
    per 256 MiB here; with ``grow`` only the first ``GROW_STEP`` is reserved at once, and
    a thread of its own reserves the next step whenever fewer than half a step of slots
    are free; ``acquire`` hands out reserved slots only.
    """

    def __init__(self, directory: str, size: int, slot_bytes: int, *, grow: bool = False) -> None:
        if slot_bytes <= 0 or size < slot_bytes:
            raise ConfigError(f"a shared-memory segment of {size} bytes holds no slot of {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.num_slots = size // slot_bytes
        self.size = self.num_slots * slot_bytes
        self.name = f"lmtier-{secrets.token_hex(16)}"
        self.path = os.path.join(directory, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # "alive": sweep leaves a held segment alone
            first = min(self.num_slots, max(1, GROW_STEP // slot_bytes)) if grow else self.num_slots
            os.posix_fallocate(fd, 0, first * slot_bytes)
            os.ftruncate(fd, self.size)
            self.map = mmap.mmap(fd, self.size)
        except BaseException:
            os.close(fd)
            Path(self.path).unlink(missing_ok=True)
            raise
        self._fd = fd  # kept open: it holds the lock
        self._lock = threading.Lock()
        self._free = list(range(first - 1, -1, -1))
        self._resting: list[tuple[float, list[int]]] = []
        self._pid = os.getpid()
        self.closed = False
        self._step = max(1, GROW_STEP // slot_bytes)
        self._reserved = first
        self._wanted = threading.Condition(self._lock)
        self._grower: threading.Thread | None = None
        if first < self.num_slots:
            self._grower = threading.Thread(target=self._grow, name="lmtier-shm-reserve", daemon=True)
            self._grower.start()

    def _grow(self) -> None:
        """Reserve the rest of the segment a step at a time, as ``acquire`` runs low."""
        while True:
            with self._lock:
                self._wanted.wait_for(lambda: self.closed or len(self._free) < self._step // 2 + 1)
                if self.closed:
                    return
                start = self._reserved
            upto = min(self.num_slots, start + self._step)
            try:
                os.posix_fallocate(self._fd, start * self.slot_bytes, (upto - start) * self.slot_bytes)
            except OSError as exc:
                log.warning("shared-memory segment %s: %d of %d slots usable (%s)", self.name, start,
                            self.num_slots, exc.strerror)  # fmt: skip
                return
            with self._lock:
                self._free[:0] = range(upto - 1, start - 1, -1)  # taken after the ones there
                self._reserved = upto
                if upto == self.num_slots:
                    return

    def view(self, slot: int) -> memoryview:
        start = slot * self.slot_bytes
        return memoryview(self.map)[start : start + self.slot_bytes]

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def acquire(self) -> int | None:
        with self._lock:
            if self._resting and self._resting[0][0] <= time.monotonic():
                self._free.extend(self._resting.pop(0)[1])
            slot = self._free.pop() if self._free and not self.closed else None
            if self._grower is not None and len(self._free) <= self._step // 2:
                self._wanted.notify()
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def quarantine(self, slots: list[int]) -> None:
        if slots:
            with self._lock:
                self._resting.append((time.monotonic() + QUARANTINE_S, list(slots)))

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def close(self) -> None:
        """Remove the segment. Chunks still viewing it keep their memory until released."""
        if self.closed or self._pid != os.getpid():
            return
        with self._lock:
            self.closed = True
            self._wanted.notify()
        if self._grower is not None:
            self._grower.join()  # its fallocate must not reach a descriptor number reused after close
        Path(self.path).unlink(missing_ok=True)
        os.close(self._fd)


class SegmentMaps:
    """Other processes' segments, mapped by name on first use: the server maps its clients'
    (read-write), a client maps its server's memory (``writable=False``). At most
    ``limit`` at a time (least recently used unmapped first), re-checked on each use so a
    removed or replaced segment is never used."""

    def __init__(self, directory: str = DEFAULT_DIR, limit: int = 64, writable: bool = True) -> None:
        self.directory = directory
        self.limit = limit
        self.writable = writable
        self._maps: OrderedDict[str, tuple[mmap.mmap, int, int]] = OrderedDict()  # name -> (map, inode, size)
        self._lock = threading.Lock()

    def region(self, name: str, offset: int, length: int | None) -> memoryview:
        """A view of ``length`` bytes at ``offset`` of segment ``name`` (``None``: to its end)."""
        if not NAME.match(name):
            raise FormatError(f"{name!r} is not an lmtier shared-memory segment name")
        path = os.path.join(self.directory, name)
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError as exc:
            self._forget(name)
            raise SegmentUnavailable(f"shared-memory segment {name} is not here: {exc.strerror}") from exc
        if not stat.S_ISREG(st.st_mode):
            raise SegmentUnavailable(f"{path} is not a regular file")
        with self._lock:
            held = self._maps.get(name)
            if held is not None and (held[1] != st.st_ino or held[2] != st.st_size):
                self._maps.pop(name)
                held = None
            if held is None:
                held = self._map(path, self.writable)
                self._maps[name] = held
                while len(self._maps) > self.limit:
                    self._maps.popitem(last=False)  # unmapped once no view remains
            self._maps.move_to_end(name)
        segment, _, size = held
        if length is None:
            length = size - offset
        if offset + length > size:
            raise FormatError(f"region [{offset}, {offset + length}) lies outside segment {name} of {size} bytes")
        return memoryview(segment)[offset : offset + length]

    @staticmethod
    def _map(path: str, writable: bool) -> tuple[mmap.mmap, int, int]:
        """Map the file at ``path``, checked on the descriptor actually mapped: a regular
        file (never a symlink, never a FIFO to block on) with no other name (a hard link
        would let a request reach a file outside the segment directory)."""
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise SegmentUnavailable(f"cannot open shared-memory segment {path}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SegmentUnavailable(f"{path} is not a regular file")
            if st.st_nlink != 1:
                raise SegmentUnavailable(f"{path} has {st.st_nlink} names: not a segment a client made")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            return mmap.mmap(fd, st.st_size, prot=prot), st.st_ino, st.st_size
        except (OSError, ValueError) as exc:
            raise SegmentUnavailable(f"cannot map shared-memory segment {path}: {exc}") from exc
        finally:
            os.close(fd)

    def prune(self) -> int:
        """Unmap the segments that are gone (swept, or their client removed them), so that
        their memory comes back at once rather than when newer ones push them out; returns
        how many."""
        with self._lock:
            gone = []
            for name, (_, inode, _) in self._maps.items():
                try:
                    same = os.stat(os.path.join(self.directory, name), follow_symlinks=False).st_ino == inode
                except OSError:
                    same = False
                if not same:
                    gone.append(name)
            for name in gone:
                self._maps.pop(name)  # unmapped once no view remains
            return len(gone)

    def _forget(self, name: str) -> None:
        with self._lock:
            self._maps.pop(name, None)

    def __len__(self) -> int:
        return len(self._maps)

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()


def alive(directory: str, name: str) -> bool:
    """Whether the client that made segment ``name`` still lives (holds its lock)."""
    return bool(NAME.match(name)) and locked(os.path.join(directory, name))


def locked(path: str) -> bool:
    """Whether a live process holds an ``flock`` on ``path`` (the kernel drops it when the
    process dies, whatever its PID namespace). False when there is no such file."""
    fd = _open_segment(path)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the lock, if we got it
    return False


def _open_segment(path: str) -> int | None:
    """A descriptor of ``path`` if it is a regular file (opened without following a link
    or blocking on a FIFO that any local user may have named like a segment), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def sweep(directory: str = DEFAULT_DIR, min_age: float = SWEEP_MIN_AGE_S) -> int:
    """Remove the segments of clients that are gone (no lock held, older than
    ``min_age``); returns how many. Safe to run from any process, any time."""
    removed = 0
    try:
        names = [n for n in os.listdir(directory) if NAME.match(n)]
    except OSError:
        return 0
    now = time.time()
    for name in names:
        path = os.path.join(directory, name)
        fd = _open_segment(path)
        if fd is None:
            continue  # gone, or not a segment (a FIFO, a device): not ours to remove
        try:
            if now - os.fstat(fd).st_mtime < min_age:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live client holds it
            Path(path).unlink(missing_ok=True)
            removed += 1
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d shared-memory segment(s) left by clients that are gone", removed)
    return removed


__all__ = ["DEFAULT_DIR", "Segment", "SegmentMaps", "SegmentUnavailable", "alive", "locked", "sweep"]
