"""Segments another process made, opened by name, with every check that keeps that safe.

    SegmentFiles(directory)     the server's: clients' segments read and written by name
                                (pread/pwrite), bounded; prune()
    SegmentMaps(directory)      the client's: the server's memory mapped read-only; prune()
    SegmentUnavailable          the named segment cannot be used here

A name in a request is a file the requester says is its segment; the process that acts on
it checks that the name has lmtier's shape, names a regular file in its shared-memory
directory with no other name (never a symlink, a FIFO or a hard link to a file
elsewhere), and checks that again on the descriptor it actually uses.

Ownership keeps it safe. A client's segment is the client's: the server reads and writes
it only while a call runs, with ``pread``/``pwrite`` rather than a mapping (a client that
shrinks its file under a mapping would kill the server with SIGBUS; a short read is only
an error), so a client that dies or misbehaves mid-transfer strands nothing on the server.
The server is the one process a client trusts with its memory, so a client does map the
server's. Frames carry their checksums, so bytes that change under a reader are a miss,
never wrong KV.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable

from lmtier.errors import FormatError, LmtierError
from lmtier.transport.shm.segment import DEFAULT_DIR, NAME

MAX_SPAN = 1 << 62  # no segment reaches past this offset (file offsets are signed 64-bit)


class SegmentUnavailable(LmtierError):
    """The named segment cannot be mapped here (another host, removed, not ours)."""


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


__all__ = ["MAX_SPAN", "SegmentFiles", "SegmentMaps", "SegmentUnavailable"]
