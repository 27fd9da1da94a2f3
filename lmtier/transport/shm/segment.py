"""A segment from the side that makes it: created, locked while its maker lives, swept after.

    Segment(directory, size, slot_bytes)    a segment of this process's: created, locked, cut into slots
    NAME, DEFAULT_DIR                       the shape of a segment's name; where segments live
    alive(directory, name)                  whether the process that made segment ``name`` lives
    locked(path)                            whether a live process holds an ``flock`` on ``path``
    sweep(directory)                        removes segments whose maker died

A grpc:// client makes one for the slots its frames travel in; the server's memory tier
makes one for the slab its clients map. The maker holds a shared ``flock`` on the file for
as long as it lives, so a segment nobody holds belongs to a process that is gone: ``sweep``
(run by the server now and then) removes it, which is how the memory of a killed client
comes back. The lock, the name and the sweep are one protocol, kept in one place.

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
from pathlib import Path

from lmtier.errors import ConfigError

log = logging.getLogger(__name__)

NAME = re.compile(r"lmtier-[0-9a-f]{32}\Z")
DEFAULT_DIR = "/dev/shm"
QUARANTINE_S = 30.0  # slots of a call that ended abnormally rest this long before reuse
GROW_STEP = 32 << 20  # a growing segment reserves this much at a time
SWEEP_MIN_AGE_S = 60.0  # a segment younger than this is never swept (it may be starting)


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

    def protect(self) -> None:
        """Make the file read-only, so that no process opens it for writing (or cuts it
        short) by mistake, its owner included, short of root or a ``chmod``: for a
        segment others only read (the server's memory tier). This process's descriptor and
        mapping keep their write access."""
        os.fchmod(self._fd, 0o400)

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


__all__ = [
    "DEFAULT_DIR",
    "GROW_STEP",
    "NAME",
    "QUARANTINE_S",
    "SWEEP_MIN_AGE_S",
    "Segment",
    "alive",
    "locked",
    "sweep",
]
