"""lmtier: multi-tier, persistent KV-cache offloading for LLM inference engines."""

import warnings

from lmtier import _moved  # noqa: F401  (old module names, deprecated)
from lmtier.api import KVStore, open_store
from lmtier.config.loading import load_config
from lmtier.config.schema import StoreConfig
from lmtier.errors import IntegrityError, LayoutError, LmtierError
from lmtier.kv.chunk import Chunk
from lmtier.kv.keys import Namespace, chunk_keys
from lmtier.kv.layout import PRESETS, KVLayout, from_hf_config
from lmtier.store.tiered import TieredStore
from lmtier.tiers import base
from lmtier.tiers.base import Tier, TierContext, register_tier
from lmtier.tiers.deferred import open_or_defer

__version__ = "0.1.0"


def open_tier(url: str, context: TierContext | None = None, *, defer: bool = False) -> Tier:
    """The tier a URL names (``lmtier.tiers.base.open_tier``). ``defer=True``, of earlier
    releases, is ``lmtier.tiers.deferred.open_or_defer`` now, and says so."""
    if defer:
        warnings.warn(
            "open_tier(url, defer=True) is now lmtier.tiers.deferred.open_or_defer(url); the keyword goes away "
            "in a later release",
            DeprecationWarning,
            stacklevel=2,
        )
        return open_or_defer(url, context)
    return base.open_tier(url, context)


__all__ = [
    "PRESETS",
    "Chunk",
    "IntegrityError",
    "KVLayout",
    "KVStore",
    "LayoutError",
    "LmtierError",
    "Namespace",
    "StoreConfig",
    "Tier",
    "TieredStore",
    "chunk_keys",
    "from_hf_config",
    "load_config",
    "open_store",
    "open_tier",
    "register_tier",
]
