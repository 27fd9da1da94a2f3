"""Other instances' sidecars as a read-only tier (``peers://``): ``tier`` (PeerTier),
``members`` (who the peers are), ``index`` (who holds which chunk, in the fleet's Redis)."""

from lmtier.tiers.peers.tier import PeerTier

__all__ = ["PeerTier"]
