"""Shared-memory segments: the same-host data plane between the grpc:// tier and the server.

    segment  Segment: a segment of this process's, created, locked, cut into slots;
             NAME, DEFAULT_DIR; alive, locked and sweep (segments whose maker died removed)
    access   segments another process made, opened by name and checked: SegmentFiles (the
             server's pread/pwrite of clients' segments), SegmentMaps (the client's map of
             the server's memory), SegmentUnavailable

Python gRPC moves bulk bytes at well under 1 GB/s; a memory copy runs at several GB/s.
When client and server share a host (a sidecar in the engine's pod, with an in-memory
``/dev/shm`` shared between the containers), the client creates a segment, writes the
frames it puts into slots of it and lets the server write the frames it gets into other
slots; gRPC carries only the slot references.

Ownership keeps it safe. The segment is the client's: the server reads and writes it only
while a call runs, never through a mapping (``access``), so a client that dies or
misbehaves mid-transfer strands nothing on the server. The client holds a shared
``flock`` on its segment for as long as it lives; ``sweep`` (run by the server now and
then) removes segments nobody holds, which is how the memory of a killed client comes
back (``segment``). Frames carry their checksums, so bytes that change under a reader are
a miss, never wrong KV.
"""

from lmtier.transport.shm.access import MAX_SPAN, SegmentFiles, SegmentMaps, SegmentUnavailable
from lmtier.transport.shm.segment import (
    DEFAULT_DIR,
    GROW_STEP,
    NAME,
    QUARANTINE_S,
    SWEEP_MIN_AGE_S,
    Segment,
    alive,
    locked,
    sweep,
)

__all__ = [
    "DEFAULT_DIR",
    "GROW_STEP",
    "MAX_SPAN",
    "NAME",
    "QUARANTINE_S",
    "SWEEP_MIN_AGE_S",
    "Segment",
    "SegmentFiles",
    "SegmentMaps",
    "SegmentUnavailable",
    "alive",
    "locked",
    "sweep",
]
