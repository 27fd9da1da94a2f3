"""``cpu://?size=8GiB``: chunks in one preallocated slab of host memory.

    tier       CpuTier: the Tier primitives over slab and index, leases, write-back, publishing
    placement  Placing: slots a reader lands a payload in directly (promotions, a server's saves)
    index      Index: entries, LRU order, victims, tenants' fair shares; demotion to evict_hook
    slab       Slab: the memory, its free runs of slots, prefaulting, shared-memory naming

The slab is cut into fixed slots (``slot=``; by default one full chunk where the chunk
size is known, as in an engine, else 64 KiB, so that chunks of any size the clients send
fill the tier: a chunk wastes at most the end of its last slot). A chunk takes one run of
slots, found among the free runs (``slab``), and is handed out as one zero-copy view. The slab is
pinned when CUDA is present, so copies to the GPU can be asynchronous, and is allocated
on first use and anew in a forked child (which starts empty). Its pages are faulted in
by a background thread a little ahead of the slots handed out (``buffers.Prefault``), so a
save copies into mapped memory instead of paying page faults on the engine's save path.

Eviction is LRU with one twist that keeps prefixes usable: a chunk is worth nothing
without the chunks before it, so within one batch (a prompt, in order) the *first* chunk
is made the most recent and the last chunk the least. Under pressure a prompt then loses
its tail first and whatever remains is still reachable from its first chunk; plain LRU,
touching the chunks in order, would evict the head first and strand the rest.

Leases: ``get`` returns views of the slab; each holds a lease on its slot until released,
and a leased slot is never evicted or reused. A chunk deleted while leased is freed when
its last lease ends.

Integrity: ``put`` records the xxh3-64 checksum of what it copied (hashing each block as it
lands, while it is in cache). ``get`` hands out chunks that verify against it when they are
read (see ``lmtier.kv.chunk``): the reader's copy and the check are one pass over memory, which
is what keeps a verified tier close to a bare ``memcpy``. A mismatch drops the entry.

Write-back (a ``TieredStore`` whose lower tiers get what memory lets go): ``evict_hook`` is
offered each chunk evicted, and the store writes the chunks it wants down before they go
(``unwritten`` lists what only memory holds, ``hold`` leases it without counting a read,
``mark_written`` records that the lower tiers have it), so that a process that dies loses
only what arrived in its last seconds. A chunk placed here from a lower tier is written.
"""

from lmtier._moved import forward
from lmtier.tiers.cpu.tier import CpuTier

__all__ = ["CpuTier"]

__getattr__ = forward(__name__)  # names of the previous release, found where they live now (CHANGELOG.md)
