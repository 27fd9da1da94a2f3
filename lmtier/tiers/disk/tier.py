"""``DiskTier``: the policy of a disk directory (what is stored, within which bound, what is
evicted, what is copied forward) over its segment files (``files``) and its index
(``index``). See the package docstring for the layout.

    contains / get / put / delete / close    the Tier primitives
    keys(prefix, limit)                      listing (a capability)
    locate(key) -> (path, offset, length)    where a chunk's frame lies (tools, tests)
    reconcile() -> seconds                   bring the index in line with the files

Longer than 400 lines: the tier's put and get each coordinate the segment writer, the
index transaction and the size bound, and they share the recovery state; ``space`` holds
eviction, compaction and recovery, ``files`` the bytes, ``index`` the database.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from lmtier import metrics
from lmtier.buffers import ALIGN, round_up
from lmtier.errors import ConfigError, IntegrityError, TierError
from lmtier.kv import codec
from lmtier.kv.chunk import Chunk, release_all
from lmtier.tiers.base import Capabilities, Placement, Placer, Tier, TierContext, TierURL, parse_bool
from lmtier.tiers.disk.claim import claim
from lmtier.tiers.disk.files import MAX_FRAME, Frame, SegmentFiles, Writer
from lmtier.tiers.disk.index import DiskIndex, Location, Txn
from lmtier.tiers.disk.space import Space
from lmtier.units import parse_size

log = logging.getLogger(__name__)
TOUCH_WAIT_S = 0.05  # how long a read waits for the index's write lock to refresh recency
SEGMENT = 256 << 20  # default segment size (see the package docstring for the measurements)
MIN_SEGMENTS = 16  # a small tier still spreads over this many segments, so eviction stays fine-grained
READ_PIECE = 8 << 20  # consecutive frames are read this much per preadv, pieces in parallel
READ_FRAMES = 256  # and at most this many frames per preadv
WRITE_PIECE = 8 << 20  # a batch is written this much per pwritev, its pieces in flight together


def _parse_auto(text: str) -> bool | None:
    if text.strip().lower() == "auto":
        return None
    try:
        return parse_bool(text)
    except ValueError:
        raise ValueError(f"expected auto, true or false, got {text!r}") from None


class DiskTier(Tier):
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
        # A segment is closed once the next batch would take it past this size (a batch is
        # never split: one batch, one sequential write).
        self.segment_bytes = max(ALIGN, min(segment, round_up(size // MIN_SEGMENTS)))
        try:
            claim(self.root)
            self.files = SegmentFiles(self.root, o_direct, fsync)
        except OSError as exc:
            raise ConfigError(f"cannot use {self.root} as a disk tier: {exc}") from exc
        self.files.max_frame = min(MAX_FRAME, size)  # a frame claiming more is no chunk of this tier's
        self.index = DiskIndex(str(self.root / "index.sqlite"))
        self.space = Space(self)
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
        self._writer: Writer | None = None
        self._retiring: Writer | None = None  # full: sealed by the next commit
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
            writers = [w for w in (self._retiring, self._writer) if w is not None]
            self._writer = self._retiring = None
            for writer in writers:
                if writer.pid == os.getpid():
                    try:
                        with self.index.transaction() as txn:
                            self._retire(txn, writer)
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

    # -- writing ------------------------------------------------------------------------
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
            writer = self._writer_for(sum(sizes))
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
            _recorded(txn, writer)
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

    def _writer_for(self, need: int) -> Writer:
        """This process's open segment, with room for ``need`` more bytes unless it is
        empty; a new one when there is none, it is full, or its file is gone."""
        writer = self._writer
        if writer is not None and (writer.pid != os.getpid() or not _still_there(writer)):
            writer.close()  # a forked child's copy of the parent's, or a file removed under us
            self._writer = writer = None
            if not self.files.segments.is_dir():
                self._rebuild()
        if writer is not None and writer.end and writer.end + need > self.segment_bytes:
            self._retiring = writer
            self._writer = writer = None
        if writer is None:
            writer = self._writer = self.files.create()
        return writer

    def registered_writer(self, txn: Txn) -> Writer:
        """This process's open segment (made if need be), recorded in the index: for
        compactions to copy into."""
        writer = self._writer
        if writer is None or writer.pid != os.getpid() or not _still_there(writer):
            writer = self._writer_for(0)
        return _recorded(txn, writer)

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
                retiring, self._retiring = self._retiring, None
                if retiring is not None:
                    self._retire(txn, retiring)
                already = set(txn.locate([f.key for f in frames])) if frames else set()
                held = present | already  # stored already (by another process, maybe): refresh
                txn.touch((k, now - order[k]) for k in held)
                stored = dropped = 0
                if frames and writer is not None:
                    _recorded(txn, writer)
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
                        self._retire(txn, writer)
                        self._writer = None
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

    def _retire(self, txn: Txn, writer: Writer) -> None:
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

    # -- reading ------------------------------------------------------------------------
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

    # -- helpers ------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """The directory vanished under us (unmounted, deleted): start it again, empty, with
        a fresh index, so that writes work once the path is usable. What was in it is gone;
        reads of it were already misses."""
        log.warning("disk tier %s: %s vanished; starting it again, empty", self.name, self.root)
        if self._writer is not None:
            self._writer.close()
            self._writer = None
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


def _recorded(txn: Txn, writer: Writer) -> Writer:
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


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or not 1 <= len(key) <= 64:
        raise ValueError(f"a chunk key is 1 to 64 bytes, got {key!r:.40}")
    return key


__all__ = ["DiskTier"]
