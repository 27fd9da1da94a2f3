"""``DiskTier``: the policy of a disk directory (what is stored, within which bound, what is
evicted, what is copied forward) over its segment files (``files``) and its index
(``index``). See the package docstring for the layout.

    contains / get / put / delete / close    the Tier primitives
    keys(prefix, limit)                      listing (a capability)
    locate(key) -> (path, offset, length)    where a chunk's frame lies (tools, tests)
    reconcile() -> seconds                   bring the index in line with the files

Here the primitives, construction, stats and recovery on open; each path of a primitive
lives with what changes with it: ``write`` how a batch is appended and committed, ``read``
how runs of frames come back, ``segment`` the segment this process appends to, ``space``
eviction, compaction and recovery, ``files`` the bytes, ``index`` the database.
"""

from __future__ import annotations

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

from lmtier import metrics
from lmtier._moved import forward
from lmtier.buffers import ALIGN, round_up
from lmtier.errors import ConfigError, TierError
from lmtier.kv.chunk import Chunk, release_all
from lmtier.tiers.base import Capabilities, Placer, Tier, TierContext, TierURL, parse_bool
from lmtier.tiers.disk.claim import claim
from lmtier.tiers.disk.files import MAX_FRAME, SegmentFiles
from lmtier.tiers.disk.index import DiskIndex
from lmtier.tiers.disk.read import DiskReads
from lmtier.tiers.disk.segment import OwnSegment
from lmtier.tiers.disk.space import Space
from lmtier.tiers.disk.write import DiskWrites
from lmtier.units import format_bytes, parse_size

log = logging.getLogger(__name__)
SEGMENT = 256 << 20  # default segment size (see the package docstring for the measurements)
MIN_SEGMENTS = 16  # a small tier still spreads over this many segments, so eviction stays fine-grained


def _parse_auto(text: str) -> bool | None:
    if text.strip().lower() == "auto":
        return None
    try:
        return parse_bool(text)
    except ValueError:
        raise ValueError(f"expected auto, true or false, got {text!r}") from None


