"""The grpc tier's same-host data plane: its own shared-memory segment, and the server's
memory that it reads chunks from where they lie.

    SharedMemory(wanted, directory, size, slot_bytes, tier)
        segment() -> Segment | None           this process's segment, made on first use
                                              (its memory reserved as it grows);
                                              None while shared memory is off
        refused(detail)                       the server cannot use it: off for a minute,
                                              or for good when the server never will
        server_region(region) -> memoryview   a payload in the server's memory, read-only,
                                              its pages mapped in
        in_use -> str | None                  the segment's name while it is used (stats)
        published -> DirectoryReader | None   the server's published directory, while its
                                              server beats (``lmtier.transport.directory``)
        attach(name) / detach()               map the directory the server named / forget it
        forget(), close()                     after ``fork`` / at the end
    NoShm                                     a call's shared memory was refused: make the
                                              call again without it

This is protocol, not failure policy: a server on another host answers
``FAILED_PRECONDITION`` to a call that names our segment, and the tier makes the same call
again over plain gRPC at once (``GrpcTier._rpc``). Nothing here retries a failed call.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from lmtier.buffers import populate_read
from lmtier.errors import LmtierError
from lmtier.transport.directory import DirectoryReader
from lmtier.transport.pieces import Region
from lmtier.transport.shm.access import SegmentMaps, SegmentUnavailable
from lmtier.transport.shm.segment import Segment

log = logging.getLogger(__name__)

RETRY_S = 60.0  # a server that could not see our segment is asked again after this long
SERVER_MAPS = 4  # server segments kept mapped at once


class NoShm(Exception):
    """The server cannot see our segment (or we cannot see its memory): call again without it."""


class SharedMemory:
    def __init__(self, wanted: bool, directory: str, size: int, slot_bytes: int, tier: str) -> None:
        self.wanted = wanted
        self.directory, self.size, self.slot_bytes, self.tier = directory, size, slot_bytes, tier
        self._off_until = 0.0
        self._segment: Segment | None = None
        self._server_maps: SegmentMaps | None = None
        self._directory: DirectoryReader | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def segment(self) -> Segment | None:
        if not self.wanted or time.monotonic() < self._off_until:
            return None
        if self._segment is None:
            with self._lock:
                if self._segment is None and self.wanted:
                    try:
                        self._segment = Segment(self.directory, self.size, self.slot_bytes, grow=True)
                    except (OSError, LmtierError) as exc:
                        log.warning("grpc tier %s: no shared-memory segment (%s); using plain gRPC", self.tier, exc)
                        self.wanted = False
        return self._segment if self.wanted else None

    def refused(self, detail: str) -> None:
        if "turned off" in detail or "several tenants" in detail:  # by design: it never will
            log.info("grpc tier %s: the server refuses shared memory (%s); plain gRPC", self.tier, detail)
            with self._lock:
                self.wanted = False
                segment, self._segment = self._segment, None
            if segment is not None:
                segment.close()  # nothing of ours stays in the segment directory
            return
        log.info("grpc tier %s: the server cannot use our shared memory (%s); plain gRPC for now", self.tier, detail)
        self._off_until = time.monotonic() + RETRY_S

    def server_region(self, region: Region) -> memoryview:
        if self._server_maps is None:
            self._server_maps = SegmentMaps(self.directory, limit=SERVER_MAPS)
        try:
            view = self._server_maps.region(region.segment, region.offset, region.length)
        except SegmentUnavailable as exc:
            raise NoShm(str(exc)) from exc
        populate_read(view)  # map its pages here, in the reading thread, not in the caller's copy
        return view

    @property
    def published(self) -> DirectoryReader | None:
        reader = self._directory
        if reader is not None and not reader.fresh:  # its server stopped: let its memory go
            self._directory = reader = None
        return reader

    def attach(self, name: str) -> None:
        """Map the directory ``name`` (its server's word), or none for ``""``; a directory
        that cannot be mapped here (another host) is none."""
        reader = None
        if name and self.wanted:
            if self._directory is not None and self._directory.name == name:
                return
            try:
                reader = DirectoryReader(self.directory, name)
            except (OSError, LmtierError) as exc:
                log.info("grpc tier %s: the server's directory %s is not readable here: %s", self.tier, name, exc)
        self._directory = reader

    def detach(self) -> None:
        self._directory = None

    @property
    def in_use(self) -> str | None:
        segment = self._segment
        return segment.name if segment is not None and time.monotonic() >= self._off_until else None

    def forget(self) -> None:
        """In a forked child: the parent's segment and maps stay the parent's."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._segment = None
        self._server_maps = None
        self._directory = None
        self._lock = threading.Lock()  # a thread of the parent's may have held it at fork

    def close(self) -> None:
        self._directory = None  # the server's memory stays mapped only while chunks view it
        if self._segment is not None:
            self._segment.close()
