"""``DiskTier``: the policy of a disk directory (what is stored, within which bound, what is
evicted) over its files (``files``) and its index (``index``). See the package docstring.

    contains / get / put / delete / close    the Tier primitives
    keys(prefix, limit), touch(keys)         listing and recency (capabilities)
    reconcile() -> seconds                   bring the index in line with the files
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lmtier import metrics
from lmtier.chunk import Chunk
from lmtier.errors import ConfigError, IntegrityError, TierError
from lmtier.tiers.base import Capabilities, Tier, TierContext, TierURL, parse_bool
from lmtier.tiers.disk.files import ChunkFiles, fsync_dir
from lmtier.tiers.disk.index import DiskIndex
from lmtier.units import parse_size

log = logging.getLogger(__name__)
TOUCH_WAIT_S = 0.05  # how long a read waits for the index's write lock to refresh recency


def _parse_auto(text: str) -> bool | None:
    return None if text.strip().lower() == "auto" else parse_bool(text)


class DiskTier(Tier):
    scheme = "file"
    OPTIONS = {"size": parse_size, "o_direct": _parse_auto, "fsync": parse_bool, "threads": int, "name": str}
    capabilities = Capabilities(listing=True)  # a read refreshes recency itself: no touch

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
        self.threads = threads
        self.name = name
        try:
            self.files = ChunkFiles(self.root, o_direct, fsync)
        except OSError as exc:
            raise ConfigError(f"cannot use {self.root} as a disk tier: {exc}") from exc
        self.index = DiskIndex(str(self.root / "index.sqlite"))
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
        vanished = [k for k in self.index.present(misses) if not os.path.exists(self.files.path(k))] if misses else []
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
            if not self.files.tmp.is_dir():
                self._rebuild()
            raise TierError(f"disk tier {self.name}: no chunk could be written (see the log)")

    def delete(self, keys: Sequence[bytes]) -> None:
        keys = [_check_key(k) for k in keys]
        with self.index.transaction() as txn:
            sizes = txn.sizes(keys)
            for key in sizes:
                Path(self.files.path(key)).unlink(missing_ok=True)
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
    def o_direct(self) -> bool:
        return self.files.o_direct

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
            on_disk = self.files.scan()
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
            self.files.remove_dead_temporaries()
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
        try:
            tmp, size = self.files.write_temp(chunk)
        except IntegrityError:
            self._count("corrupt")  # a damaged chunk from an upper tier is not stored
            return "corrupt"
        except OSError as exc:
            self._count("write_errors")
            metrics.TIER_ERRORS.labels(self.name, "put").inc()
            log.warning("disk tier %s: cannot write %s: %s", self.name, chunk.key.hex()[:16], exc)
            return "io"
        return chunk.key, tmp, size

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
                path = self.files.path(key)
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
                Path(tmp).unlink(missing_ok=True)
        if self.files.fsync:
            for d in dirs:
                fsync_dir(d)
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
                Path(self.files.path(key)).unlink(missing_ok=True)
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
        try:
            return self.files.read(key, on_corrupt=lambda inode: self._discard(key, inode))
        except IntegrityError as exc:
            log.warning("disk tier %s: dropping damaged chunk %s: %s", self.name, key.hex()[:16], exc)
            self._discard(key, exc.inode)  # type: ignore[attr-defined]
            return None
        except OSError as exc:
            metrics.TIER_ERRORS.labels(self.name, "get").inc()
            log.warning("disk tier %s: cannot read %s: %s", self.name, key.hex()[:16], exc)
            return None

    def _discard(self, key: bytes, inode: int) -> None:
        """Remove a damaged file, unless another writer has replaced it meanwhile."""
        self._count("corrupt")
        metrics.INTEGRITY_FAILURES.labels(self.name).inc()
        path = Path(self.files.path(key))
        with self.index.transaction() as txn:
            try:
                if path.stat().st_ino != inode:
                    return
            except FileNotFoundError:
                pass
            path.unlink(missing_ok=True)
            sizes = txn.sizes([key])
            txn.remove(sizes)
            txn.set_usage(txn.usage() - sum(sizes.values()))

    # -- helpers ------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """The directory vanished under us (unmounted, deleted): start it again, empty, with
        a fresh index, so that writes work once the path is usable. What was in it is gone;
        reads of it were already misses."""
        log.warning("disk tier %s: %s vanished; starting it again, empty", self.name, self.root)
        try:
            self.files.make_dirs()
            old, self.index = self.index, DiskIndex(str(self.root / "index.sqlite"))
            old.close()
            self.reconcile()
        except OSError as exc:
            log.warning("disk tier %s: cannot start %s again yet: %s", self.name, self.root, exc)

    def _pool(self) -> ThreadPoolExecutor:
        if self._pid != os.getpid():
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix=f"lmtier-{self.name}")
            self._pid = os.getpid()
        return self._executor

    def _count(self, what: str, n: int = 1) -> None:
        with self._counts_lock:
            self._counts[what] += n


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or not 1 <= len(key) <= 64:
        raise ValueError(f"a chunk key is 1 to 64 bytes, got {key!r:.40}")
    return key


__all__ = ["DiskTier"]
