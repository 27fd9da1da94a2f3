"""The disk tier's index: which chunks a directory holds, their sizes, their recency.

A SQLite database in the tier's directory, shared by every process that opens it. SQLite
gives what several engine processes (and a sidecar) on one node need from one directory:
writers serialize on its lock, so the size bound is checked and updated atomically and
never double-counted; recency survives a restart; and a process killed mid-transaction
leaves the database as it was before the transaction.

The files are the truth, the index a summary of them: ``reconcile`` (run when a tier
opens, under the write lock) brings the index back in line with the files after a crash,
and rebuilds it from the files if the database is lost.

    present(keys) -> set             which keys the index holds
    transaction() -> Txn             BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error)
    Txn.usage() / set_usage(n)       bytes of published chunks
    Txn.add(rows) / remove(keys)     rows of (key, size, atime)
    Txn.oldest(n, exclude)           eviction candidates, least recent first
    Txn.touch(rows)                  new recency for (key, atime)
    count() -> int
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (key BLOB PRIMARY KEY, size INTEGER NOT NULL, atime INTEGER NOT NULL)
    WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS chunks_by_atime ON chunks (atime);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('usage', 0);
"""
_BATCH = 500  # SQLite's bound on host parameters is far above this
log = logging.getLogger(__name__)


class DiskIndex:
    def __init__(self, path: str, busy_timeout_s: float = 60.0, open_timeout_s: float = 10.0) -> None:
        self.path = path
        self._busy_timeout_s = busy_timeout_s
        self._open_timeout_s = open_timeout_s  # past it, an engine's tier opens later (deferred)
        self._pid = -1
        self._lock = threading.RLock()

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
        conn.executescript(f"BEGIN IMMEDIATE; {_SCHEMA} COMMIT;")

    def _replace_damaged(self, exc: sqlite3.DatabaseError) -> sqlite3.Connection:
        """Move a damaged database aside (one copy kept, for a post-mortem) and start an
        empty one, which the tier's ``reconcile`` fills from the files."""
        log.warning("disk index %s is damaged (%s): moved aside, rebuilt from the chunk files", self.path, exc)
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(self.path + suffix):
                os.replace(self.path + suffix, self.path + ".damaged" + suffix)
        conn = sqlite3.connect(self.path, timeout=self._open_timeout_s, isolation_level=None, check_same_thread=False)
        self._set_up(conn)
        return conn

    def present(self, keys: Sequence[bytes]) -> set[bytes]:
        found: set[bytes] = set()
        with self._lock:
            db = self._conn()
            for start in range(0, len(keys), _BATCH):
                part = keys[start : start + _BATCH]
                marks = ",".join("?" * len(part))
                found.update(row[0] for row in db.execute(f"SELECT key FROM chunks WHERE key IN ({marks})", part))
        return found

    def count(self) -> int:
        with self._lock:
            return self._conn().execute("SELECT COUNT(*) FROM chunks").fetchone()[0]

    def usage(self) -> int:
        with self._lock:
            return self._conn().execute("SELECT value FROM meta WHERE name='usage'").fetchone()[0]

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

    def rows(self) -> dict[bytes, tuple[int, int]]:
        with self._lock:
            return {k: (s, a) for k, s, a in self._conn().execute("SELECT key, size, atime FROM chunks")}

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
    """Operations inside one write transaction."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def usage(self) -> int:
        return self._db.execute("SELECT value FROM meta WHERE name='usage'").fetchone()[0]

    def set_usage(self, value: int) -> None:
        self._db.execute("UPDATE meta SET value=? WHERE name='usage'", (value,))

    def sizes(self, keys: Sequence[bytes]) -> dict[bytes, int]:
        out: dict[bytes, int] = {}
        for start in range(0, len(keys), _BATCH):
            part = keys[start : start + _BATCH]
            marks = ",".join("?" * len(part))
            out.update(self._db.execute(f"SELECT key, size FROM chunks WHERE key IN ({marks})", part))
        return out

    def add(self, rows: Iterable[tuple[bytes, int, int]]) -> None:
        self._db.executemany("INSERT OR REPLACE INTO chunks (key, size, atime) VALUES (?, ?, ?)", rows)

    def remove(self, keys: Iterable[bytes]) -> None:
        self._db.executemany("DELETE FROM chunks WHERE key=?", ((k,) for k in keys))

    def touch(self, rows: Iterable[tuple[bytes, int]]) -> None:
        self._db.executemany("UPDATE chunks SET atime=? WHERE key=?", ((a, k) for k, a in rows))

    def oldest(self, n: int, exclude: set[bytes]) -> list[tuple[bytes, int]]:
        """Up to ``n`` least recently used (key, size), skipping ``exclude``."""
        out: list[tuple[bytes, int]] = []
        cursor = self._db.execute("SELECT key, size FROM chunks ORDER BY atime LIMIT ?", (n + len(exclude),))
        for key, size in cursor:
            if key not in exclude:
                out.append((key, size))
                if len(out) == n:
                    break
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
