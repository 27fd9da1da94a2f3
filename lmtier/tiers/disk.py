"""``file:///mnt/nvme/lmtier?size=500GiB``: chunks as files on a local disk.

One file per chunk, ``chunks/<first byte>/<hex key>.lmt``, holding one codec frame. The
file name is the key's fixed hex encoding and nothing else, so no input can steer a path.

Publishing is atomic: a chunk is written whole under ``tmp/<pid>-<random>-<n>.tmp`` (fsync'ed
first when ``fsync=true``), then, inside one index transaction, renamed into place and
recorded. Readers open files by name, so they see a complete frame or nothing; a file
evicted or replaced while being read stays readable through its open descriptor. After a
crash a frame is still verified by its checksums when read, so a torn file can only ever
be a miss.

The index (``lmtier.tiers.diskindex``, SQLite in the same directory) holds sizes and
recency and is shared by every process that opens the directory: the size bound is
enforced under its write lock, counting each file once however many processes write.
Opening the tier reconciles the index with the files (adopting complete files a crash
left unrecorded, forgetting records whose files are gone, removing dead writers'
temporary files), and rebuilds it from the files when the database is missing.

Eviction is LRU over the index's recency with the CPU tier's twist: within a batch the
first chunk of the prompt is made the most recent, so a prompt loses its tail first.

I/O: large sequential reads and writes in reused page-aligned buffers, with O_DIRECT when
the filesystem supports it (``o_direct=auto``), so cold reads measure the disk, not the
page cache, and the cache keeps room for the engine. A small thread pool
(``threads=16``: small chunks need a deep queue) overlaps the I/O of a batch's chunks.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lmtier import codec, metrics
from lmtier.buffers import ALIGN, BufferPool, round_up
from lmtier.chunk import Chunk
from lmtier.errors import ConfigError, IntegrityError, TierError
from lmtier.tiers.base import Capabilities, Tier, TierContext, TierURL, parse_bool
from lmtier.tiers.diskindex import DiskIndex
from lmtier.units import parse_size

log = logging.getLogger(__name__)
SUFFIX = ".lmt"
MAX_FRAME = 1 << 31  # a file larger than this is not ours: refuse before allocating
STALE_TEMP_S = 600.0  # a temporary file untouched this long belongs to no live writer
TOUCH_WAIT_S = 0.05  # how long a read waits for the index's write lock to refresh recency


def _parse_auto(text: str) -> bool | None:
    return None if text.strip().lower() == "auto" else parse_bool(text)


class DiskTier(Tier):
    scheme = "file"
    OPTIONS = {"size": parse_size, "o_direct": _parse_auto, "fsync": parse_bool, "threads": int, "name": str}
    capabilities = Capabilities(listing=True, touch=True)

    def __init__(
        self,
        path: str | Path,
        size: int | None = None,
        o_direct: bool | None = None,
        fsync: bool = False,
        threads: int = 16,
        name: str = "disk",
        context: TierContext | None = None,
    ) -> None:
        if not size or size <= 0:
            raise ConfigError("a disk tier needs a size, e.g. file:///mnt/nvme/lmtier?size=500GiB")
        if threads < 1:
            raise ConfigError("threads must be at least 1")
        self.root = Path(path)
        self.capacity = size
        self.fsync = fsync
        self.threads = threads
        self.name = name
        self._chunks = self.root / "chunks"
        self._tmp = self.root / "tmp"
        try:
            self._make_dirs()
        except OSError as exc:
            raise ConfigError(f"cannot use {self.root} as a disk tier: {exc}") from exc
        self.o_direct = _supports_o_direct(self._tmp) if o_direct is None else o_direct
        self.index = DiskIndex(str(self.root / "index.sqlite"))
        # Enough idle buffers for a few batched reads in flight (a prompt's worth of chunks
        # read at once), bounded in bytes: fresh buffers cost page faults on every read.
        self._buffers = BufferPool(max_free=256, max_free_bytes=256 << 20)
        self._counter = itertools.count()
        self._nonce_pid = -1
        self._counts = {"stored": 0, "dropped": 0, "evictions": 0, "corrupt": 0, "write_errors": 0}
        self._counts_lock = threading.Lock()
        self._pid = -1
        self.reconcile()
        metrics.TIER_CAPACITY_BYTES.labels(name).set(size)

    @classmethod
    def from_url(cls, url: TierURL, context: TierContext) -> DiskTier:
        if url.netloc not in ("", "localhost") or not url.path.startswith("/"):
            raise ConfigError(f"a disk tier URL names an absolute path: file:///path, got {url.shown!r}")
        return cls(url.path, **url.typed_options(cls.OPTIONS), context=context)

    # -- primitives ---------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> int:
        present = self.index.present([_check_key(k) for k in keys])
        n = 0
        for key in keys:
            if key not in present:
                break
            n += 1
        return n

    def get(self, keys: Sequence[bytes]) -> list[Chunk | None]:
        for key in keys:
            _check_key(key)
        chunks = list(self._pool().map(self._read, keys)) if len(keys) > 1 else [self._read(k) for k in keys]
        now = time.time_ns()
        hits = [(k, now - i) for i, (k, c) in enumerate(zip(keys, chunks, strict=True)) if c is not None]
        misses = [k for k, c in zip(keys, chunks, strict=True) if c is None]
        vanished = [k for k in self.index.present(misses) if not os.path.exists(self._path(k))] if misses else []
        if hits or vanished:
            # Recency is best effort: a read never waits long on another process's write lock
            # (the chunks are read already); a skipped refresh costs only eviction order.
            try:
                with self.index.transaction(wait_s=TOUCH_WAIT_S) as txn:
                    txn.touch(hits)
                    if vanished:  # a crash between unlink and commit: heal the index
                        sizes = txn.sizes(vanished)
                        txn.remove(sizes)
                        txn.set_usage(txn.usage() - sum(sizes.values()))
            except sqlite3.OperationalError as exc:
                log.debug("disk tier %s: recency not refreshed: %s", self.name, exc)
        return chunks

    def put(self, chunks: Sequence[Chunk]) -> None:
        if not chunks:
            return
        for chunk in chunks:
            _check_key(chunk.key)
        order = {chunk.key: i for i, chunk in reversed(list(enumerate(chunks)))}  # first position
        present = self.index.present(list(order))
        todo = [c for c in chunks if c.key not in present]
        if len(todo) > 1:
            written = list(self._pool().map(self._write_temp, todo))
        else:
            written = [self._write_temp(c) for c in todo]
        self._publish([w for w in written if isinstance(w, tuple)], present, order)
        if todo and all(w == "io" for w in written):
            if not self._tmp.is_dir():
                self._rebuild()
            raise TierError(f"disk tier {self.name}: no chunk could be written (see the log)")

    def delete(self, keys: Sequence[bytes]) -> None:
        keys = [_check_key(k) for k in keys]
        with self.index.transaction() as txn:
            sizes = txn.sizes(keys)
            for key in sizes:
                _unlink(self._path(key))
            txn.remove(sizes)
            txn.set_usage(txn.usage() - sum(sizes.values()))

    def close(self) -> None:
        if self._pid == os.getpid():
            self._executor.shutdown(wait=True)
        self._pid = -1
        self.index.close()

    # -- derived ------------------------------------------------------------------------
    def keys(self, prefix: bytes = b"", limit: int | None = None) -> list[bytes]:
        """Keys held that start with ``prefix``, most recently used first."""
        return self.index.keys(prefix, limit)

    @property
    def used_bytes(self) -> int:
        return self.index.usage()

    def stats(self) -> dict[str, Any]:
        return {
            "tier": self.name,
            "path": str(self.root),
            "capacity_bytes": self.capacity,
            "used_bytes": self.index.usage(),
            "chunks": self.index.count(),
            "o_direct": self.o_direct,
            **self._counts,
        }

    def reconcile(self) -> float:
        """Bring the index in line with the files; returns the seconds it took.

        Runs under the index's write lock, so no other process publishes meanwhile.
        """
        start = time.perf_counter()
        with self.index.transaction() as txn:
            rows = self.index.rows()
            on_disk: dict[bytes, tuple[int, int]] = {}
            for sub in os.scandir(self._chunks):
                if not sub.is_dir(follow_symlinks=False):
                    continue
                for entry in os.scandir(sub.path):
                    key = _key_of(entry.name)
                    if key is None or not entry.is_file(follow_symlinks=False):
                        _unlink(entry.path)  # not ours: nothing else lives here
                        continue
                    st = entry.stat(follow_symlinks=False)
                    on_disk[key] = (st.st_size, st.st_mtime_ns)
            gone = [k for k in rows if k not in on_disk]
            txn.remove(gone)
            changed = [
                (k, size, rows[k][1] if k in rows else mtime)
                for k, (size, mtime) in on_disk.items()
                if rows.get(k, (None,))[0] != size
            ]
            txn.add(changed)  # files a crash left unrecorded; their recency is their mtime
            usage = sum(size for size, _ in on_disk.values())
            txn.set_usage(usage)
            self._remove_dead_temporaries()
            if usage > self.capacity:  # reopened with a smaller size
                self._evict(txn, usage - self.capacity, set())
        if changed or gone:
            log.info("disk tier %s: adopted %d files, forgot %d records", self.name, len(changed), len(gone))
        return time.perf_counter() - start

    # -- writing ------------------------------------------------------------------------
    def _write_temp(self, chunk: Chunk) -> tuple[bytes, str, int] | str:
        """Write one chunk's frame under a temporary name.

        Returns ``(key, temporary path, size)``, or why not: ``"io"`` (disk full, directory
        gone, ...) or ``"corrupt"`` (the chunk failed verification on its way in).
        """
        # Unique across processes, hosts and PID namespaces sharing the directory: a pid
        # alone repeats in another container.
        tmp = str(self._tmp / f"{os.getpid()}-{self._nonce()}-{next(self._counter)}.tmp")
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
            return chunk.key, tmp, size
        except IntegrityError:
            self._count("corrupt")  # a damaged chunk from an upper tier is not stored
            outcome = "corrupt"
        except OSError as exc:
            self._count("write_errors")
            metrics.TIER_ERRORS.labels(self.name, "put").inc()
            log.warning("disk tier %s: cannot write %s: %s", self.name, chunk.key.hex()[:16], exc)
            outcome = "io"
        finally:
            if buf is not None:
                self._buffers.release(buf)
        if created:  # never a file of someone else's
            _unlink(tmp)
        return outcome

    def _publish(self, ready: list[tuple[bytes, str, int]], present: set[bytes], order: dict[bytes, int]) -> None:
        """Make written chunks visible within the size bound, in one transaction.

        Chunks that do not fit even after evicting everything evictable are dropped from
        the tail of the batch, so what is stored is always a prefix of it.
        """
        now = time.time_ns()
        dirs: set[str] = set()
        with self.index.transaction() as txn:
            already = txn.sizes([key for key, _, _ in ready])  # another process was faster
            fresh = [r for r in ready if r[0] not in already]
            need = sum(size for _, _, size in fresh)
            while fresh and need > self.capacity:
                need -= fresh.pop()[2]
            held = present | set(already)  # the batch's chunks already stored: refresh, never evict
            txn.touch((k, now - order[k]) for k in held)
            keep = held | {key for key, _, _ in fresh}
            short = self._evict(txn, txn.usage() + need - self.capacity, keep)
            while fresh and short > 0:  # the rest is held by others' unfinished work
                size = fresh.pop()[2]
                need, short = need - size, short - size
            for i, (key, tmp, _) in enumerate(fresh):
                path = self._path(key)
                try:
                    os.rename(tmp, path)
                except OSError as exc:  # our file is gone (a vanished directory): drop the rest
                    log.warning("disk tier %s: cannot publish %s: %s", self.name, key.hex()[:16], exc)
                    need -= sum(size for _, _, size in fresh[i:])
                    fresh = fresh[:i]
                    break
                dirs.add(os.path.dirname(path))
            txn.add((key, size, now - order[key]) for key, _, size in fresh)
            txn.set_usage(txn.usage() + need)
        published = {key for key, _, _ in fresh}
        for key, tmp, _ in ready:
            if key not in published:
                _unlink(tmp)
        if self.fsync:
            for d in dirs:
                _fsync_dir(d)
        dropped = len(ready) - len(already) - len(fresh)
        self._count("stored", len(fresh))
        self._count("dropped", dropped)
        metrics.TIER_OPS.labels(self.name, "put", "stored").inc(len(fresh))
        metrics.TIER_OPS.labels(self.name, "put", "dropped").inc(dropped)
        metrics.TIER_BYTES.labels(self.name, "put").inc(need)
        metrics.TIER_USED_BYTES.labels(self.name).set(self.index.usage())

    def _evict(self, txn, excess: int, keep: set[bytes]) -> int:
        """Evict least recent chunks not in ``keep`` until ``excess`` bytes are freed.

        Returns how many bytes are still missing (0 when enough was freed).
        """
        freed = 0
        while freed < excess:
            victims = txn.oldest(64, keep)
            if not victims:
                break
            taken = []
            for key, size in victims:
                if freed >= excess:
                    break
                _unlink(self._path(key))
                freed += size
                taken.append(key)
            txn.remove(taken)
            self._count("evictions", len(taken))
            metrics.EVICTIONS.labels(self.name).inc(len(taken))
        if freed:
            txn.set_usage(txn.usage() - freed)
        return max(0, excess - freed)

    # -- reading ------------------------------------------------------------------------
    def _read(self, key: bytes) -> Chunk | None:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if self.o_direct else 0))
        except FileNotFoundError:
            return None
        buf = None
        try:
            st = os.fstat(fd)
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
            inode = st.st_ino
            # Verified here, in the I/O thread: hashing releases the GIL, so it runs beside
            # the other reads instead of adding a pass to the reader's copy.
            chunk = codec.decode(
                view[: st.st_size],
                key=key,
                on_release=lambda b=buf: self._buffers.release(b),
                on_corrupt=lambda: self._discard(key, inode),
            )
            buf = None  # the chunk owns it now
            return chunk
        except IntegrityError as exc:
            log.warning("disk tier %s: dropping damaged chunk %s: %s", self.name, key.hex()[:16], exc)
            self._discard(key, os.fstat(fd).st_ino)
            return None
        except OSError as exc:
            metrics.TIER_ERRORS.labels(self.name, "get").inc()
            log.warning("disk tier %s: cannot read %s: %s", self.name, key.hex()[:16], exc)
            return None
        finally:
            os.close(fd)
            if buf is not None:
                self._buffers.release(buf)

    def _discard(self, key: bytes, inode: int) -> None:
        """Remove a damaged file, unless another writer has replaced it meanwhile."""
        self._count("corrupt")
        metrics.INTEGRITY_FAILURES.labels(self.name).inc()
        path = self._path(key)
        with self.index.transaction() as txn:
            try:
                if os.stat(path).st_ino != inode:
                    return
            except FileNotFoundError:
                pass
            _unlink(path)
            sizes = txn.sizes([key])
            txn.remove(sizes)
            txn.set_usage(txn.usage() - sum(sizes.values()))

    # -- helpers ------------------------------------------------------------------------
    def _make_dirs(self) -> None:
        for i in range(256):
            (self._chunks / f"{i:02x}").mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(exist_ok=True)

    def _rebuild(self) -> None:
        """The directory vanished under us (unmounted, deleted): start it again, empty, with
        a fresh index, so that writes work once the path is usable. What was in it is gone;
        reads of it were already misses."""
        log.warning("disk tier %s: %s vanished; starting it again, empty", self.name, self.root)
        try:
            self._make_dirs()
            old, self.index = self.index, DiskIndex(str(self.root / "index.sqlite"))
            old.close()
            self.reconcile()
        except OSError as exc:
            log.warning("disk tier %s: cannot start %s again yet: %s", self.name, self.root, exc)

    def _path(self, key: bytes) -> str:
        name = key.hex()
        return f"{self._chunks}/{name[:2]}/{name}{SUFFIX}"

    def _pool(self) -> ThreadPoolExecutor:
        if self._pid != os.getpid():
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix=f"lmtier-{self.name}")
            self._pid = os.getpid()
        return self._executor

    def _count(self, what: str, n: int = 1) -> None:
        with self._counts_lock:
            self._counts[what] += n

    def _remove_dead_temporaries(self) -> None:
        """Temporary files a crashed writer left. A pid says nothing about a writer in
        another container (PID namespace) or on another host, so age decides: a chunk is
        written and published within seconds, and a file untouched for STALE_TEMP_S is no
        live writer's."""
        cutoff = time.time() - STALE_TEMP_S
        for entry in os.scandir(self._tmp):
            try:
                if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    _unlink(entry.path)
            except FileNotFoundError:
                pass

    def _nonce(self) -> str:
        """Random per process (made anew after fork)."""
        if self._nonce_pid != os.getpid():
            self._nonce_text, self._nonce_pid = secrets.token_hex(6), os.getpid()
        return self._nonce_text


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or not 1 <= len(key) <= 64:
        raise ValueError(f"a chunk key is 1 to 64 bytes, got {key!r:.40}")
    return key


def _key_of(name: str) -> bytes | None:
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


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _supports_o_direct(directory: Path) -> bool:
    probe = directory / f"{os.getpid()}-odirect-probe.tmp"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    os.close(fd)
    _unlink(str(probe))
    return True


__all__ = ["DiskTier"]
