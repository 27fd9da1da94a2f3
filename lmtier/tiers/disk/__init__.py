"""``file:///mnt/nvme/lmtier?size=500GiB``: chunks as files on a local disk.

    tier    DiskTier: the Tier primitives, the size bound, eviction, reconcile
    files   ChunkFiles: where each chunk's file lies, writing and reading one frame
    index   DiskIndex: SQLite beside the files (sizes, recency, usage), shared by processes

One file per chunk, ``chunks/<first byte>/<hex key>.lmt``, holding one codec frame.
Publishing is atomic: a chunk is written whole under a temporary name (fsync'ed first when
``fsync=true``), then, inside one index transaction, renamed into place and recorded.
Readers open files by name, so they see a complete frame or nothing; a file evicted or
replaced while being read stays readable through its open descriptor. After a crash a
frame is still verified by its checksums when read, so a torn file can only ever be a miss.

The index is shared by every process that opens the directory: the size bound is enforced
under its write lock, counting each file once however many processes write. Opening the
tier reconciles the index with the files (adopting complete files a crash left
unrecorded, forgetting records whose files are gone, removing dead writers' temporary
files), and rebuilds it from the files when the database is missing.

Eviction is LRU over the index's recency with the CPU tier's twist: within a batch the
first chunk of the prompt is made the most recent, so a prompt loses its tail first.

I/O: large sequential reads and writes in reused page-aligned buffers, with O_DIRECT when
the filesystem supports it (``o_direct=auto``), so cold reads measure the disk, not the
page cache, and the cache keeps room for the engine. A small thread pool
(``threads=16``: small chunks need a deep queue) overlaps the I/O of a batch's chunks.
"""

from lmtier.tiers.disk.files import STALE_TEMP_S, SUFFIX
from lmtier.tiers.disk.tier import DiskTier

__all__ = ["STALE_TEMP_S", "SUFFIX", "DiskTier"]
