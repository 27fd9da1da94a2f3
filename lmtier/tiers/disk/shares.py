"""Tenants' fair shares of a disk tier that tenants share (the cache server's, whose keys
begin with the tenant's tag): which chunks a put may evict, and in which order, so that one
tenant's prompts never push another's out of its share. ``Space.free`` asks it where the
tier has a ``tenant_prefix``; the memory tier applies the same rule to its slots (``cpu``).

    Shares.of(txn, prefix, capacity, keep, incoming) -> Shares | None   a put's shares
      .candidates(txn, keep)      the chunks the put may evict, in the order it should
      .taken(key, nbytes)         one of them evicted
"""

from __future__ import annotations

from collections.abc import Iterator

from lmtier.tiers.disk.index import Location, Txn


class Shares:
    """Each tenant's fair share of a tier that tenants share (the cache server's, whose
    keys begin with the tenant's tag): the capacity over the tenants with chunks here.
    The memory tier's rule (``cpu``), for a batch: a put within its tenant's share evicts
    from the tenants over theirs first, then its tenant's own; a put that takes its tenant
    over its share evicts from the tenants over theirs only up to its share, then its
    tenant's own chunks, then more of theirs. Never a chunk of another tenant within its
    share: where what is left to evict is not enough, segments are compacted past the
    copying budget (the room is there: fragmentation, not chunks), or the put stores less."""

    def __init__(self, usage: dict[bytes, int], prefix: int, capacity: int, tenant: bytes, incoming: int) -> None:
        self.usage = usage
        self.prefix = prefix
        self.tenant = tenant
        self.share = capacity // max(1, len(usage) + (tenant not in usage))
        self.incoming = incoming
        self.taken_from_others = 0  # bytes of other tenants' evicted for this put

    @classmethod
    def of(cls, txn: Txn, prefix: int, capacity: int, keep: set[bytes], incoming: int) -> Shares | None:
        """The shares for a put of ``keep`` (its keys, one tenant's), None where the tier
        is one pool (no ``prefix``) or nothing says whose the put is (a reopen)."""
        if not prefix or not keep:
            return None
        return cls(txn.usage_by_prefix(prefix), prefix, capacity, next(iter(keep))[:prefix], incoming)

    def _over(self, tenant: bytes) -> bool:
        return tenant != self.tenant and self.usage.get(tenant, 0) > self.share

    def candidates(self, txn: Txn, keep: set[bytes]) -> Iterator[tuple[bytes, Location]]:
        """The chunks this put may evict, in the order it should: passes over the chunks,
        least recent first, each taking one kind (the first, in a put over its share, only
        while what it took from others leaves its tenant within its share)."""
        mine = self.usage.get(self.tenant, 0)
        own = lambda t: t == self.tenant  # noqa: E731
        if mine + self.incoming <= self.share:
            passes = [(self._over, False), (own, False)]
        else:
            passes = [(self._over, True), (own, False), (self._over, False)]
        seen: set[bytes] = set()
        for allowed, bounded in passes:
            for key, loc in txn.by_age(keep):
                if bounded and self.taken_from_others >= self.share - mine:
                    break
                if key not in seen and allowed(key[: self.prefix]):
                    seen.add(key)
                    yield key, loc

    def taken(self, key: bytes, nbytes: int) -> None:
        tenant = key[: self.prefix]
        self.usage[tenant] = self.usage.get(tenant, 0) - nbytes
        if tenant != self.tenant:
            self.taken_from_others += nbytes
