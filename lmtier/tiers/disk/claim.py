"""Which directory a disk tier may take as its own: checked before anything in it is
touched (``DiskTier`` calls ``claim`` first).

    claim(root)       ConfigError unless ``root`` is the tier's to use
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from lmtier.errors import ConfigError
from lmtier.tiers.disk.files import segment_name

# what writers leave in tmp/: a segment being made, an O_DIRECT probe, a chunk file of the
# one-file-per-chunk layout being written
_TEMP = re.compile(r"[0-9]+-(?:[0-9a-f]{12}-[0-9]+\.(?:seg|tmp)|odirect-probe\.tmp)")
_LEGACY_DIR = re.compile(r"[0-9a-f]{2}")
_LEGACY_FILE = re.compile(r"(?:[0-9a-f]{2}){1,64}\.lmt")
SUBDIRS = ("segments", "tmp", "chunks")


def claim(root: Path) -> None:
    """Refuse (``ConfigError``) a directory a disk tier must not take as its own, before
    anything in it is touched: the tier removes what it does not recognise in its
    sub-directories, so they must be real directories (a symlinked ``segments/`` would
    lead it elsewhere), and a directory without the tier's index must hold nothing but
    what the tier writes (a segment file, a temporary, a chunk file of the older layout):
    a mistyped path to a project that happens to have a ``tmp/`` is refused, not emptied.
    With the index there (or a damaged one), the directory is the tier's, and a stranger
    in a sub-directory is removed (unlinked, never followed)."""
    for name in SUBDIRS:
        path = root / name
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise ConfigError(
                f"{path} is a symlink or not a directory: a disk tier keeps only directories of its own there"
            )
    if os.path.lexists(root / "index.sqlite"):
        return
    strangers = []
    for name, ours in (("segments", segment_name), ("tmp", _TEMP.fullmatch)):
        if (root / name).is_dir():
            strangers += [
                e.path for e in os.scandir(root / name) if not (ours(e.name) and e.is_file(follow_symlinks=False))
            ]
    if (root / "chunks").is_dir():
        for sub in os.scandir(root / "chunks"):
            if not (_LEGACY_DIR.fullmatch(sub.name) and sub.is_dir(follow_symlinks=False)):
                strangers.append(sub.path)
                continue
            strangers += [
                e.path
                for e in os.scandir(sub.path)
                if not (_LEGACY_FILE.fullmatch(e.name) and e.is_file(follow_symlinks=False))
            ]
    if strangers:
        shown = ", ".join(strangers[:3]) + (f" and {len(strangers) - 3} more" if len(strangers) > 3 else "")
        raise ConfigError(
            f"{root} holds files a disk tier did not write ({shown}): give the tier a directory of its own"
        )
