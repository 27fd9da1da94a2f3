"""Tiers: places that store chunks, each configured by one URL.

base      the Tier protocol (five batch primitives and what derives from them), tier
          URLs, the scheme registry, ``open_tier``
deferred  ``open_or_defer`` and DeferredTier: a tier unreachable at start misses, and
          is opened again in the background
options   URL options the network tiers share (durations, TLS files)
cpu/      ``cpu://``: a slab of host memory in slots
disk/     ``file://``: log-structured segment files and a SQLite index, shared by processes
redis/    ``redis://``, ``rediss://``, ``redis+cluster://``: one value per chunk
grpc/     ``grpc://``, ``grpcs://``: a client of ``lmtier serve``
"""

from lmtier.tiers.base import Tier, TierContext, open_tier, register_tier

__all__ = ["Tier", "TierContext", "open_tier", "register_tier"]
