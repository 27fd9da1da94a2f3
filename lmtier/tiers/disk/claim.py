"""Which directory a disk tier may take as its own, and which names in it are the tier's:
checked before anything in it is touched (``DiskTier`` calls ``claim`` first), and asked
again wherever the tier removes or adopts a file, so that it never touches a stranger.

    claim(root)              ConfigError unless ``root`` is the tier's to use
    segment_name(name)       a segment's name as ``files`` makes them (anything else is a stranger)
    temporary(name)          a name a writer gives what it makes in tmp/
    legacy_chunk(entry)      a chunk file of the one-file-per-chunk layout
    index_kind(path)         "ours", "unknown", or what the database there is instead
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from lmtier.errors import ConfigError

_NAME = re.compile(r"[0-9]+-[0-9a-f]{12}-[0-9]+\.seg")  # SegmentFiles.new_name's
# what writers leave in tmp/: a segment being made, an O_DIRECT probe, a chunk file of the
# one-file-per-chunk layout being written
_TEMP = re.compile(r"[0-9]+-(?:[0-9a-f]{12}-[0-9]+\.(?:seg|tmp)|odirect-probe\.tmp)")
_LEGACY_DIR = re.compile(r"[0-9a-f]{2}")
_LEGACY_FILE = re.compile(r"(?:[0-9a-f]{2}){1,64}\.lmt")
SUBDIRS = ("segments", "tmp", "chunks")


# what a disk tier writes at the top of its directory
TOP = frozenset(
    {"segments", "tmp", "chunks", "index.sqlite.lock"}
    | {f"index.sqlite{damaged}{suffix}" for damaged in ("", ".damaged") for suffix in ("", "-wal", "-shm", "-journal")}
)


def claim(root: Path) -> None:
    """Refuse (``ConfigError``) a directory a disk tier must not take as its own, before
    anything in it is touched. Its sub-directories must be real directories (a symlinked
    ``segments/`` would lead it elsewhere). The directory is the tier's when its
    ``index.sqlite`` is a disk tier's index (its schema says so); a database of another
    kind there is refused. Without a readable index (none yet, or a damaged one), the
    directory must hold nothing but what the tier writes, at its top and in its
    sub-directories: a mistyped path to a project is refused, never written into."""
    for name in SUBDIRS:
        path = root / name
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise ConfigError(
                f"{path} is a symlink or not a directory: a disk tier keeps only directories of its own there"
            )
    index = root / "index.sqlite"
    if os.path.lexists(index):
        kind = index_kind(index)
        if kind == "ours":
            return
        if kind != "unknown":
            raise ConfigError(f"{index} is not a disk tier's index ({kind}): give the tier a directory of its own")
    strangers = [e.path for e in os.scandir(root) if e.name not in TOP] if root.is_dir() else []
    for name, ours in (("segments", segment_name), ("tmp", temporary)):
        if (root / name).is_dir():
            strangers += [
                e.path for e in os.scandir(root / name) if not (ours(e.name) and e.is_file(follow_symlinks=False))
            ]
    if (root / "chunks").is_dir():
        for sub in os.scandir(root / "chunks"):
            if not (_LEGACY_DIR.fullmatch(sub.name) and sub.is_dir(follow_symlinks=False)):
                strangers.append(sub.path)
                continue
            strangers += [e.path for e in os.scandir(sub.path) if not legacy_chunk(e)]
    if strangers:
        shown = ", ".join(strangers[:3]) + (f" and {len(strangers) - 3} more" if len(strangers) > 3 else "")
        raise ConfigError(
            f"{root} holds files a disk tier did not write ({shown}): give the tier a directory of its own"
        )


def segment_name(name: str) -> bool:
    """Whether a name in segments/ is one a writer of the tier gives its segments."""
    return _NAME.fullmatch(name) is not None


def temporary(name: str) -> bool:
    """Whether a name in tmp/ is one a writer of the tier gives its temporaries."""
    return _TEMP.fullmatch(name) is not None


def legacy_chunk(entry: os.DirEntry) -> bool:
    """Whether an entry under chunks/xx/ is a chunk file of the older layout."""
    return _LEGACY_FILE.fullmatch(entry.name) is not None and entry.is_file(follow_symlinks=False)


def index_kind(path: Path) -> str:
    """ "ours" for a disk tier's index (this schema or the older layout's), "unknown" for an
    empty or unreadable file (a tier that crashed making it, or a damaged one: the rest of
    the directory decides), else what it is instead."""
    import sqlite3
    from urllib.parse import quote

    try:
        conn = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True)
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        finally:
            conn.close()
    except sqlite3.Error:
        return "unknown"
    if not tables:
        return "unknown"
    # this layout's tables, or the one-file-per-chunk layout's (migrated on open); a tier
    # that is making them in another process may not have set the version yet
    if tables <= {"segments", "chunks", "meta", "legacy_chunks"} and tables & {"segments", "chunks"}:
        return "ours"
    return f"a database (schema version {version}) with tables {', '.join(sorted(tables))}"
