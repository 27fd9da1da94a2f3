"""The store: tiers composed fastest-first, and the policies that decide what goes where.

tiered     TieredStore: lookup across tiers, get with promotion, put with write-through
admission  SavePolicy: which chunks earn a write to the lower tiers, and when
fairqueue  FairQueue: the bounded write queue that serves its producers (tenants) in turn
events     TierEvents: which chunks landed in or left each tier, for routers
"""

from lmtier.store.tiered import TieredStore

__all__ = ["TieredStore"]
