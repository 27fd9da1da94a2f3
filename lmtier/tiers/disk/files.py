"""The segment files of one disk-tier directory: names, appends, reads, scans. Bytes and
names only; what is live, and within which bound, is the index's and the tier's business.

One module: the names, appends, reads and scans of one file format share its
alignment, buffers and O_DIRECT rules; split, each part would re-derive them.

    SegmentFiles(root, o_direct, fsync)   o_direct: True, False, or None (auto: see below)
      .create() -> Writer                 a new segment, locked by this process while it appends
      .new_name() -> str                  a name no other process will make
      .frames(chunk) -> Frame             a chunk's frame, ready to write (verified on the way)
      .filler(size) -> Frame              zeros in the place of a chunk that is not written
      .release(frames)                    their pooled buffers back
      .read(path, run, places) -> [view]  one preadv of consecutive frames, one pooled buffer each
                                          (or a payload read into the memory placed for it)
      .scan(path, start, verify) -> ([(key, offset, length)], end)   the good frames from ``start``
      .owner_alive(path) -> bool          whether a live writer still appends to a segment
      .remove_dead_temporaries()          what crashed writers left in tmp/
    Writer.append(frames) -> [offset]     one sequential write at the segment's end
    Writer.write_at(frames, offset)       one pwritev at a place taken already (a batch's pieces)

A segment is a sequence of codec frames, each starting at a multiple of ``ALIGN`` and
padded with zeros to the next one. Aligned frames cost at most 4 KiB each (1.5% of a
256 KiB chunk) and buy the I/O the tier needs: a batch of frames is a few large ``pwritev``
from page-aligned buffers (with O_DIRECT, or through the page cache), and consecutive frames
come back with one ``preadv`` straight into one page-aligned pooled buffer per chunk, so
each chunk keeps its own lease and nothing is copied twice.

Page cache or O_DIRECT: ``o_direct=true`` writes and reads with O_DIRECT, ``false``
through the page cache. ``auto`` (the default) writes through the page cache and reads
what the page cache holds through it and the rest with O_DIRECT (``pagecache.resident``,
asked per run), where the filesystem supports O_DIRECT; the measurements behind it are in
docs/architecture.md ("The disk tier").

Names are ``<pid>-<random>-<n>.seg`` (unique across processes, hosts and PID namespaces
sharing the directory; ``claim.segment_name`` tells them from strangers); no key ever
reaches a path. A writer makes its segment under
``tmp/``, takes an exclusive ``flock`` on it and renames it into ``segments/``, so any
process can tell a live writer's segment (locked) from a dead one's (free: the kernel
drops the lock with the process, SIGKILL included), whatever PID namespace it lives in.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lmtier._moved import forward
from lmtier.buffers import ALIGN, BufferPool, round_up
from lmtier.errors import IntegrityError
from lmtier.kv import codec
from lmtier.kv.chunk import Chunk, iter_segments
from lmtier.tiers.disk import pagecache
from lmtier.tiers.disk.claim import temporary
from lmtier.transport.shm.segment import locked

SUFFIX = ".seg"
STALE_TEMP_S = 600.0  # a file in tmp/ untouched this long belongs to no live writer
MAX_FRAME = 1 << 31  # a frame claiming more is not ours: refuse before allocating
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_ZEROS = bytes(ALIGN)


@dataclass
class Frame:
    """One chunk's frame as buffers to write: ``length`` bytes, then zeros to ``padded``."""

    key: bytes
    length: int
    parts: list = field(repr=False)
    buffer: object = field(default=None, repr=False)  # a pooled buffer to hand back once written

    @property
    def padded(self) -> int:
        return round_up(self.length)


