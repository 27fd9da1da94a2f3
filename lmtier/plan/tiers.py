"""The simulated tiers of ``lmtier plan``: each holds chunk keys in its eviction order.

    Tier(name, capacity, instance, held, on_evict)     lmtier's own order (LRU, a prompt's
                                                       head most recent): an ordered dict
    PolicyTier(name, capacity, policy, ...)            another policy (lmtier.plan.policies)
    tier(name, capacity, policy, ...)                  the one for ``policy``
    forget(held, instance, key)                        who holds what, one copy fewer

Both keep ``held`` (key -> {instance: copies}) in step where peers or the KV-aware router
ask who holds a chunk, and call ``on_evict(key, reads)`` for what they let go (memory's
evictions, for write-back).
"""

from __future__ import annotations

from collections import OrderedDict

from lmtier.plan.policies import make


class Tier(OrderedDict):
    """One tier's contents, a chunk a slot, in the order lmtier's memory tier evicts
    (``lmtier.tiers.cpu.index.Index`` with one tenant: least recently used first; a chunk
    stored or read becomes the most recent). Kept as a plain ordered dict of key -> reads
    while resident, for speed; ``tests/test_plan.py`` drives it and ``Index`` with the same
    operations and checks that they evict the same chunks."""

    __slots__ = ("capacity", "held", "instance", "name", "on_evict")

    def __init__(self, name: str, capacity: int, instance: int = -1, held: dict | None = None, on_evict=None) -> None:
        super().__init__()
        self.name, self.capacity, self.instance = name, capacity, instance
        self.held = held  # key -> {instance: tiers of it holding the key}, kept in step (local tiers)
        self.on_evict = on_evict  # (key, reads) -> None: memory's evictions, for write-back

    def touch(self, key: bytes, read: bool = False) -> None:
        if key in self:
            self.move_to_end(key)
            if read:
                self[key] += 1

    def add(self, key: bytes) -> bool:
        """Stored (or made most recent); False where the tier holds nothing at all."""
        if key in self:
            self.move_to_end(key)
            return True
        if self.capacity <= 0:
            return False
        held, on_evict = self.held, self.on_evict
        while len(self) >= self.capacity:
            victim, reads = self.popitem(last=False)
            if held is not None:
                forget(held, self.instance, victim)
            if on_evict is not None:
                on_evict(victim, reads)
        self[key] = 0
        if held is not None:
            mine = held.get(key)
            if mine is None:
                held[key] = {self.instance: 1}
            else:
                mine[self.instance] = mine.get(self.instance, 0) + 1
        return True


def forget(held: dict, instance: int, key: bytes) -> None:
    """``instance`` holds one tier's copy of ``key`` fewer."""
    mine = held.get(key)
    if mine is None:
        return
    left = mine.get(instance, 0) - 1
    if left > 0:
        mine[instance] = left
    else:
        mine.pop(instance, None)
        if not mine:
            del held[key]


class PolicyTier:
    """A tier under another eviction policy (``lmtier.plan.policies``), with ``Tier``'s
    calls: its chunks' reads, and who holds what, kept as ``Tier`` keeps them."""

    def __init__(self, name: str, capacity: int, policy: str, instance: int = -1, held: dict | None = None,
                 on_evict=None) -> None:  # fmt: skip
        self.name, self.capacity, self.instance = name, capacity, instance
        self.policy = make(policy, capacity)
        self.reads: dict[bytes, int] = {}
        self.held, self.on_evict = held, on_evict

    def __contains__(self, key: object) -> bool:
        return key in self.policy

    def __len__(self) -> int:
        return len(self.policy)

    def touch(self, key: bytes, read: bool = False) -> None:
        """A read is a use; a touch without one (``Tier``'s recency order after a save) is
        not, for a policy that counts uses."""
        if read and key in self.policy:
            self.policy.hit(key)
            self.reads[key] += 1

    def add(self, key: bytes) -> bool:
        if key in self.policy:
            self.policy.hit(key)
            return True
        gone = self.policy.insert(key)
        if gone is None:
            return False
        self.reads[key] = 0
        if self.held is not None:
            mine = self.held.setdefault(key, {})
            mine[self.instance] = mine.get(self.instance, 0) + 1
        for victim in gone:
            reads = self.reads.pop(victim)
            if self.held is not None:
                forget(self.held, self.instance, victim)
            if self.on_evict is not None:
                self.on_evict(victim, reads)
        return key in self.policy


def tier(name: str, capacity: int, policy: str, instance: int = -1, held: dict | None = None, on_evict=None):
    """A tier of ``capacity`` chunks evicting by ``policy``: ``Tier`` for lmtier's own order."""
    if policy == "lru":
        return Tier(name, capacity, instance, held, on_evict)
    return PolicyTier(name, capacity, policy, instance, held, on_evict)
