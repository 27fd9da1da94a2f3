"""Shared-memory segments: the same-host data plane between the grpc:// tier and the server.

    Segment(directory, size, slot_bytes)    the client's: created, locked, cut into slots
    SegmentFiles(directory)                 the server's: clients' segments read and written by
                                            name (pread/pwrite), bounded; prune()
    SegmentMaps(directory)                  the client's: the server's memory mapped read-only
    sweep(directory)                        removes segments whose client died

Python gRPC moves bulk bytes at well under 1 GB/s; a memory copy runs at several GB/s.
When client and server share a host (a sidecar in the engine's pod, with an in-memory
``/dev/shm`` shared between the containers), the client creates a segment, writes the
frames it puts into slots of it and lets the server write the frames it gets into other
slots; gRPC carries only the slot references.

Ownership keeps it safe. The segment is the client's: the server reads and writes it only
while a call runs, with ``pread``/``pwrite`` rather than a mapping (a client that shrinks
its file under a mapping would kill the server with SIGBUS; a short read is only an
error), so a client that dies or misbehaves mid-transfer strands nothing on the server.
The client holds a shared ``flock`` on its segment for as long as it lives; ``sweep`` (run
by the server now and then) removes segments nobody holds, which is how the memory of a
killed client comes back. Frames carry their checksums, so bytes that change under a
reader are a miss, never wrong KV.

Names are ``lmtier-`` and 32 random hex digits: a server opens nothing else, and nothing
outside its shared-memory directory.

Longer than 400 lines: the plane's three users (the client's segment, the server's access
to it, the client's map of the server's memory) share the checks on names and files that
keep it safe; kept side by side, one reader sees every way a segment is opened.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Callable
from pathlib import Path

from lmtier.errors import ConfigError, FormatError, LmtierError

log = logging.getLogger(__name__)

NAME = re.compile(r"lmtier-[0-9a-f]{32}\Z")
DEFAULT_DIR = "/dev/shm"
QUARANTINE_S = 30.0  # slots of a call that ended abnormally rest this long before reuse
GROW_STEP = 32 << 20  # a growing segment reserves this much at a time
MAX_SPAN = 1 << 62  # no segment reaches past this offset (file offsets are signed 64-bit)
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


class SegmentFiles:
    """Clients' segments, opened by name on first use and read (``read_into``) or written
    (``write``) through the descriptor, never mapped: the client owns the file and may
    shrink it at any moment, which under a mapping is a SIGBUS in the server and through
    ``pread``/``pwrite`` only a short read or a region out of bounds. At most ``limit``
    open at a time (least recently used closed first), each re-checked on use so that a
    removed or replaced segment is never used."""

    def __init__(self, directory: str = DEFAULT_DIR, limit: int = 64) -> None:
        self.directory = directory
        self.limit = limit
        self._files: OrderedDict[str, tuple[int, int]] = OrderedDict()  # name -> (fd, inode)
        self._lock = threading.Lock()

    def read_into(self, name: str, offset: int, length: int, buffer) -> memoryview:
        """``length`` bytes at ``offset`` of segment ``name``, read into ``buffer``; returns
        the view of them. ``SegmentUnavailable`` if the segment is shorter than that."""
        _check_span(name, offset, length)
        out = memoryview(buffer).cast("B")[:length]
        if len(out) < length:
            raise ValueError("buffer smaller than the region read")
        with self._use(name) as fd:
            got = os.preadv(fd, [out], offset) if length else 0
        if got != length:
            raise SegmentUnavailable(f"region [{offset}, {offset + length}) lies outside segment {name}")
        return out

    def read_split(self, name: str, offset: int, length: int, head, rest: Callable[[memoryview], tuple]) -> tuple:
        """The frame of ``length`` bytes at ``offset`` of segment ``name`` read in two parts
        through one descriptor: its first bytes into ``head`` (as many as fit), then
        ``rest(those bytes)`` says where the remainder goes, as ``(skip, buffer, result)``:
        the bytes from ``skip`` (within the frame) to its end are read into ``buffer``, and
        ``result`` is returned; a ``buffer`` of None reads nothing more. A region shorter
        than asked is ``SegmentUnavailable``."""
        _check_span(name, offset, length)
        first = memoryview(head).cast("B")[: min(len(head), length)]
        with self._use(name) as fd:
            # the whole region first: ``rest`` may set memory aside (evicting) for it
            if os.fstat(fd).st_size < offset + length or os.preadv(fd, [first], offset) != len(first):
                raise SegmentUnavailable(f"region [{offset}, {offset + length}) lies outside segment {name}")
            skip, buffer, result = rest(first)
            if buffer is not None:
                out = memoryview(buffer).cast("B")
                if skip + len(out) != length:
                    raise ValueError("the rest of a frame read into a buffer of another length")
                if os.preadv(fd, [out], offset + skip) != len(out):
                    raise SegmentUnavailable(f"region [{offset}, {offset + length}) lies outside segment {name}")
        return result

    def write(self, name: str, offset: int, parts: list) -> int:
        """Write ``parts`` (buffers, in order) at ``offset`` of segment ``name``, which must
        lie within the segment as it is; returns the bytes written."""
        views = [memoryview(p).cast("B") for p in parts]
        length = sum(len(v) for v in views)
        _check_span(name, offset, length)
        with self._use(name) as fd:
            size = os.fstat(fd).st_size
            if offset + length > size:  # the file as it is now (_check_span saw the numbers)
                raise FormatError(f"region [{offset}, {offset + length}) lies outside segment {name} of {size} bytes")
            done = 0
            while views:  # a write may stop short (a signal); go on from there
                n = os.pwritev(fd, views[:1024], offset + done)
                if n <= 0:
                    raise SegmentUnavailable(f"segment {name} took no more bytes")
                done += n
                while views and n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                if n:
                    views[0] = views[0][n:]
        return done

    @contextlib.contextmanager
    def _use(self, name: str):
        fd = self._fd(name)
        try:
            yield fd
        except OSError as exc:
            raise SegmentUnavailable(f"shared-memory segment {name}: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)

    def _fd(self, name: str) -> int:
        """A descriptor of its own for one use (a duplicate of the one kept), so that
        closing the kept one, when it is pushed out or pruned, never pulls it from a user."""
        path, st = _look_up(self.directory, name, self._close)
        with self._lock:
            held = self._files.get(name)
            if held is not None and held[1] != st.st_ino:
                os.close(self._files.pop(name)[0])
                held = None
            if held is None:
                held = self._files[name] = (_open_checked(path, os.O_RDWR), st.st_ino)
                while len(self._files) > self.limit:
                    os.close(self._files.popitem(last=False)[1][0])
            self._files.move_to_end(name)
            return os.dup(held[0])

    def prune(self) -> int:
        """Close the segments that are gone (swept, or their client removed them), so that
        their memory comes back at once; returns how many."""
        with self._lock:
            gone = [name for name, (_, inode) in self._files.items() if _inode(self.directory, name) != inode]
            for name in gone:
                os.close(self._files.pop(name)[0])
            return len(gone)

    def _close(self, name: str) -> None:
        with self._lock:
            held = self._files.pop(name, None)
            if held is not None:
                os.close(held[0])

    def __len__(self) -> int:
        return len(self._files)

    def clear(self) -> None:
        with self._lock:
            while self._files:
                os.close(self._files.popitem()[1][0])


def _check_span(name: str, offset: int, length: int) -> None:
    """A region a file offset can name (a request's 64-bit numbers may be past any)."""
    if offset < 0 or length < 0 or offset + length > MAX_SPAN:
        raise FormatError(f"region [{offset}, {offset + length}) lies outside segment {name}")


def _look_up(directory: str, name: str, gone) -> tuple[str, os.stat_result]:
    """The path and status of segment ``name``: a name of lmtier's shape for a regular file
    in ``directory`` (``gone(name)`` is told when it is not there)."""
    if not NAME.match(name):
        raise FormatError(f"{name!r} is not an lmtier shared-memory segment name")
    path = os.path.join(directory, name)
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as exc:
        gone(name)
        raise SegmentUnavailable(f"shared-memory segment {name} is not here: {exc.strerror}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise SegmentUnavailable(f"{path} is not a regular file")
    return path, st


def _inode(directory: str, name: str) -> int | None:
    try:
        return os.stat(os.path.join(directory, name), follow_symlinks=False).st_ino
    except OSError:
        return None


def _open_checked(path: str, mode: int) -> int:
    """A descriptor of ``path`` checked on the descriptor itself: a regular file (never a
    symlink, never a FIFO to block on) with no other name (a hard link would let a request
    reach a file outside the segment directory)."""
    try:
        fd = os.open(path, mode | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise SegmentUnavailable(f"cannot open shared-memory segment {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SegmentUnavailable(f"{path} is not a regular file")
        if st.st_nlink != 1:
            raise SegmentUnavailable(f"{path} has {st.st_nlink} names: not a segment a client made")
    except BaseException:
        os.close(fd)
        raise
    return fd


class SegmentMaps:
    """Another process's segments, mapped by name on first use: a client maps its server's
    memory, read-only, to read chunks where they lie (the server is the one
    process a client trusts with its memory; the server itself never maps a client's,
    see ``SegmentFiles``). At most ``limit`` at a time (least recently used unmapped
    first), re-checked on each use so a removed or replaced segment is never used."""

    def __init__(self, directory: str = DEFAULT_DIR, limit: int = 64) -> None:
        self.directory = directory
        self.limit = limit
        self._maps: OrderedDict[str, tuple[mmap.mmap, int, int]] = OrderedDict()  # name -> (map, inode, size)
        self._lock = threading.Lock()

    def region(self, name: str, offset: int, length: int | None) -> memoryview:
        """A view of ``length`` bytes at ``offset`` of segment ``name`` (``None``: to its end)."""
        path, st = _look_up(self.directory, name, self._forget)
        with self._lock:
            held = self._maps.get(name)
            if held is not None and (held[1] != st.st_ino or held[2] != st.st_size):
                self._maps.pop(name)
                held = None
            if held is None:
                held = self._map(path)
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
    def _map(path: str) -> tuple[mmap.mmap, int, int]:
        """Map the file at ``path`` read-only, checked on the descriptor actually mapped (``_open_checked``)."""
        fd = _open_checked(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            return mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ), st.st_ino, st.st_size
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


__all__ = ["DEFAULT_DIR", "Segment", "SegmentFiles", "SegmentMaps", "SegmentUnavailable", "alive", "locked", "sweep"]
