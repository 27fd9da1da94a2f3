"""The store: tiers composed fastest-first, and the policies that decide what goes where.

tiered     TieredStore: the tiers it opens, lookup, failure handling; the policy told whole
readpath   its reads: get and iter_get from the fastest tier holding each chunk, promotion
writepath  its writes: put, put_all, the write queue and its writer thread, dropped writes
writeback  its write-back: demotion of evicted chunks, checkpoints, persist
admission  SavePolicy: which chunks earn a write to the lower tiers, and when
fairqueue  FairQueue: the bounded write queue that serves its producers (tenants) in turn
events     TierEvents: which chunks landed in or left each tier, for routers
"""

from lmtier._moved import forward
from lmtier.store.tiered import TieredStore

__all__ = ["TieredStore"]

__getattr__ = forward(__name__)  # names of the previous release, found where they live now (CHANGELOG.md)
