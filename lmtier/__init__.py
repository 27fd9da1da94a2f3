"""lmtier: multi-tier, persistent KV-cache offloading for LLM inference engines."""

from lmtier import _moved  # noqa: F401  (old module names, deprecated)
from lmtier.api import KVStore, open_store
from lmtier.config.loading import load_config
from lmtier.config.schema import StoreConfig
from lmtier.errors import IntegrityError, LayoutError, LmtierError
from lmtier.kv.chunk import Chunk
from lmtier.kv.keys import Namespace, chunk_keys
from lmtier.kv.layout import PRESETS, KVLayout, from_hf_config
from lmtier.store.tiered import TieredStore
from lmtier.tiers.base import Tier, open_tier, register_tier

__version__ = "0.1.0"
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
