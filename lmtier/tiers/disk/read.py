"""The disk tier's read path: keys located in the index (no write lock), the frames that
follow each other in a segment read with one ``preadv`` per run (runs in parallel, each
frame into a pooled buffer of its own or into memory an upper tier placed), every frame
verified, and what turned out damaged or vanished dropped from the index afterwards.

    DiskReads                    mixed into ``DiskTier``; ``get_into`` calls
      ._get(keys, out, place) -> out    ``out`` filled, recency refreshed, damage healed
"""

from __future__ import annotations

import itertools
import logging
import os
import sqlite3
import time
from collections.abc import Sequence

from lmtier import metrics
from lmtier.buffers import ALIGN, round_up
from lmtier.errors import IntegrityError
from lmtier.kv import codec
from lmtier.kv.chunk import Chunk
from lmtier.tiers.base import Placement, Placer
from lmtier.tiers.disk.files import SegmentFiles
from lmtier.tiers.disk.index import DiskIndex, Location
from lmtier.tiers.disk.space import Space

log = logging.getLogger(__name__)
TOUCH_WAIT_S = 0.05  # how long a read waits for the index's write lock to refresh recency
READ_PIECE = 8 << 20  # consecutive frames are read this much per preadv, pieces in parallel
READ_FRAMES = 256  # and at most this many frames per preadv


