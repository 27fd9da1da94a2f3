"""The chunk files of one disk-tier directory: where each chunk lies, how it is written
and read. No policy here (sizes, eviction, recency: ``tier``, ``index``); only bytes and
names.

    ChunkFiles(root, o_direct, fsync)
      .path(key) -> str                  chunks/<first byte>/<hex key>.lmt
      .write_temp(chunk) -> (tmp, size)  the chunk's frame, whole, under a unique temporary name
      .read(key, on_corrupt) -> Chunk | None   one frame, verified; None when there is no file
      .scan() -> {key: (size, mtime_ns)}  every chunk file (what ``reconcile`` compares)
      .remove_dead_temporaries()         what crashed writers left behind
    key_of(name) -> bytes | None         the key a file name encodes, None for a stranger
    fsync_dir(path), supports_o_direct(directory)

The file name is the key's fixed hex encoding and nothing else, so no input can steer a
path. Writes go to ``tmp/<pid>-<random>-<n>.tmp`` (unique across processes, hosts and
PID namespaces sharing the directory) and are published by ``rename``; with O_DIRECT
(``o_direct``) the frame is written from a page-aligned buffer and its padding trimmed.
"""

from __future__ import annotations

import errno
import itertools
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from lmtier import codec
from lmtier.buffers import ALIGN, BufferPool, round_up
from lmtier.chunk import Chunk
from lmtier.errors import IntegrityError

SUFFIX = ".lmt"
MAX_FRAME = 1 << 31  # a file larger than this is not ours: refuse before allocating
STALE_TEMP_S = 600.0  # a temporary file untouched this long belongs to no live writer


class ChunkFiles:
    def __init__(self, root: Path, o_direct: bool | None, fsync: bool) -> None:
        self.chunks = root / "chunks"
        self.tmp = root / "tmp"
        self.make_dirs()
        self.o_direct = supports_o_direct(self.tmp) if o_direct is None else o_direct
        self.fsync = fsync
        # Enough idle buffers for a few batched reads in flight (a prompt's worth of chunks
        # read at once), bounded in bytes: fresh buffers cost page faults on every read.
        self._buffers = BufferPool(max_free=256, max_free_bytes=256 << 20)
        self._counter = itertools.count()
        self._nonce_pid = -1

    def make_dirs(self) -> None:
        for i in range(256):
            (self.chunks / f"{i:02x}").mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(exist_ok=True)

    def path(self, key: bytes) -> str:
        name = key.hex()
        return f"{self.chunks}/{name[:2]}/{name}{SUFFIX}"

    # -- writing ------------------------------------------------------------------------
    def write_temp(self, chunk: Chunk) -> tuple[str, int]:
        """Write one chunk's frame under a new temporary name: ``(path, size)``.

        Raises ``IntegrityError`` when the chunk fails verification on its way in (it came
        unverified from memory) and ``OSError`` when the disk refuses; a temporary file this
        call created is removed then (never a file of someone else's).
        """
        tmp = str(self.tmp / f"{os.getpid()}-{self._nonce()}-{next(self._counter)}.tmp")
        buf = None
        created = False
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.o_direct else 0)
            if self.o_direct:
                buf = self._buffers.acquire(round_up(codec.encoded_size(chunk)))
                size = codec.encode_into(chunk, buf)
                padded = round_up(size)
                buf[size:padded] = bytes(padded - size)
                parts = [memoryview(buf)[:padded]]
            else:
                parts = codec.encode_parts(chunk)
                size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
            fd = os.open(tmp, flags, 0o644)
            created = True
            try:
                _write_all(fd, parts)
                if self.o_direct and size % ALIGN:  # drop the padding O_DIRECT wrote
                    os.ftruncate(fd, size)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            return tmp, size
        except BaseException:
            if created:
                Path(tmp).unlink(missing_ok=True)
            raise
        finally:
            if buf is not None:
                self._buffers.release(buf)

    # -- reading ------------------------------------------------------------------------
    def read(self, key: bytes, on_corrupt: Callable[[int], None]) -> Chunk | None:
        """The chunk stored under ``key``, verified as it is read; None when there is no file.

        Raises ``IntegrityError`` (with the file's inode in ``exc.inode``) for a file that is
        not a good frame of this key, and ``OSError`` when the disk fails. ``on_corrupt`` is
        called with the inode if the chunk turns out damaged later (a lazily verified view).
        """
        try:
            fd = os.open(self.path(key), os.O_RDONLY | (os.O_DIRECT if self.o_direct else 0))
        except FileNotFoundError:
            return None
        buf = None
        try:
            st = os.fstat(fd)
            try:
                if not codec.PREAMBLE.size <= st.st_size <= MAX_FRAME:
                    raise IntegrityError(f"file of {st.st_size} bytes cannot be a chunk")
                buf = self._buffers.acquire(round_up(st.st_size))
                view = memoryview(buf)
                got = 0
                while got < st.st_size:  # O_DIRECT reads whole blocks; the tail comes back short
                    n = os.preadv(fd, [view[got : round_up(st.st_size)]], got)
                    if n <= 0:
                        break
                    got += n
                if got != st.st_size:
                    raise IntegrityError("file shorter than it said")
                # Verified here, in the I/O thread: hashing releases the GIL, so it runs
                # beside the other reads instead of adding a pass to the reader's copy.
                chunk = codec.decode(
                    view[: st.st_size],
                    key=key,
                    on_release=lambda b=buf: self._buffers.release(b),
                    on_corrupt=lambda inode=st.st_ino: on_corrupt(inode),
                )
            except IntegrityError as exc:
                exc.inode = st.st_ino  # type: ignore[attr-defined]
                raise
            buf = None  # the chunk owns it now
            return chunk
        finally:
            os.close(fd)
            if buf is not None:
                self._buffers.release(buf)

    # -- the directory ------------------------------------------------------------------
    def scan(self) -> dict[bytes, tuple[int, int]]:
        """Every chunk file: ``{key: (size, mtime_ns)}``. Anything else under ``chunks/``
        is not ours and is removed (nothing else lives there)."""
        on_disk: dict[bytes, tuple[int, int]] = {}
        for sub in os.scandir(self.chunks):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                key = key_of(entry.name)
                if key is None or not entry.is_file(follow_symlinks=False):
                    Path(entry.path).unlink(missing_ok=True)
                    continue
                st = entry.stat(follow_symlinks=False)
                on_disk[key] = (st.st_size, st.st_mtime_ns)
        return on_disk

    def remove_dead_temporaries(self) -> None:
        """Temporary files a crashed writer left. A pid says nothing about a writer in
        another container (PID namespace) or on another host, so age decides: a chunk is
        written and published within seconds, and a file untouched for STALE_TEMP_S is no
        live writer's."""
        cutoff = time.time() - STALE_TEMP_S
        for entry in os.scandir(self.tmp):
            try:
                if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    Path(entry.path).unlink(missing_ok=True)
            except FileNotFoundError:
                pass

    def _nonce(self) -> str:
        """Random per process (made anew after fork)."""
        if self._nonce_pid != os.getpid():
            self._nonce_text, self._nonce_pid = secrets.token_hex(6), os.getpid()
        return self._nonce_text


def key_of(name: str) -> bytes | None:
    stem = name.removesuffix(SUFFIX)
    if stem == name or len(stem) % 2:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


def _write_all(fd: int, parts: list) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


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