class DiskTier(DiskReads, DiskWrites, Tier):
    scheme = "file"
    OPTIONS = {
        "size": parse_size,
        "o_direct": _parse_auto,
        "fsync": parse_bool,
        "threads": int,
        "name": str,
        "segment": parse_size,
    }
    capabilities = Capabilities(listing=True)  # a read refreshes recency itself: no touch

    def __init__(
        self,
        path: str | Path,
        size: int | None = None,
        o_direct: bool | None = None,
        fsync: bool = False,
        threads: int = 16,
        name: str = "disk",
        segment: int = SEGMENT,
        context: TierContext | None = None,
    ) -> None:
        if not size or size <= 0:
            raise ConfigError("a disk tier needs a size, e.g. file:///mnt/nvme/lmtier?size=500GiB")
        if threads < 1:
            raise ConfigError("threads must be at least 1")
        if segment < ALIGN:
            raise ConfigError(f"segment must be at least {ALIGN} bytes")
        self.root = Path(path)
        self.capacity = size
        self.tenant_prefix = context.tenant_prefix if context else 0  # fair shares: see ``Shares``
        self.threads = threads
        self.name = name
        self.segment_bytes = max(ALIGN, min(segment, round_up(size // MIN_SEGMENTS)))  # see ``OwnSegment``
        try:
            claim(self.root)
            self.files = SegmentFiles(self.root, o_direct, fsync)
        except OSError as exc:
            raise ConfigError(f"cannot use {self.root} as a disk tier: {exc}") from exc
        self.files.max_frame = min(MAX_FRAME, size)  # a frame claiming more is no chunk of this tier's
        self.index = DiskIndex(str(self.root / "index.sqlite"))
        self.own = OwnSegment(self.files, self.segment_bytes, self._rebuild)  # guarded by _write_lock
        self.space = Space(
            self.files,
            self.own,
            capacity=size,
            tenant_prefix=self.tenant_prefix,
            name=name,
            count=self._count,
            announce=self._announce,
        )
        self._counts = {
            "stored": 0,
            "dropped": 0,
            "evictions": 0,
            "corrupt": 0,
            "write_errors": 0,
            "compacted_bytes": 0,
        }
        self._counts_lock = threading.Lock()
        self._write_lock = threading.Lock()  # one append at a time into this process's segment
        self._pid = -1
        self.reconcile()
        metrics.TIER_CAPACITY_BYTES.labels(name).set(size)

    @classmethod
    def from_url(cls, url: TierURL, context: TierContext) -> DiskTier:
        if url.netloc not in ("", "localhost") or not url.path.startswith("/"):
            raise ConfigError(f"a disk tier URL names an absolute path: file:///path, got {url.shown!r}")
        tier = cls(url.path, **url.typed_options(cls.OPTIONS), context=context)
        _warn_if_larger_than_the_disk(tier.root, tier.capacity, tier.used_bytes)
        return tier

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
        return self.get_into(keys, None)

    def get_into(self, keys: Sequence[bytes], place: Placer | None) -> list[Chunk | None]:
        """``get``; with ``place``, a frame whose payload starts on its second page (every
        frame this tier writes, for a payload of whole pages) is read with one ``preadv``
        of [its first page, the placed memory]: the payload lands where ``place`` put it."""
        for key in keys:
            _check_key(key)
        out: list[Chunk | None] = [None] * len(keys)
        try:
            return self._get(keys, out, place)
        except BaseException:
            release_all(out)
            raise

    def put(self, chunks: Sequence[Chunk]) -> None:
        if not chunks:
            return
        for chunk in chunks:
            _check_key(chunk.key)
        n = self.tenant_prefix
        if n and any(c.key[:n] != chunks[0].key[:n] for c in chunks):  # one tenant's share at a time
            by_tenant: dict[bytes, list[Chunk]] = {}
            for chunk in chunks:
                by_tenant.setdefault(chunk.key[:n], []).append(chunk)
            for group in by_tenant.values():
                self.put(group)
            return
        order = {chunk.key: i for i, chunk in reversed(list(enumerate(chunks)))}  # first position
        with self._write_lock:
            present = self.index.present(list(order))
            todo = [c for i, c in enumerate(chunks) if c.key not in present and order[c.key] == i]
            frames, offsets, writer, start, failed = self._append(todo, present | set(order))
            self._commit(frames, offsets, writer, start, present, order)
        if failed:
            with self._write_lock:
                if not self.files.segments.is_dir():
                    self._rebuild()
            raise TierError(f"disk tier {self.name}: no chunk could be written (see the log)")

    def delete(self, keys: Sequence[bytes]) -> None:
        keys = [_check_key(k) for k in keys]
        with self._write_lock, self.index.transaction() as txn:
            where = txn.remove(keys)
            self._announce("removed", list(where))
            self.space.reap(txn, {loc.seg for loc in where.values()})

    def close(self) -> None:
        with self._write_lock:
            writers = [w for w in (self.own.retiring, self.own.writer) if w is not None]
            self.own.writer = self.own.retiring = None
            for writer in writers:
                if writer.pid == os.getpid():
                    try:
                        with self.index.transaction() as txn:
                            self.own.retire(txn, writer)
                    except (sqlite3.Error, OSError) as exc:
                        log.warning("disk tier %s: could not close segment %s: %s", self.name, writer.name, exc)
                writer.close()  # (a forked child only closes its inherited copy)
        if self._pid == os.getpid():
            self._executor.shutdown(wait=True)
        self._pid = -1
        self.index.close()

    def probe(self, key: bytes) -> None:
        """Write, read back and remove a small file in ``tmp/``, and ask the index a
        question: the filesystem and the database answer, and nothing stored is evicted (a
        chunk round trip in a full tier would evict one)."""
        data = os.urandom(ALIGN)
        path = self.files.tmp / f"{os.getpid()}-{secrets.token_hex(6)}-0.tmp"  # a temporary's name
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            if path.read_bytes() != data:
                raise TierError(f"disk tier {self.name} read back other bytes than it wrote to {path}")
        finally:
            path.unlink(missing_ok=True)
        self.index.count()

    # -- derived ------------------------------------------------------------------------
    def keys(self, prefix: bytes = b"", limit: int | None = None) -> list[bytes]:
        """Keys held that start with ``prefix``, most recently used first."""
        return self.index.keys(prefix, limit)

    def locate(self, key: bytes) -> tuple[str, int, int] | None:
        """Where ``key``'s frame lies: (segment path, offset, length), or None."""
        loc = self.index.locate([_check_key(key)]).get(key)
        return None if loc is None else (self.files.path(loc.name), loc.off, loc.len)

    @property
    def o_direct(self) -> bool:
        return self.files.o_direct

    @property
    def used_bytes(self) -> int:
        return self.index.usage()

    def stats(self) -> dict[str, Any]:
        segments, live = self.index.segment_stats()
        return {
            "tier": self.name,
            "path": str(self.root),
            "capacity_bytes": self.capacity,
            "used_bytes": self.index.usage(),
            "live_bytes": live,
            "chunks": self.index.count(),
            "segments": segments,
            "segment_bytes": self.segment_bytes,
            "o_direct": self.o_direct,
            "writes": "o_direct" if self.files.write_direct else "page_cache",
            "reads": self.files.read_mode,  # direct, cache, or resident: by page-cache residency
            **{f"read_bytes_{k}": v for k, v in self.files.read_bytes.items()},
            **self._counts,
        }

    def reconcile(self) -> float:
        """Bring the index in line with the files; returns the seconds it took.

        Runs under the index's write lock, so no other process writes the index meanwhile.
        Segments whose file is gone are forgotten; a dead writer's open segment has the
        complete frames past its last commit adopted and its torn tail cut off; segment
        files the index does not know (a lost index, a writer killed before its first
        commit) are scanned and adopted; anything else in ``segments/`` is not ours and is
        removed; a directory of the one-file-per-chunk layout is migrated.
        """
        start = time.perf_counter()
        with self.index.transaction() as txn:
            adopted, forgotten = self.space.recover(txn)
            migrated = self.space.migrate(txn)
            self.files.remove_dead_temporaries()
            if txn.usage() > self.capacity:  # reopened with a smaller size
                self.space.free(txn, txn.usage() - self.capacity, set(), None, batch=None)
        if adopted or forgotten or migrated:
            log.info(
                "disk tier %s: adopted %d frames, forgot %d segments, migrated %d chunk files",
                self.name, adopted, forgotten, migrated,
            )  # fmt: skip
        return time.perf_counter() - start

    # -- helpers (the read and write paths use them too) --------------------------------
    def _rebuild(self) -> None:
        """The directory vanished under us (unmounted, deleted): start it again, empty, with
        a fresh index, so that writes work once the path is usable. What was in it is gone;
        reads of it were already misses."""
        log.warning("disk tier %s: %s vanished; starting it again, empty", self.name, self.root)
        if self.own.writer is not None:
            self.own.writer.close()
            self.own.writer = None
        try:
            self.files.make_dirs()
            old, self.index = self.index, DiskIndex(str(self.root / "index.sqlite"))
            old.close()
            self.reconcile()
        except (OSError, sqlite3.Error) as exc:
            log.warning("disk tier %s: cannot start %s again yet: %s", self.name, self.root, exc)

    def _pool(self) -> ThreadPoolExecutor:
        if self._pid != os.getpid():
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix=f"lmtier-{self.name}")
            self._pid = os.getpid()
        return self._executor

    def _count(self, what: str, n: int = 1) -> None:
        if n:
            with self._counts_lock:
                self._counts[what] += n


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or not 1 <= len(key) <= 64:
        raise ValueError(f"a chunk key is 1 to 64 bytes, got {key!r:.40}")
    return key


__all__ = ["DiskTier"]

__getattr__ = forward(__name__)  # names of the previous release, found where they live now (CHANGELOG.md)


def _warn_if_larger_than_the_disk(root: Path, size: int, used: int) -> None:
    """A size the filesystem cannot hold is a full disk later (writes then fail, as misses):
    said once, at open, with what it can hold."""
    try:
        disk = os.statvfs(root)
    except OSError:
        return
    room = used + disk.f_bavail * disk.f_frsize
    if size > room:
        log.warning("disk tier %s: size %s is more than its filesystem can give it (%s free, %s held): "
                    "writes will fail once it is full; set size below that", root, format_bytes(size),
                    format_bytes(room - used), format_bytes(used))  # fmt: skip