class DiskReads:
    """Reads of ``DiskTier``: one state with its write path, but never its write lock; the
    index's write lock only once the chunks are read (recency, briefly; damage dropped).

    Uses, of the tier: ``index`` (replaced when the directory is rebuilt), ``files``,
    ``space``, ``name``, and its ``_pool()``, ``_count()`` and ``_announce()``."""

    index: DiskIndex
    files: SegmentFiles
    space: Space
    name: str

    def _get(self, keys: Sequence[bytes], out: list[Chunk | None], place: Placer | None) -> list[Chunk | None]:
        locations = self.index.locate(keys)
        if place is not None:  # only the leading run found can be served: place nothing after it
            lead = set(itertools.takewhile(locations.__contains__, keys))
            outer = place
            place = lambda key, nbytes: outer(key, nbytes) if key in lead else None  # noqa: E731
        vanished, corrupt = self._read(keys, locations, out, place=place)
        if vanished:  # moved by a compaction meanwhile, or evicted: look once more
            again = self.index.locate([keys[i] for i in vanished])
            retry = {k: loc for k, loc in again.items() if loc != locations[k]}
            if retry:
                _, more = self._read(keys, retry, out, only=set(vanished), place=place)
                corrupt += more
            gone = {locations[keys[i]].name for i in vanished if keys[i] not in retry}
        else:
            gone = set()
        now = time.time_ns()
        hits = [(k, now - i) for i, (k, c) in enumerate(zip(keys, out, strict=True)) if c is not None]
        if hits:
            # Recency is best effort: a read never waits long on another process's write lock
            # (the chunks are read already); a skipped refresh costs only eviction order.
            try:
                with self.index.transaction(wait_s=TOUCH_WAIT_S) as txn:
                    txn.touch(hits)
            except sqlite3.OperationalError as exc:
                log.debug("disk tier %s: recency not refreshed: %s", self.name, exc)
        if corrupt or gone:
            self._heal(corrupt, gone)
        return out

    def _read(
        self,
        keys: Sequence[bytes],
        locations: dict[bytes, Location],
        out: list[Chunk | None],
        only: set[int] | None = None,
        place: Placer | None = None,
    ) -> tuple[list[int], list[tuple[bytes, Location]]]:
        """Read the chunks at ``locations`` into ``out`` (positions of ``keys``): frames
        that follow each other in a segment come in one preadv. Returns the positions whose
        segment is gone and the (key, location) of damaged frames."""
        wanted = sorted(
            (loc.seg, loc.off, i)
            for i, k in enumerate(keys)
            if (loc := locations.get(k)) is not None and (only is None or i in only)
        )
        runs: list[list[int]] = []
        end, size = -1, 0
        for seg, off, i in wanted:
            loc = locations[keys[i]]
            if runs and (seg, off) == end and size + loc.len <= READ_PIECE and len(runs[-1]) < READ_FRAMES:
                runs[-1].append(i)
                size += round_up(loc.len)
            else:
                runs.append([i])
                size = round_up(loc.len)
            end = (seg, off + round_up(loc.len))

        def one(run: list[int]) -> tuple[list[int], list[tuple[bytes, Location]]]:
            return self._read_run([keys[i] for i in run], [locations[keys[i]] for i in run], run, out, place)

        done = list(self._pool().map(one, runs)) if len(runs) > 1 else [one(r) for r in runs]
        return [i for v, _ in done for i in v], [c for _, cs in done for c in cs]

    def _read_run(
        self,
        keys: list[bytes],
        locs: list[Location],
        positions: list[int],
        out: list[Chunk | None],
        place: Placer | None = None,
    ) -> tuple[list[int], list[tuple[bytes, Location]]]:
        path = self.files.path(locs[0].name)
        places = [_place(place, key, loc.len) for key, loc in zip(keys, locs, strict=True)]
        try:
            views = self.files.read(path, [(loc.off, loc.len) for loc in locs], [p and p.view for p in places])
        except FileNotFoundError:
            _abort(places)
            return positions, []
        except IntegrityError:
            _abort(places)
            return [], list(zip(keys, locs, strict=True))
        except OSError as exc:
            _abort(places)
            metrics.TIER_ERRORS.labels(self.name, "get").inc()
            log.warning("disk tier %s: cannot read %s: %s", self.name, path, exc)
            return [], []
        except BaseException:
            _abort(places)
            raise
        corrupt = []
        plain: list[int] = []  # placed frames whose payload was not on their second page
        for n, (key, loc, i, view, p) in enumerate(zip(keys, locs, positions, views, places, strict=True)):
            if view is None:
                _abort([p])
                corrupt.append((key, loc))
                continue
            buf = view.obj
            try:
                # Verified here, in the I/O thread: hashing releases the GIL, so it runs
                # beside the other reads instead of adding a pass to the reader's copy.
                if p is None:
                    out[i] = codec.decode(view, key=key, on_release=lambda b=buf: self.files.buffers.release(b))
                    continue
                if codec.PREAMBLE.size + codec.header_length(view) != ALIGN:
                    plain.append(n)  # a frame written before frames were aligned
                    p.abort()
                else:
                    head = view[:ALIGN]
                    out[i] = p.commit(codec.decode(head, payload=p.view, key=key))
            except IntegrityError as exc:
                _abort([p])
                log.warning("disk tier %s: dropping damaged chunk %s: %s", self.name, key.hex()[:16], exc)
                corrupt.append((key, loc))
                if p is None:
                    self.files.buffers.release(buf)
            except BaseException:
                _abort([p])
                raise
            finally:
                if p is not None:
                    self.files.buffers.release(buf)
        if plain:
            again = ([keys[n] for n in plain], [locs[n] for n in plain], [positions[n] for n in plain])
            _, more = self._read_run(*again, out)
            corrupt += more
        return [], corrupt

    def _heal(self, corrupt: list[tuple[bytes, Location]], gone: set[str]) -> None:
        """Drop damaged frames (unless the key was stored again elsewhere meanwhile) and
        the index's records of segments whose file has vanished."""
        self._count("corrupt", len(corrupt))
        metrics.INTEGRITY_FAILURES.labels(self.name).inc(len(corrupt))
        try:
            with self.index.transaction() as txn:
                now = txn.locate([k for k, _ in corrupt])
                damaged = [k for k, loc in corrupt if now.get(k) == loc]
                txn.remove(damaged)
                self._announce("removed", damaged)
                segs = {loc.seg for _, loc in corrupt}
                lost = [s.id for s in txn.segments() if s.name in gone and not os.path.exists(self.files.path(s.name))]
                txn.drop_segments(lost)
                self.space.reap(txn, segs - set(lost), own=False)
        except (sqlite3.Error, OSError) as exc:
            log.warning("disk tier %s: cannot drop damaged chunks now: %s", self.name, exc)


def _place(place: Placer | None, key: bytes, length: int) -> Placement | None:
    """Memory for a frame's payload, when it can be read there: the frame is a page of
    preamble and header and whole pages of payload (the view page-aligned, for O_DIRECT)."""
    if place is None or length <= ALIGN or length % ALIGN:
        return None
    p = place(key, length - ALIGN)
    if p is not None and p.view.ctypes.data % ALIGN:
        p.abort()
        return None
    return p


def _abort(places: list[Placement | None]) -> None:
    for p in places:
        if p is not None:
            p.abort()
