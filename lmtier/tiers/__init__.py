"""Tiers: places that store chunks. ``base`` defines the protocol and the URL registry."""

from lmtier.tiers.base import Tier, TierContext, open_tier, register_tier

__all__ = ["Tier", "TierContext", "open_tier", "register_tier"]
