"""``file:///mnt/nvme/lmtier?size=500GiB``: chunks in log-structured segment files.

    tier       DiskTier: the Tier primitives, construction, stats, reconcile on open
    write      DiskWrites: a batch's appends, room made for it, its commit within the bound
    read       DiskReads: keys located, runs of frames read with preadv, damage healed
    segment    OwnSegment: the segment this process appends to (made, replaced, sealed)
    space      Space: eviction, compaction, crash recovery, the old layout's migration
    shares     Shares: tenants' fair shares, where tenants share the tier
    claim      whether a directory is the tier's; which names in it are ours
    files      SegmentFiles: segment names, appends, preadv of consecutive frames, scans
    pagecache  whether a run is in the page cache; starting writeback
    index      DiskIndex: SQLite beside the segments (where each chunk lies, recency, sizes)

    <dir>/segments/<pid>-<random>-<n>.seg   codec frames, each at a 4 KiB boundary
    <dir>/index.sqlite                      chunks(key, seg, off, len, atime), segments(...)
    <dir>/tmp/                              segments being created (renamed in at once)

Each writing process appends to a segment of its own (``segment=256MiB``), so appends take
no lock across processes: a ``put`` takes its batch's place at the segment's end and
writes it with one ``pwritev`` per 8 MiB piece, the pieces in flight together (through
the page cache from views of the chunks, or O_DIRECT from page-aligned buffers), then one
index transaction records the batch within the size bound. A chunk is visible once that
transaction commits; until then its bytes lie past the segment's recorded end.
A ``get`` looks its keys up (no write lock), and frames written together come back with one
``preadv`` per run of consecutive frames (up to 8 MiB, runs read in parallel), each
straight into a page-aligned pooled buffer of its own that the returned chunk views.

Every read is verified (both checksums and the key); a bad frame is a miss and its record
is dropped. Crashes: a writer killed at any moment leaves frames past its last commit; an
opener finds its segment unlocked (the append lock is an ``flock`` the kernel drops with
the process, whatever its PID namespace), adopts the complete frames, cuts the torn tail
off and seals it. Segment files the index does not know (a lost or damaged index) are
scanned frame by frame and adopted; records of vanished files are forgotten; files in
``segments/`` that are not ours are removed; the one-file-per-chunk layout
(``chunks/<byte>/<hex key>.lmt``) is adopted on open, each file becoming a one-frame
segment by a rename.

Eviction is least-recently-used per chunk with the memory tier's twist (a batch's first
chunk is its most recent, so a prompt loses its tail first); space is reclaimed per
segment, whole segments with nothing live first, then the cheapest partly live ones
compacted (their live chunks copied forward). ``size`` bounds the segments' bytes, dead
ones included, counted once however many processes write.

I/O choices, measured with ``benchmarks/bench_disk_tier.py``: see ``docs/architecture.md``
("The disk tier").
"""

from lmtier.tiers.disk.files import STALE_TEMP_S, SUFFIX
from lmtier.tiers.disk.tier import DiskTier

__all__ = ["STALE_TEMP_S", "SUFFIX", "DiskTier"]
