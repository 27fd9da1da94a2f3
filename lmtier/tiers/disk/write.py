"""The disk tier's write path: a batch appended to this process's segment, room made for
it first within the size bound, then one index transaction that records what fits. Kept
apart from the tier's primitives because these steps change together: the bound is
checked before the write (no byte that could never stay is written) and again, under the
same lock, at the commit (other processes appended meanwhile).

    DiskWrites                 mixed into ``DiskTier``; ``put`` calls, under the write lock:
      ._append(chunks, keep) -> (frames, offsets, writer, start, failed)
      ._commit(frames, offsets, writer, start, present, order)
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import wait

from lmtier import metrics
from lmtier.errors import IntegrityError
from lmtier.kv.chunk import Chunk
from lmtier.tiers.disk.files import Frame, SegmentFiles, Writer
from lmtier.tiers.disk.index import DiskIndex
from lmtier.tiers.disk.segment import OwnSegment, recorded
from lmtier.tiers.disk.space import Space

log = logging.getLogger(__name__)
WRITE_PIECE = 8 << 20  # a batch is written this much per pwritev, its pieces in flight together


class DiskWrites:
    """Appends and commits of ``DiskTier``: one state and one lock with its read path.

    Uses, of the tier: ``index`` (replaced when the directory is rebuilt), ``files``,
    ``space``, ``own`` (the segment it appends to), ``capacity``, ``name``, and its
    ``_pool()``, ``_count()`` and ``_announce()``; the caller holds ``_write_lock``."""

    index: DiskIndex
    files: SegmentFiles
    space: Space
    own: OwnSegment
    capacity: int
    name: str

    def _append(self, chunks: list[Chunk], keep: set[bytes]) -> tuple[list[Frame], list[int], Writer | None, int, bool]:
        """Append the frames of ``chunks``, in batch order, to this process's segment.

        Their sizes are known before they are encoded, so room is made for them first
        (``_make_room``: what cannot fit is not written at all), then the batch's place is
        taken at once and cut into pieces of about ``WRITE_PIECE`` bytes, each encoded and written
        by one ``pwritev`` on the thread pool (copying and hashing release the GIL): a few
        large writes in flight together, the encoding of one piece beside the writing of
        another. A chunk that fails verification (damaged in memory) is counted and its
        place left zeroed (dead bytes a scan steps over). Returns the frames written,
        their offsets, the segment, where the batch starts in it, and whether the disk
        refused (then nothing of the batch is left in the file)."""
        if not chunks:
            return [], [], None, 0, False
        sizes = [self.files.size(c) for c in chunks]
        writer, start = None, 0
        try:
            writer = self.own.for_batch(sum(sizes))
            fit = self._make_room(writer, sizes, keep)
            if fit < len(chunks):
                self._count("dropped", len(chunks) - fit)
                metrics.TIER_OPS.labels(self.name, "put", "dropped").inc(len(chunks) - fit)
                chunks, sizes = chunks[:fit], sizes[:fit]
            if not chunks:
                return [], [], None, 0, False
            pieces, first = [], 0
            for i in range(1, len(chunks) + 1):
                if i == len(chunks) or sum(sizes[first : i + 1]) > WRITE_PIECE:
                    pieces.append((first, i))
                    first = i
            start = writer.end
            offsets = list(itertools.accumulate(sizes[:-1], initial=start))

            def piece(first: int, last: int) -> list[Frame]:
                frames = [self._frame(chunks[k], sizes[k]) for k in range(first, last)]
                try:
                    writer.write_at(frames, offsets[first])
                finally:
                    self.files.release(frames)
                return frames

            if len(pieces) == 1:
                done = [piece(*pieces[0])]
            else:
                futures = [self._pool().submit(piece, a, b) for a, b in pieces]
                wait(futures)  # every write ends before the batch is kept or cut off
                done = [f.result() for f in futures]
            writer.end = start + sum(sizes)
        except OSError as exc:
            self._count("write_errors", len(chunks))
            metrics.TIER_ERRORS.labels(self.name, "put").inc()
            log.warning("disk tier %s: cannot write %d chunks: %s", self.name, len(chunks), exc)
            if writer is not None:
                writer.truncate(start)
            return [], [], writer, start, True
        kept = [(f, off) for f, off in zip((f for d in done for f in d), offsets, strict=True) if f.key]
        if not kept:  # every chunk failed verification: nothing to keep
            writer.truncate(start)
        return [f for f, _ in kept], [off for _, off in kept], writer, start, False

    def _make_room(self, writer: Writer, sizes: list[int], keep: set[bytes]) -> int:
        """Before a batch is written: how many of its leading frames fit within ``size``,
        and room made for them now (evicting and compacting, as ``_commit`` would after
        the write), so that the segment files never outgrow ``size`` by more than what other
        processes append meanwhile (``_commit`` checks the bound again, under the same
        lock, before anything is recorded). A batch larger than the room is cut here: a
        prefix is written, and a full disk is not asked for bytes that could never stay."""
        with self.index.transaction() as txn:
            recorded(txn, writer)
            room = self.space.room(txn, keep, writer)
            fit, total = 0, 0
            while fit < len(sizes) and total + sizes[fit] <= room:
                total += sizes[fit]
                fit += 1
            if total:
                self.space.earn(total)
                short = txn.usage() + writer.end - txn.segment(writer.id).size + total - self.capacity
                if short > 0:
                    short = self.space.free(txn, short, keep, writer, batch=total)
                while short > 0 and fit:  # what could not be freed (a tenant's share): fewer frames
                    fit -= 1
                    short -= sizes[fit]
        return fit

    def _frame(self, chunk: Chunk, size: int) -> Frame:
        """``chunk``'s frame, or zeros in its place when it fails verification."""
        try:
            frame = self.files.frames(chunk)
        except IntegrityError:
            self._count("corrupt")  # a damaged chunk from an upper tier is not stored
            return self.files.filler(size)
        if frame.padded != size:  # cannot happen: encoded_size is the frame's length
            self.files.release([frame])
            return self.files.filler(size)
        return frame

    def _commit(
        self,
        frames: list[Frame],
        offsets: list[int],
        writer: Writer | None,
        start: int,
        present: set[bytes],
        order: dict[bytes, int],
    ) -> None:
        """Record appended frames within the size bound, in one transaction.

        What does not fit even after evicting and compacting all it may is cut off the
        tail of the batch (the file is truncated before anything else is appended), so
        what is stored is always a prefix of it.
        """
        now = time.time_ns()
        try:
            with self.index.transaction() as txn:
                retiring, self.own.retiring = self.own.retiring, None
                if retiring is not None:
                    self.own.retire(txn, retiring)
                already = set(txn.locate([f.key for f in frames])) if frames else set()
                held = present | already  # stored already (by another process, maybe): refresh
                txn.touch((k, now - order[k]) for k in held)
                stored = dropped = 0
                if frames and writer is not None:
                    recorded(txn, writer)
                    keep = held | {f.key for f in frames}
                    room = self.space.room(txn, keep, writer)
                    n = 0  # frames that fit (with the zeroed places among them)
                    while n < len(frames) and offsets[n] + frames[n].padded - start <= room:
                        n += 1
                    if n < len(frames):  # cannot fit: the batch's tail goes
                        writer.truncate(offsets[n] if n else start)
                        dropped = sum(1 for f in frames[n:] if f.key not in already)
                    short = txn.usage() + writer.end - txn.segment(writer.id).size - self.capacity
                    if short > 0:
                        short = self.space.free(txn, short, keep, writer, batch=writer.end - start)
                    if short > 0 and n:  # not all of it could be freed (a tenant's share): cut more
                        cut = n
                        while short > 0 and cut:
                            cut -= 1
                            short -= frames[cut].padded
                        writer.truncate(offsets[cut] if cut else start)
                        dropped += sum(1 for f in frames[cut:n] if f.key not in already)
                        n = cut
                    rows = [
                        (f.key, writer.id, off, f.length, now - order[f.key])
                        for f, off in zip(frames[:n], offsets[:n], strict=True)
                        if f.key not in already
                    ]
                    txn.add(rows)
                    stored = len(rows)
                    txn.resize(writer.id, writer.end)
                    if writer.end >= self.segment_bytes:
                        self.own.retire(txn, writer)
                        self.own.writer = None
        except BaseException:
            if writer is not None and frames:
                writer.truncate(start)  # nothing of this batch was recorded
            raise
        if stored:
            self._announce("stored", [r[0] for r in rows])  # committed
        self._count("stored", stored)
        self._count("dropped", dropped)
        metrics.TIER_OPS.labels(self.name, "put", "stored").inc(stored)
        metrics.TIER_OPS.labels(self.name, "put", "dropped").inc(dropped)
        metrics.TIER_BYTES.labels(self.name, "put").inc(sum(f.length for f in frames if f.key not in already))
        metrics.TIER_USED_BYTES.labels(self.name).set(self.index.usage())
