"""The segment this process appends to: made when there is none, replaced when it is full,
its file gone, or it is a forked parent's, recorded in the index, and sealed when this
process is done with it. Both the write path (a batch's place) and ``space`` (compaction
copies into it, and removes it once nothing in it is live) use it; the tier's write lock
guards it.

    OwnSegment(files, segment_bytes, rebuild)
      .writer / .retiring                 the open segment; a full one, sealed by the next commit
      .for_batch(need) -> Writer          the open segment, with room for ``need`` more bytes
      .registered(txn) -> Writer          the open segment (made if need be), recorded in the index
      .retire(txn, writer)                seal a segment (or remove it, with nothing live in it)
    recorded(txn, writer) -> Writer       ``writer`` with its row in the index
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from lmtier.tiers.disk.files import SegmentFiles, Writer
from lmtier.tiers.disk.index import Txn


class OwnSegment:
    def __init__(self, files: SegmentFiles, segment_bytes: int, rebuild: Callable[[], None]) -> None:
        self.files = files
        # A segment is closed once the next batch would take it past this size (a batch is
        # never split: one batch, one sequential write).
        self.segment_bytes = segment_bytes
        self.rebuild = rebuild  # the directory vanished under the tier: start it again
        self.writer: Writer | None = None
        self.retiring: Writer | None = None  # full: sealed by the next commit

    def for_batch(self, need: int) -> Writer:
        """This process's open segment, with room for ``need`` more bytes unless it is
        empty; a new one when there is none, it is full, or its file is gone."""
        writer = self.writer
        if writer is not None and (writer.pid != os.getpid() or not _still_there(writer)):
            writer.close()  # a forked child's copy of the parent's, or a file removed under us
            self.writer = writer = None
            if not self.files.segments.is_dir():
                self.rebuild()
        if writer is not None and writer.end and writer.end + need > self.segment_bytes:
            self.retiring = writer
            self.writer = writer = None
        if writer is None:
            writer = self.writer = self.files.create()
        return writer

    def registered(self, txn: Txn) -> Writer:
        """This process's open segment (made if need be), recorded in the index: for
        compactions to copy into."""
        writer = self.writer
        if writer is None or writer.pid != os.getpid() or not _still_there(writer):
            writer = self.for_batch(0)
        return recorded(txn, writer)

    @staticmethod
    def retire(txn: Txn, writer: Writer) -> None:
        """Seal a segment this process will append to no more (removed when nothing in it
        is live); its file is closed, which releases the append lock."""
        seg = txn.segment(writer.id) if writer.id is not None else None
        if seg is None or seg.live == 0:
            if seg is not None:
                txn.drop_segments([seg.id])
            Path(writer.path).unlink(missing_ok=True)
        else:
            writer.truncate(seg.size)  # anything past the last commit is no chunk's
            txn.seal(seg.id)
        writer.close()


def recorded(txn: Txn, writer: Writer) -> Writer:
    """``writer`` with its row in the index (made now if missing: a new segment, or one
    whose row a rolled-back transaction took back, and whose id another may hold now)."""
    seg = txn.segment(writer.id) if writer.id is not None else None
    if seg is None or seg.name != writer.name:
        writer.id = txn.add_segment(writer.name)
    return writer


def _still_there(writer: Writer) -> bool:
    try:
        return os.stat(writer.path).st_ino == os.fstat(writer.fd).st_ino
    except OSError:
        return False