class SegmentFiles:
    def __init__(self, root: Path, o_direct: bool | None, fsync: bool) -> None:
        self.root = root
        self.segments = root / "segments"
        self.tmp = root / "tmp"
        self.make_dirs()
        direct_ok = supports_o_direct(self.tmp) if o_direct is not False else False
        self.write_direct = bool(o_direct)
        self.read_mode = "direct" if o_direct else "resident" if o_direct is None and direct_ok else "cache"
        self.o_direct = self.write_direct or self.read_mode != "cache"  # O_DIRECT in use at all
        self.read_bytes = {"page_cache": 0, "o_direct": 0}  # how reads went (a statistic)
        self.fsync = fsync
        self.max_frame = MAX_FRAME  # the tier lowers it to its size: no frame is larger
        # Enough idle buffers for a few prompts read at once, bounded in bytes: fresh
        # buffers cost page faults on every read.
        self.buffers = BufferPool(max_free=512, max_free_bytes=256 << 20)
        self._counter = itertools.count()
        self._nonce_pid = -1

    def make_dirs(self) -> None:
        self.segments.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(exist_ok=True)

    def path(self, name: str) -> str:
        return f"{self.segments}/{name}"

    # -- writing ------------------------------------------------------------------------
    def new_name(self) -> str:
        return f"{os.getpid()}-{self._nonce()}-{next(self._counter)}{SUFFIX}"

    def create(self) -> Writer:
        """A new, empty segment in ``segments/``, locked for this process's appends."""
        name = self.new_name()
        tmp = f"{self.tmp}/{name}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if self.write_direct else 0)
        fd = os.open(tmp, flags, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh inode: nobody else holds it
            os.rename(tmp, self.path(name))
            if self.fsync:
                fsync_dir(str(self.segments))
        except BaseException:
            os.close(fd)
            Path(tmp).unlink(missing_ok=True)
            raise
        return Writer(name, self.path(name), fd, self.fsync, self.write_direct)

    def size(self, chunk: Chunk) -> int:
        """The bytes ``chunk``'s frame takes in a segment, padding included."""
        return round_up(codec.encoded_size(chunk, ALIGN))

    def frames(self, chunk: Chunk) -> Frame:
        """``chunk``'s frame, verified on the way in (``IntegrityError``: it came damaged
        from memory), its payload at a page boundary of the frame (``codec``'s ``align``).
        Through the page cache the parts are views of the chunk (nothing copied here; the
        kernel copies once). With O_DIRECT too, when the chunk's bytes lie page-aligned (a
        memory tier's slot): the disk reads them where they are, and only the page of
        preamble and header is copied; otherwise the frame is encoded into a pooled
        page-aligned buffer (one pass copies and hashes)."""
        if self.write_direct:
            runs = [] if chunk.nbytes % ALIGN else list(iter_segments(chunk.data))
            if runs and all(_aligned(r) for r in runs):
                parts = codec.encode_parts(chunk, align=ALIGN)  # verifies; the payload runs are views
                return Frame(chunk.key, len(parts[0]) + chunk.nbytes, [_aligned_copy(parts[0]), *parts[1:]])
            length = codec.encoded_size(chunk, ALIGN)
            buf = self.buffers.acquire(round_up(length))
            try:
                codec.encode_into(chunk, buf, align=ALIGN)
                buf[length : round_up(length)] = _ZEROS[: round_up(length) - length]
            except BaseException:
                self.buffers.release(buf)
                raise
            return Frame(chunk.key, length, [memoryview(buf)[: round_up(length)]], buf)
        parts = codec.encode_parts(chunk, align=ALIGN)
        length = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
        if length % ALIGN:
            parts.append(_ZEROS[: round_up(length) - length])
        return Frame(chunk.key, length, parts)

    def filler(self, size: int) -> Frame:
        """Zeros standing for a frame that is not written (no key): ``size`` bytes."""
        if self.write_direct:
            buf = self.buffers.acquire(size)
            buf[:size] = bytes(size)
            return Frame(b"", size, [memoryview(buf)[:size]], buf)
        return Frame(b"", size, [bytes(size)])

    def release(self, frames: list[Frame]) -> None:
        for frame in frames:
            if frame.buffer is not None:
                self.buffers.release(frame.buffer)
                frame.buffer = None

    # -- reading ------------------------------------------------------------------------
    def read(self, path: str, run: list[tuple[int, int]], places: list | None = None) -> list[memoryview | None]:
        """Frames ``run`` = [(offset, length)], consecutive in the file, with one ``preadv``
        into one pooled buffer each. Returns a view of each frame (its buffer is
        ``view.obj``, for the caller to release), None for one the file ends inside.
        ``places[i]``: page-aligned memory for frame ``i``'s payload (its pages after the
        first; the view is then of the first page). ``FileNotFoundError``: segment gone."""
        places = places or [None] * len(run)
        direct = self.read_mode == "direct"
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
        bufs = []
        try:
            if self.read_mode == "resident":
                span = run[-1][0] + round_up(run[-1][1]) - run[0][0]
                if not pagecache.resident(fd, run[0][0], span):  # not in the cache (or cannot tell)
                    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
                    direct = True
            views = []
            for (_, length), place in zip(run, places, strict=True):
                if not codec.PREAMBLE.size <= length <= self.max_frame:
                    raise IntegrityError(f"a frame of {length} bytes cannot be a chunk")
                if place is None:
                    bufs.append(self.buffers.acquire(round_up(length)))
                    views.append(memoryview(bufs[-1])[: round_up(length)])
                else:
                    if place.nbytes != length - ALIGN or length % ALIGN:
                        raise ValueError("a placed payload takes whole pages after the frame's first")
                    bufs.append(self.buffers.acquire(ALIGN))
                    views += [memoryview(bufs[-1])[:ALIGN], memoryview(place).cast("B")]
            got = _preadv_all(fd, views, run[0][0])
        except BaseException:
            for b in bufs:
                self.buffers.release(b)
            raise
        finally:
            os.close(fd)
        self.read_bytes["o_direct" if direct else "page_cache"] += got  # racy, but only a statistic
        out: list[memoryview | None] = []
        pos = 0
        for buf, (_, length), place in zip(bufs, run, places, strict=True):
            if got - pos >= length:
                out.append(memoryview(buf)[: length if place is None else ALIGN])
            else:
                self.buffers.release(buf)
                out.append(None)
            pos += round_up(length)
        return out

    def scan(self, path: str, start: int, verify: bool) -> tuple[list[tuple[bytes, int, int]], int]:
        """The good frames of a segment from ``start``: ``([(key, offset, length)], end)``,
        ``end`` being where the last good frame ends (``start`` if none), before the first
        bad or incomplete frame (a torn tail) or the file's end; zeroed blocks (the
        place of a chunk that was not written) are stepped over. ``verify`` checks each
        payload too (a tail a killed writer left: its header may be whole and its payload
        not); otherwise headers only, and reads verify."""
        found: list[tuple[bytes, int, int]] = []
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            pos = end = start
            while pos + codec.PREAMBLE.size <= size:
                head = os.pread(fd, ALIGN, pos)  # the preamble and, nearly always, the header
                if head == _ZEROS[: len(head)]:  # the place of a chunk that was not written
                    pos += ALIGN
                    continue
                header_len = codec.header_length(head)
                length = codec.PREAMBLE.size + header_len + int.from_bytes(head[12:20], "little")
                too_long = pos + length > size or length > self.max_frame
                if head[:4] != codec.MAGIC or header_len > codec.MAX_HEADER or too_long:
                    break
                try:
                    if verify:
                        key = codec.decode(os.pread(fd, length, pos)).key
                    else:
                        if len(head) < codec.PREAMBLE.size + header_len:
                            head = os.pread(fd, codec.PREAMBLE.size + header_len, pos)
                        key = header_of(memoryview(head)[: codec.PREAMBLE.size + header_len], length).key
                except IntegrityError:
                    break
                if not 1 <= len(key) <= 64:
                    break
                found.append((key, pos, length))
                pos = end = pos + round_up(length)
        finally:
            os.close(fd)
        return found, end

    # -- the directory ------------------------------------------------------------------
    def owner_alive(self, path: str) -> bool:
        """Whether a live process holds the segment's append lock."""
        return locked(path)

    def remove_dead_temporaries(self) -> None:
        """Files crashed writers left in tmp/ (by their names: nothing else is removed). A
        pid says nothing about a writer in another container, so age decides: a new segment
        is renamed into place within milliseconds, and a file untouched for STALE_TEMP_S is
        no live writer's."""
        cutoff = time.time() - STALE_TEMP_S
        if self.tmp.is_symlink():  # replaced since the tier claimed it: never follow it
            return
        for entry in os.scandir(self.tmp):
            try:
                if temporary(entry.name) and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    Path(entry.path).unlink(missing_ok=True)
            except OSError:  # gone meanwhile, a directory, or not ours to remove
                pass

    def _nonce(self) -> str:
        """Random per process (made anew after fork)."""
        if self._nonce_pid != os.getpid():
            self._nonce_text, self._nonce_pid = secrets.token_hex(6), os.getpid()
        return self._nonce_text


class Writer:
    """The segment this process appends to. Only its owner writes it, so appends need no
    lock across processes; ``end`` is where the next frame goes."""

    def __init__(self, name: str, path: str, fd: int, fsync: bool, direct: bool, end: int = 0) -> None:
        self.name, self.path, self.fd, self.fsync, self.direct, self.end = name, path, fd, fsync, direct, end
        self.pid = os.getpid()
        self.id: int | None = None  # its row in the index, once recorded

    def append(self, frames: list[Frame]) -> list[int]:
        """Write ``frames`` at the end, in one sequential write; returns their offsets.
        On an error (a full disk) what was written is cut off again, and it raises."""
        start = self.end
        try:
            self.write_at(frames, start)
        except BaseException:
            self.truncate(start)
            raise
        self.end = start + sum(f.padded for f in frames)
        return list(itertools.accumulate((f.padded for f in frames[:-1]), initial=start))

    def write_at(self, frames: list[Frame], offset: int) -> None:
        """Write ``frames`` back to back from ``offset`` with one ``pwritev`` (more only
        past IOV_MAX buffers), then have it reach the disk: ``fsync=true`` waits for it;
        through the page cache its writeback starts at once (``pagecache.write_back``)."""
        views = [memoryview(p).cast("B") for frame in frames for p in frame.parts]
        _pwritev_all(self.fd, views, offset)
        if self.fsync:
            os.fdatasync(self.fd)
        elif not self.direct:
            pagecache.write_back(self.fd, offset, sum(f.padded for f in frames))

    def truncate(self, end: int) -> None:
        try:
            os.ftruncate(self.fd, end)
            self.end = end
        except OSError:
            pass  # the bytes past ``end`` are no frame of the index's; a scan stops at them

    def close(self) -> None:
        """Close the file (which releases the append lock once no process holds it open:
        a forked child closes its inherited copy too, so that it never keeps a dead
        parent's segment looking alive)."""
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = -1


def header_of(head: memoryview, length: int) -> codec.Header:
    """Check a frame's preamble and header (``head``) without reading its payload
    (``IntegrityError``); ``length``: the whole frame's."""
    # read_header looks at the payload's length only; an untouched array costs no memory
    payload = np.empty(length - len(head), dtype=np.uint8)
    return codec.read_header(head, payload)[0]


def _aligned(run: np.ndarray) -> bool:
    """Whether O_DIRECT can write ``run`` where it lies: address and length page-aligned."""
    return run.ctypes.data % ALIGN == 0 and run.nbytes % ALIGN == 0


def _aligned_copy(data: bytes) -> np.ndarray:
    """``data`` copied to page-aligned memory (a frame's preamble and header, for O_DIRECT)."""
    raw = np.empty(len(data) + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    out = raw[start : start + len(data)]
    out[:] = np.frombuffer(data, dtype=np.uint8)
    return out


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill ``views`` from ``offset`` (several calls when the kernel returns short, or for
    more than IOV_MAX buffers); returns the bytes read, less than asked at end of file."""
    views = list(views)
    total = 0
    i = 0
    while i < len(views):
        group = views[i : i + IOV_MAX]
        n = os.preadv(fd, group, offset + total)
        if n <= 0:
            break
        total += n
        while group and n >= len(group[0]):
            n -= len(group[0])
            group.pop(0)
            i += 1
        if group and n:
            if n % ALIGN:  # O_DIRECT came back short mid-page: only end of file does that
                return total
            views[i] = group[0][n:]
    return total


def _pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    views = list(views)
    i = 0
    while i < len(views):
        group = views[i : i + IOV_MAX]
        n = os.pwritev(fd, group, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, "nothing written")
        offset += n
        while group and n >= len(group[0]):
            n -= len(group[0])
            group.pop(0)
            i += 1
        if group and n:
            views[i] = group[0][n:]


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def supports_o_direct(directory: Path) -> bool:
    probe = directory / f"{os.getpid()}-odirect-probe.tmp"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    os.close(fd)
    probe.unlink(missing_ok=True)
    return True


__getattr__ = forward(__name__)  # names of the previous release, found where they live now (CHANGELOG.md)
