"""A cache server as another server's tier: a per-node sidecar over a shared central server.

Inside a server every key carries its tenant's tag (``tenant_tag(tenant) + key``). Such a
key is no chunk key to the server above (it takes 16- or 32-byte keys and tags them with
the tenant of the caller, here the sidecar's own token), and passing it on would fold the
sidecar's tenants into one. So each hop re-keys: the key sent up is a digest of the whole
tagged key, as long as the chunk key itself. Tenants of the sidecar stay apart upstream
(different tags, different digests), the central server sees well-formed keys, and the
chunk comes back under the key the sidecar asked for.

    UpstreamTier(tier)     the grpc tier of a server, with keys re-tagged on the way
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from lmtier.breaker import Backoff
from lmtier.kv.chunk import Chunk
from lmtier.server.auth import TAG_BYTES
from lmtier.tiers.base import Tier


def upstream_key(tagged: bytes) -> bytes:
    """The key a server asks the server above for: a digest of its tenant-tagged key."""
    return hashlib.blake2b(tagged, digest_size=len(tagged) - TAG_BYTES, person=b"lmtier.hop").digest()


class UpstreamTier(Tier):
    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.name = tier.name
        self.scheme = tier.scheme
        self.cooldown = tier.cooldown

    @property
    def backoff(self) -> Backoff:  # type: ignore[override]
        return self.tier.backoff  # the store retries the hop as it would the tier

    def contains(self, keys: Sequence[bytes]) -> int:
        return self.tier.contains([upstream_key(k) for k in keys])

    def get(self, keys: Sequence[bytes]) -> list[Chunk | None]:
        got = self.tier.get([upstream_key(k) for k in keys])
        return [None if c is None else c.view_as(k, owning=True) for c, k in zip(got, keys, strict=True)]

    def put(self, chunks: Sequence[Chunk]) -> None:
        self.tier.put([c.view_as(upstream_key(c.key)) for c in chunks])

    def delete(self, keys: Sequence[bytes]) -> None:
        self.tier.delete([upstream_key(k) for k in keys])

    def close(self) -> None:
        self.tier.close()

    def stats(self) -> dict[str, Any]:
        return self.tier.stats()
