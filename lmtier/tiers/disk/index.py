"""The disk tier's index: where each chunk lies (segment, offset, length), how recently
it was used, and each segment's bytes, live and in all.

A SQLite database in the tier's directory, shared by every process that opens it. SQLite
gives what several engine processes (and a sidecar) on one node need from one directory:
writers serialize on its lock, so the size bound is checked and updated atomically and
never double-counted; recency survives a restart; readers never wait for a writer (WAL);
and a process killed mid-transaction leaves the database as it was before it. Each
``put`` is one transaction, whatever its number of chunks.

    segments(id, name, size, live, sealed)   size: bytes counted against the bound (the
                                             committed end; frames padded); live: bytes of
                                             the frames still indexed; sealed: no writer
                                             appends to it any more
    chunks(key, seg, off, len, atime)        len: the frame's length, unpadded
    meta('usage')                            the sum of segments.size, kept in step

The segment files are the truth the index summarises: the tier's ``reconcile`` (run when
it opens, under the write lock) brings the index in line with them after a crash, and
rebuilds it from them if the database is lost or damaged. A database of the one-file-per-
chunk layout (schema 1) keeps its rows as ``legacy_chunks`` for the tier to migrate.

    DiskIndex: present(keys) -> set, locate(keys) -> {key: Location}, keys(prefix, limit),
               count(), usage(), transaction(wait_s) -> Txn
    Txn: usage(), locate(keys), segment(id), segments(), add_segment(name, sealed),
         resize(seg, size), seal(seg), drop_segments(ids), add(rows), remove(keys),
         move(rows), oldest(n, exclude), touch(rows), chunks_in(seg), legacy_rows()
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import random
import sqlite3
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

from lmtier.buffers import ALIGN, round_up

SCHEMA_VERSION = 2
_SCHEMA = """
CREATE TABLE IF NOT EXISTS segments (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, size INTEGER NOT NULL, live INTEGER NOT NULL,
    sealed INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS chunks (
    key BLOB PRIMARY KEY, seg INTEGER NOT NULL, off INTEGER NOT NULL, len INTEGER NOT NULL, atime INTEGER NOT NULL)
    WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS chunks_by_atime ON chunks (atime);
CREATE INDEX IF NOT EXISTS chunks_by_seg ON chunks (seg, off);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('usage', 0);
"""
_BATCH = 500  # SQLite's bound on host parameters is far above this
log = logging.getLogger(__name__)


class Location(NamedTuple):
    seg: int
    name: str  # the segment's file name
    off: int
    len: int


class Segment(NamedTuple):
    id: int
    name: str
    size: int
    live: int
    sealed: bool

    @property
    def dead(self) -> int:
        return self.size - self.live


class DiskIndex:
    def __init__(self, path: str, busy_timeout_s: float = 60.0, open_timeout_s: float = 10.0) -> None:
        self.path = path
        self._busy_timeout_s = busy_timeout_s
        self._open_timeout_s = open_timeout_s  # past it, an engine's tier opens later (deferred)
        self._pid = -1
        self._lock = threading.RLock()
        self.rebuilt = False  # the database was damaged and started anew: rebuild from the files

    def _conn(self) -> sqlite3.Connection:
        """One connection per process, made lazily and anew after ``fork``."""
        if self._pid != os.getpid():
            self._db, self._pid = self._open(), os.getpid()
        return self._db

    def _open(self) -> sqlite3.Connection:
        """Connect and set the database up, however many processes open it at once.

        Switching a fresh database to WAL takes SQLite's exclusive lock, and SQLite answers
        "database is locked" to a racing opener without waiting on its busy handler. So
        openers take turns on an advisory lock file beside the database, switch to WAL only
        when the database is not in WAL already, and retry what stays busy until the busy
        timeout has passed.
        """
        deadline = time.monotonic() + self._open_timeout_s
        delay = 0.005
        while True:
            conn = sqlite3.connect(
                self.path, timeout=self._open_timeout_s, isolation_level=None, check_same_thread=False
            )
            try:
                with _turn(self.path + ".lock", deadline):
                    try:
                        self._set_up(conn)
                    except sqlite3.DatabaseError as exc:
                        if isinstance(exc, sqlite3.OperationalError):
                            raise
                        conn.close()  # not a database any more: the files are the truth
                        conn = self._replace_damaged(exc)
                conn.execute(f"PRAGMA busy_timeout={int(self._busy_timeout_s * 1000)}")
                return conn
            except sqlite3.OperationalError as exc:
                conn.close()
                if not _busy(exc) or time.monotonic() + delay > deadline:
                    raise
            except BaseException:
                conn.close()
                raise
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 0.5)

    @staticmethod
    def _set_up(conn: sqlite3.Connection) -> None:
        if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            conn.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
        conn.execute("PRAGMA synchronous=NORMAL")  # consistent after a crash; files are the truth
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version != SCHEMA_VERSION:
                tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                if version == 0 and "chunks" in tables and "legacy_chunks" not in tables:
                    # the one-file-per-chunk layout: its rows (key, size, atime) wait for the tier
                    conn.execute("ALTER TABLE chunks RENAME TO legacy_chunks")
                    conn.execute("DROP INDEX IF EXISTS chunks_by_atime")
                    conn.execute("DROP TABLE IF EXISTS meta")  # its usage counted the old files
                elif version > SCHEMA_VERSION:
                    raise sqlite3.DatabaseError(f"index schema {version} is newer than this lmtier's")
                for statement in _SCHEMA.split(";"):  # not executescript: it would commit first
                    if statement.strip():
                        conn.execute(statement)
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise

    def _replace_damaged(self, exc: sqlite3.DatabaseError) -> sqlite3.Connection:
        """Move a damaged database aside (one copy kept, for a post-mortem) and start an
        empty one, which the tier's ``reconcile`` fills from the files."""
        log.warning("disk index %s is damaged (%s): moved aside, rebuilt from the chunk files", self.path, exc)
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(self.path + suffix):
                os.replace(self.path + suffix, self.path + ".damaged" + suffix)
        conn = sqlite3.connect(self.path, timeout=self._open_timeout_s, isolation_level=None, check_same_thread=False)
        self._set_up(conn)
        self.rebuilt = True
        return conn

    def present(self, keys: Sequence[bytes]) -> set[bytes]:
        with self._lock:
            return set(_select(self._conn(), "SELECT key FROM chunks WHERE key IN ({})", keys))

    def locate(self, keys: Sequence[bytes]) -> dict[bytes, Location]:
        with self._lock:
            return _locate(self._conn(), keys)

    def count(self) -> int:
        with self._lock:
            return self._conn().execute("SELECT COUNT(*) FROM chunks").fetchone()[0]

    def usage(self) -> int:
        with self._lock:
            return self._conn().execute("SELECT value FROM meta WHERE name='usage'").fetchone()[0]

    def segment_stats(self) -> tuple[int, int]:
        """(segments, live bytes)."""
        with self._lock:
            return self._conn().execute("SELECT COUNT(*), COALESCE(SUM(live), 0) FROM segments").fetchone()

    def keys(self, prefix: bytes = b"", limit: int | None = None) -> list[bytes]:
        """Keys starting with ``prefix``, most recently used first."""
        sql, args = "SELECT key FROM chunks WHERE key >= ?", [prefix]
        upper = _after(prefix)
        if upper is not None:
            sql += " AND key < ?"
            args.append(upper)
        sql += " ORDER BY atime DESC"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        with self._lock:
            return [row[0] for row in self._conn().execute(sql, args)]

    @contextmanager
    def transaction(self, wait_s: float | None = None) -> Iterator[Txn]:
        """A write transaction; ``wait_s``: how long to wait for the write lock (default
        the busy timeout), then ``sqlite3.OperationalError``."""
        with self._lock:
            db = self._conn()
            if wait_s is not None:
                db.execute(f"PRAGMA busy_timeout={int(wait_s * 1000)}")
            try:
                db.execute("BEGIN IMMEDIATE")
            finally:
                if wait_s is not None:
                    db.execute(f"PRAGMA busy_timeout={int(self._busy_timeout_s * 1000)}")
            try:
                yield Txn(db)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                self._db.close()
            self._pid = -1


class Txn:
    """Operations inside one write transaction. Sizes move ``meta.usage`` with them, and
    chunks coming and going move their segment's ``live``: the sums stay in step."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def usage(self) -> int:
        return self._db.execute("SELECT value FROM meta WHERE name='usage'").fetchone()[0]

    def locate(self, keys: Sequence[bytes]) -> dict[bytes, Location]:
        return _locate(self._db, keys)

    # -- segments -------------------------------------------------------------------------
    def segment(self, seg: int) -> Segment | None:
        row = self._db.execute("SELECT id, name, size, live, sealed FROM segments WHERE id=?", (seg,)).fetchone()
        return Segment(*row) if row else None

    def segments(self) -> list[Segment]:
        return [Segment(*row) for row in self._db.execute("SELECT id, name, size, live, sealed FROM segments")]

    def add_segment(self, name: str, sealed: bool = False) -> int:
        return self._db.execute(
            "INSERT INTO segments (name, size, live, sealed) VALUES (?, 0, 0, ?)", (name, int(sealed))
        ).lastrowid

    def resize(self, seg: int, size: int) -> None:
        old = self._db.execute("SELECT size FROM segments WHERE id=?", (seg,)).fetchone()[0]
        self._db.execute("UPDATE segments SET size=? WHERE id=?", (size, seg))
        self._add_usage(size - old)

    def seal(self, seg: int) -> None:
        self._db.execute("UPDATE segments SET sealed=1 WHERE id=?", (seg,))

    def drop_segments(self, segs: Iterable[int]) -> int:
        """Forget segments and every chunk in them; returns the bytes they held."""
        segs = list(segs)
        freed = sum(_select(self._db, "SELECT size FROM segments WHERE id IN ({})", segs))
        for start in range(0, len(segs), _BATCH):
            part = segs[start : start + _BATCH]
            marks = ",".join("?" * len(part))
            self._db.execute(f"DELETE FROM chunks WHERE seg IN ({marks})", part)
            self._db.execute(f"DELETE FROM segments WHERE id IN ({marks})", part)
        self._add_usage(-freed)
        return freed

    # -- chunks ---------------------------------------------------------------------------
    def add(self, rows: Sequence[tuple[bytes, int, int, int, int]]) -> None:
        """New rows of (key, seg, off, len, atime), for keys not held yet."""
        self._db.executemany("INSERT INTO chunks (key, seg, off, len, atime) VALUES (?, ?, ?, ?, ?)", rows)
        self._add_live((seg, round_up(n)) for _, seg, _, n, _ in rows)

    def remove(self, keys: Sequence[bytes]) -> dict[bytes, Location]:
        """Forget ``keys``; returns where the forgotten ones lay."""
        where = self.locate(keys)
        self._db.executemany("DELETE FROM chunks WHERE key=?", ((k,) for k in where))
        self._add_live((loc.seg, -round_up(loc.len)) for loc in where.values())
        return where

    def move(self, moves: Sequence[tuple[bytes, Location, int, int]]) -> None:
        """Chunks copied elsewhere: (key, old location, new seg, new offset)."""
        self._db.executemany("UPDATE chunks SET seg=?, off=? WHERE key=?", ((s, o, k) for k, _, s, o in moves))
        self._add_live((old.seg, -round_up(old.len)) for _, old, _, _ in moves)
        self._add_live((seg, round_up(old.len)) for _, old, seg, _ in moves)

    def oldest(self, n: int, exclude: set[bytes]) -> list[tuple[bytes, Location]]:
        """Up to ``n`` least recently used chunks, skipping ``exclude``."""
        return list(itertools.islice(self.by_age(exclude), n))

    def by_age(self, exclude: set[bytes]) -> Iterator[tuple[bytes, Location]]:
        """Every chunk, least recently used first, skipping ``exclude`` (read lazily: a
        caller that stops early reads no further)."""
        rows = self._db.execute(
            "SELECT c.key, c.seg, s.name, c.off, c.len FROM chunks c JOIN segments s ON s.id = c.seg ORDER BY c.atime"
        )
        for key, seg, name, off, length in rows:
            if key not in exclude:
                yield key, Location(seg, name, off, length)

    def usage_by_prefix(self, n: int) -> dict[bytes, int]:
        """Bytes held per leading ``n`` bytes of the keys (per tenant, on the cache server)."""
        unit = ALIGN
        sql = f"SELECT substr(key, 1, ?), SUM((len + {unit - 1}) / {unit} * {unit}) FROM chunks GROUP BY 1"
        return {bytes(prefix): int(total) for prefix, total in self._db.execute(sql, (n,))}

    def touch(self, rows: Iterable[tuple[bytes, int]]) -> None:
        self._db.executemany("UPDATE chunks SET atime=? WHERE key=?", ((a, k) for k, a in rows))

    def chunks_in(self, seg: int) -> list[tuple[bytes, Location]]:
        rows = self._db.execute(
            "SELECT c.key, s.name, c.off, c.len FROM chunks c JOIN segments s ON s.id = c.seg "
            "WHERE c.seg=? ORDER BY c.off",
            (seg,),
        )
        return [(key, Location(seg, name, off, length)) for key, name, off, length in rows]

    # -- the one-file-per-chunk layout ------------------------------------------------------
    def legacy_rows(self) -> dict[bytes, int]:
        """The old index's recency per key (empty when there was none); forgets it."""
        try:
            rows = dict(self._db.execute("SELECT key, atime FROM legacy_chunks"))
        except sqlite3.OperationalError:
            return {}
        self._db.execute("DROP TABLE legacy_chunks")
        return rows

    def _add_usage(self, delta: int) -> None:
        if delta:
            self._db.execute("UPDATE meta SET value = value + ? WHERE name='usage'", (delta,))

    def _add_live(self, deltas: Iterable[tuple[int, int]]) -> None:
        per: dict[int, int] = defaultdict(int)
        for seg, delta in deltas:
            per[seg] += delta
        self._db.executemany("UPDATE segments SET live = live + ? WHERE id=?", ((d, s) for s, d in per.items() if d))


def _select(db: sqlite3.Connection, sql: str, values: Sequence) -> Iterator:
    """``sql`` with ``IN ({})`` filled for ``values``, in batches; yields first columns."""
    for start in range(0, len(values), _BATCH):
        part = values[start : start + _BATCH]
        for row in db.execute(sql.format(",".join("?" * len(part))), part):
            yield row[0]


def _locate(db: sqlite3.Connection, keys: Sequence[bytes]) -> dict[bytes, Location]:
    out: dict[bytes, Location] = {}
    keys = list(dict.fromkeys(keys))
    for start in range(0, len(keys), _BATCH):
        part = keys[start : start + _BATCH]
        marks = ",".join("?" * len(part))
        sql = (
            "SELECT c.key, c.seg, s.name, c.off, c.len FROM chunks c JOIN segments s ON s.id = c.seg "
            f"WHERE c.key IN ({marks})"
        )
        for key, seg, name, off, length in db.execute(sql, part):
            out[key] = Location(seg, name, off, length)
    return out


def _busy(exc: sqlite3.OperationalError) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


@contextmanager
def _turn(path: str, deadline: float) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (made if missing) until the block ends;
    raises ``sqlite3.OperationalError`` ("locked") when it is not ours by ``deadline``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        delay = 0.002
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise sqlite3.OperationalError(f"{path} is locked by another process") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
        yield
    finally:
        os.close(fd)  # releases the lock


def _after(prefix: bytes) -> bytes | None:
    """The smallest byte string greater than every string starting with ``prefix``."""
    trimmed = prefix.rstrip(b"\xff")
    if not trimmed:
        return None
    return trimmed[:-1] + bytes([trimmed[-1] + 1])
