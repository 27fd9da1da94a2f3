"""Room on a disk-tier directory: how much a put may add, what is evicted and what is
copied forward to make that room, and what crashes and the older layout left behind.
Everything here runs inside one of the tier's index transactions (under its write lock).

    Space(files, own, capacity, tenant_prefix, name, count, announce)
      .room(txn, keep, writer) -> int         the most bytes a put may add now
      .earn(nbytes)                           a put's credit for copying forward
      .free(txn, short, keep, writer, batch)  evict and reclaim until ``short`` more bytes are free
                                              (where tenants share the tier, by ``shares``)
      .reap(txn, segs, own)                   remove segments nothing live is left in
      .recover(txn) -> (adopted, forgotten)   the index in line with the segment files
      .migrate(txn) -> int                    the one-file-per-chunk layout, adopted

Eviction is least-recently-used per chunk, as the index's recency orders it (a batch's
first chunk is its most recent, so a prompt loses its tail first, and every prompt keeps a
prefix of its chunks). Space comes back per segment: a segment with nothing live left is
deleted; one with some live chunks left is compacted (its live chunks are copied forward
into the writer's segment, then it is deleted), cheapest first (the least live per byte).
Copying is bounded: over time a process copies at most ``COMPACT_RATIO`` bytes forward
per byte it stores; where its credit would not make the room, more least-recent chunks
are evicted instead, which makes segments cheaper to reclaim (the measurements behind the
ratio are in docs/architecture.md, "The disk tier").
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from lmtier import metrics
from lmtier.buffers import round_up
from lmtier.errors import ConfigError
from lmtier.kv import codec
from lmtier.tiers.disk.claim import legacy_chunk, segment_name
from lmtier.tiers.disk.files import MAX_FRAME, Frame, SegmentFiles, Writer
from lmtier.tiers.disk.index import Location, Segment, Txn
from lmtier.tiers.disk.segment import OwnSegment
from lmtier.tiers.disk.shares import Shares

log = logging.getLogger(__name__)
COMPACT_RATIO = 0.5  # bytes compaction may copy forward per byte stored, over time
CREDIT_PUTS = 4  # see ``Space.earn``
COPY_PIECE = 32 << 20  # a compaction copies this much at a time (memory it holds)
LEGACY_SUFFIX = ".lmt"  # chunks/<byte>/<hex key>.lmt: one file per chunk (lmtier before segments)


class Space:
    def __init__(
        self,
        files: SegmentFiles,
        own: OwnSegment,
        *,
        capacity: int,
        tenant_prefix: int,
        name: str,
        count: Callable[[str, int], None],
        announce: Callable[[str, Sequence[bytes]], None],
    ) -> None:
        """``own``: this process's segment (never reclaimed while open; compactions copy
        into it). ``count`` and ``announce``: the tier's counters and its listener."""
        self.files = files
        self.own = own
        self.capacity = capacity
        self.tenant_prefix = tenant_prefix
        self.name = name
        self.count = count
        self.announce = announce
        self.credit = 0.0  # bytes compaction may still copy (see ``free``)

    # -- room for a put -------------------------------------------------------------------
    def reclaimable(self, txn: Txn, writer: Writer | None) -> list[Segment]:
        """Segments no live writer appends to: sealed ones, and a dead writer's (whose
        uncommitted tail is cut off, and which is sealed now)."""
        own = self.own.writer
        out = []
        for seg in txn.segments():
            if (writer is not None and seg.id == writer.id) or (own is not None and seg.id == own.id):
                continue
            if not seg.sealed:
                path = self.files.path(seg.name)
                if self.files.owner_alive(path):
                    continue
                _truncate(path, seg.size)
                txn.seal(seg.id)
            out.append(seg)
        return out

    def room(self, txn: Txn, keep: set[bytes], writer: Writer | None) -> int:
        """What is free, plus all that evicting and compacting could free: every
        reclaimable segment, less the batch's own chunks in them (those are copied)."""
        segs = self.reclaimable(txn, writer)
        ids = {s.id for s in segs}
        kept = sum(round_up(loc.len) for loc in txn.locate(list(keep)).values() if loc.seg in ids)
        return max(0, self.capacity - txn.usage() + sum(s.size for s in segs) - kept)

    def earn(self, nbytes: int) -> None:
        """A put of ``nbytes``: credit for ``COMPACT_RATIO`` times as many bytes of copying,
        kept up to a segment's worth (or four such puts', in a tier of tiny segments),
        which bounds what one put may copy."""
        cap = math.inf if math.isinf(COMPACT_RATIO) else max(self.own.segment_bytes, CREDIT_PUTS * nbytes)
        self.credit = min(self.credit + COMPACT_RATIO * nbytes, cap)  # inf: exact LRU, whatever it copies

    def free(self, txn: Txn, short: int, keep: set[bytes], writer: Writer | None, batch: int | None) -> int:
        """Make ``short`` more bytes free: evict least recent chunks (never ``keep``) just
        until the dead bytes of reclaimable segments cover ``short``, then reclaim
        segments cheapest first, copying forward no more than the credit puts earn
        (``earn``; more chunks are evicted where that is not enough): over time this
        process copies at most ``COMPACT_RATIO`` of what it stores, and a small put may
        still spend what earlier ones left. ``batch`` None (a reopen): no limit. Where
        tenants share the tier, only chunks ``Shares`` allows are evicted. Returns what is
        still short (the caller stores less)."""
        segs = {s.id: [s.size, s.live] for s in self.reclaimable(txn, writer)}
        shares = Shares.of(txn, self.tenant_prefix, self.capacity, keep, batch or 0)
        budget = float("inf") if batch is None else self.credit  # a reopen (None) copies what it must
        if shares is not None:
            # Tenants: evict what the chunks themselves take over the capacity, by the
            # shares' rule, and compact whatever that costs: evicting more to spare copying
            # would take it from whoever the rule allows, not from whoever is least recent.
            over = sum(shares.usage.values()) + shares.incoming - self.capacity
            if over > 0:
                victims = self._victims(txn, 1 << 30, over, keep, shares)
                if victims:
                    self._evict(txn, victims, segs)
            budget = float("inf")
        copied = 0
        while short > 0:
            empty = [sid for sid, (_, live) in segs.items() if live <= 0]
            if empty:  # nothing live: free, no copy
                for sid in empty:
                    short -= self._reclaim(txn, sid, writer)[0]
                    del segs[sid]
                continue
            plan, dead, cost = self._plan(segs, short)
            if dead >= short and copied + cost <= budget:
                for sid in plan:
                    freed, moved = self._reclaim(txn, sid, writer)
                    short, copied = short - freed, copied + moved
                    del segs[sid]
                continue
            # evict at least what no compaction can find yet, else a few chunks more
            want = max(short - sum(size - live for size, live in segs.values()), 1)
            victims = self._victims(txn, max(8, want // (256 << 10) + 1), want, keep, shares)
            if victims:
                self._evict(txn, victims, segs)
                continue
            if not plan:
                break
            for sid in plan:  # nothing left to evict: compact whatever it costs
                freed, moved = self._reclaim(txn, sid, writer)
                short, copied = short - freed, copied + moved
                del segs[sid]
        if batch is not None:
            self.credit -= copied  # spent (overdrawn when nothing was left to evict: repaid later)
        return max(short, 0)

    @staticmethod
    def _victims(txn: Txn, count: int, want: int, keep: set[bytes], shares: Shares | None) -> list:
        """Up to ``count`` chunks to evict, least recent first, until ``want`` bytes."""
        victims, got = [], 0
        candidates = txn.oldest(count, keep) if shares is None else shares.candidates(txn, keep)
        for key, loc in candidates:
            victims.append((key, loc))
            got += round_up(loc.len)
            if shares is not None:
                shares.taken(key, round_up(loc.len))
            if got >= want or len(victims) >= count:
                break
        return victims

    def reap(self, txn: Txn, segs: set[int], own: bool = True) -> None:
        """Remove the segments of ``segs`` with nothing live left in them that no live
        writer appends to; ``own``: this process's open one too (the caller holds the
        tier's write lock)."""
        writer = self.own.writer
        for sid in segs:
            seg = txn.segment(sid)
            if seg is None or seg.live > 0:
                continue
            if writer is not None and sid == writer.id:
                if own:
                    self.own.writer = None
                    writer.close()
                    _unlink(self.files.path(seg.name))
                    txn.drop_segments([sid])
                continue
            if seg.sealed or not self.files.owner_alive(self.files.path(seg.name)):
                _unlink(self.files.path(seg.name))
                txn.drop_segments([sid])

    @staticmethod
    def _plan(segs: dict[int, list[int]], short: int) -> tuple[list[int], int, int]:
        """Segments to reclaim, cheapest (least live per byte) first, until their dead
        bytes cover ``short``: (ids, dead bytes, live bytes to copy)."""
        plan, dead, cost = [], 0, 0
        for sid, (size, live) in sorted(segs.items(), key=lambda kv: kv[1][1] / max(kv[1][0], 1)):
            if size - live <= 0:
                continue
            plan.append(sid)
            dead, cost = dead + size - live, cost + live
            if dead >= short:
                break
        return plan, dead, cost

    def _evict(self, txn: Txn, victims: list[tuple[bytes, Location]], segs: dict[int, list[int]]) -> None:
        txn.remove([key for key, _ in victims])
        self.announce("removed", [key for key, _ in victims])  # before the commit: never late
        for _, loc in victims:
            if loc.seg in segs:
                segs[loc.seg][1] -= round_up(loc.len)
        self.count("evictions", len(victims))
        metrics.EVICTIONS.labels(self.name).inc(len(victims))

    def _reclaim(self, txn: Txn, sid: int, writer: Writer | None) -> tuple[int, int]:
        """Copy a segment's live chunks forward and delete it: (bytes freed, copied)."""
        seg = txn.segment(sid)
        if seg is None:
            return 0, 0
        live = txn.chunks_in(sid)
        copied = 0
        if live:
            writer = writer or self.own.registered(txn)
            path = self.files.path(seg.name)
            piece: list[tuple[bytes, Location]] = []
            for item in live:
                piece.append(item)
                if sum(round_up(loc.len) for _, loc in piece) >= COPY_PIECE or item is live[-1]:
                    copied += self._copy(txn, path, piece, writer)
                    piece = []
        _unlink(self.files.path(seg.name))  # before the commit: the index never outlives a file
        txn.drop_segments([sid])
        self.count("compacted_bytes", copied)
        return seg.size - copied, copied

    def _copy(self, txn: Txn, path: str, piece: list[tuple[bytes, Location]], writer: Writer) -> int:
        """Append frames of ``piece`` (consecutive in ``path``) to ``writer``, as they are:
        frames carry no position. Frames that cannot be read are forgotten."""
        runs: list[list[tuple[bytes, Location]]] = []
        for key, loc in piece:
            if runs and runs[-1][-1][1].off + round_up(runs[-1][-1][1].len) == loc.off:
                runs[-1].append((key, loc))
            else:
                runs.append([(key, loc)])
        frames, moves, lost = [], [], []
        try:
            for run in runs:
                try:
                    views = self.files.read(path, [(loc.off, loc.len) for _, loc in run])
                except (OSError, ValueError):
                    lost += [key for key, _ in run]
                    continue
                for (key, loc), view in zip(run, views, strict=True):
                    if view is None:
                        lost.append(key)
                        continue
                    buf = view.obj
                    buf[loc.len : round_up(loc.len)] = bytes(round_up(loc.len) - loc.len)
                    frames.append(Frame(key, loc.len, [memoryview(buf)[: round_up(loc.len)]], buf))
                    moves.append((key, loc))
            if frames:
                offsets = writer.append(frames)
                txn.move([(key, loc, writer.id, off) for (key, loc), off in zip(moves, offsets, strict=True)])
                txn.resize(writer.id, writer.end)
        finally:
            self.files.release(frames)
        txn.remove(lost)
        self.announce("removed", lost)
        return sum(f.padded for f in frames)

    # -- after a crash, a lost index, an older layout ----------------------------------------
    def recover(self, txn: Txn) -> tuple[int, int]:
        """Bring the index in line with ``segments/`` (see ``DiskTier.reconcile``)."""
        known = {s.name: s for s in txn.segments()}
        on_disk: dict[str, os.DirEntry] = {}
        if self.files.segments.is_symlink():  # replaced since the tier claimed it: never follow it
            raise ConfigError(f"{self.files.segments} became a symlink: the disk tier will not follow it")
        for entry in os.scandir(self.files.segments):
            if segment_name(entry.name) and entry.is_file(follow_symlinks=False):
                on_disk[entry.name] = entry  # anything else is left as it is, and ignored
        gone = [s.id for name, s in known.items() if name not in on_disk]
        txn.drop_segments(gone)
        adopted = 0
        for name, entry in on_disk.items():
            seg = known.get(name)
            if (seg is not None and seg.sealed) or self.files.owner_alive(entry.path):
                continue
            adopted += self._adopt(txn, entry, seg)
        return adopted, len(gone)

    def _adopt(self, txn: Txn, entry: os.DirEntry, seg: Segment | None) -> int:
        """A dead writer's segment: adopt its good frames past the last commit (all of it
        when the index never knew it), cut its torn tail off, and seal it."""
        start = seg.size if seg is not None else 0
        # a tail past the last commit may be torn anywhere: check payloads too; a whole
        # unknown file (a lost index) only by headers, for speed: reads verify the rest
        found, end = self.files.scan(entry.path, start, verify=seg is not None)
        held = txn.locate([key for key, _, _ in found])
        mtime = entry.stat(follow_symlinks=False).st_mtime_ns
        rows = []
        for i, (key, off, length) in enumerate(found):
            if key not in held:
                held[key] = Location(0, "", off, length)  # a key twice in one file: the first
                rows.append((key, off, length, mtime - i))
        sid = seg.id if seg is not None else txn.add_segment(entry.name)
        if os.stat(entry.path).st_size > end:
            _truncate(entry.path, end)
        txn.add([(key, sid, off, length, atime) for key, off, length, atime in rows])
        txn.resize(sid, max(end, start))
        txn.seal(sid)
        self.reap(txn, {sid}, own=False)
        return len(rows)

    def migrate(self, txn: Txn) -> int:
        """Adopt the chunk files of the one-file-per-chunk layout: each file is one frame,
        so it becomes a segment of one frame by a rename (no copy), with the recency the
        old index gave it. Anything else under ``chunks/`` is left as it is."""
        atimes = txn.legacy_rows()
        old = self.files.root / "chunks"
        if not old.is_dir():
            return 0
        moved = 0
        for sub in os.scandir(old):
            if not sub.is_dir(follow_symlinks=False):
                continue  # not the older layout's: left as it is
            for entry in os.scandir(sub.path):
                key = _legacy_key(entry.name)
                if key is None or not legacy_chunk(entry):
                    continue  # not a chunk file: left as it is
                size = entry.stat(follow_symlinks=False).st_size
                if not codec.PREAMBLE.size <= size <= MAX_FRAME or txn.locate([key]):
                    _unlink(entry.path)  # a chunk file that cannot be one, or one adopted already
                    continue
                name = self.files.new_name()
                os.rename(entry.path, self.files.path(name))
                _truncate(self.files.path(name), round_up(size))  # padded as every frame is (a hole)
                sid = txn.add_segment(name, sealed=True)
                txn.add([(key, sid, 0, size, atimes.get(key, entry.stat().st_mtime_ns))])
                txn.resize(sid, round_up(size))
                moved += 1
            _rmdir(sub.path)  # once empty: what is not ours stays, with its directory
        _rmdir(str(old))
        return moved


def _legacy_key(name: str) -> bytes | None:
    stem = name.removesuffix(LEGACY_SUFFIX)
    if stem == name or len(stem) % 2 or not 2 <= len(stem) <= 128:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


def _rmdir(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _unlink(path: str) -> None:
    try:
        Path(path).unlink(missing_ok=True)
    except OSError as exc:  # a stranger we may not remove (immutable, another owner's): left, ignored
        log.warning("disk tier: cannot remove %s: %s", path, exc)


def _truncate(path: str, size: int) -> None:
    try:
        os.truncate(path, size)
    except OSError:
        pass  # gone already, or not ours to shorten: the index never points past ``size``
