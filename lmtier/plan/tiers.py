"""The simulated tiers of ``lmtier plan``: each holds chunk keys in its eviction order.

    Tier(name, capacity, on_evict)              lmtier's own order (LRU, a prompt's head
                                                most recent): an ordered dict
    PolicyTier(name, capacity, policy, ...)     another policy (lmtier.plan.policies)
    tier(name, capacity, policy, on_evict)      the one for ``policy``
      .add(key) / .add_many(keys, only_new)     store, evicting what the policy says
      .add_new(keys)                            the same, for keys known not to be held
      .touch(key, read)                         a use (a read counts, for write-back)
    run_end(keys, start, tier, above)           where a run of keys held in a tier ends

Both call ``on_evict(key, reads)`` for what they let go (memory's evictions, for
write-back).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from itertools import compress, count, filterfalse, islice, repeat, takewhile

from lmtier.plan.policies import make


class Tier(OrderedDict):
    """One tier's contents, a chunk a slot, in the order lmtier's memory tier evicts
    (``lmtier.tiers.cpu.index.Index`` with one tenant: least recently used first; a chunk
    stored or read becomes the most recent). Kept as a plain ordered dict of key -> reads
    while resident, for speed; ``tests/test_plan.py`` drives it and ``Index`` with the same
    operations and checks that they evict the same chunks."""

    __slots__ = ("capacity", "name", "on_evict")

    def __init__(self, name: str, capacity: int, on_evict=None) -> None:
        super().__init__()
        self.name, self.capacity = name, capacity
        self.on_evict = on_evict  # (key, reads) -> None: memory's evictions, for write-back

    def touch(self, key: Hashable, read: bool = False) -> None:
        if key in self:
            self.move_to_end(key)
            if read:
                self[key] += 1

    def add(self, key: Hashable) -> bool:
        """Stored (or made most recent); False where the tier holds nothing at all."""
        if self.capacity <= 0:
            return False
        self.add_many((key,))
        return True

    def add_many(self, keys: Sequence[Hashable], only_new: bool = False) -> int:
        """Each key stored in turn, the last the most recent; one already held is made most
        recent (left where it is with ``only_new``). How many were not held before.

        Where none is held yet (a prompt's new chunks, the usual case), all are appended and
        the oldest evicted after: the same chunks leave, in the same order, as one by one."""
        capacity = self.capacity
        if capacity <= 0:
            return 0
        new = list(filterfalse(self.__contains__, keys))
        if len(new) < len(keys):
            return self._add_each(keys, only_new)
        return self.add_new(new)

    def add_new(self, new: Sequence[Hashable]) -> int:
        """``add_many`` of keys the caller knows are not held: appended, then the oldest
        evicted."""
        capacity = self.capacity
        if capacity <= 0:
            return 0
        before = len(self)
        self.update(zip(new, repeat(0)))
        added = len(self) - before  # fewer than len(new) only where a key came twice
        excess = len(self) - capacity
        if excess > 0:
            pop, on_evict = self.popitem, self.on_evict
            if on_evict is None:
                for _ in range(excess):
                    pop(False)
            else:
                for _ in range(excess):
                    on_evict(*pop(False))
        return added

    def _add_each(self, keys: Sequence[Hashable], only_new: bool) -> int:
        capacity, on_evict = self.capacity, self.on_evict
        new = 0
        for key in keys:
            if key in self:
                if not only_new:
                    self.move_to_end(key)
                continue
            if len(self) >= capacity:
                victim, reads = self.popitem(last=False)
                if on_evict is not None:
                    on_evict(victim, reads)
            self[key] = 0
            new += 1
        return new


class PolicyTier:
    """A tier under another eviction policy (``lmtier.plan.policies``), with ``Tier``'s
    calls: its chunks' reads, and who holds what, kept as ``Tier`` keeps them."""

    def __init__(self, name: str, capacity: int, policy: str, on_evict=None) -> None:
        self.name, self.capacity = name, capacity
        self.policy = make(policy, capacity)
        self.reads: dict[Hashable, int] = {}
        self.on_evict = on_evict

    def __contains__(self, key: object) -> bool:
        return key in self.policy

    def __len__(self) -> int:
        return len(self.policy)

    def touch(self, key: Hashable, read: bool = False) -> None:
        """A read is a use; a touch without one (``Tier``'s recency order after a save) is
        not, for a policy that counts uses."""
        if read and key in self.policy:
            self.policy.hit(key)
            self.reads[key] += 1

    def add(self, key: Hashable) -> bool:
        """Stored or used; False where the policy turned it away (or holds nothing)."""
        if key in self.policy:
            self.policy.hit(key)
            return True
        gone = self.policy.insert(key)
        if gone is None:
            return False
        self.reads[key] = 0
        for victim in gone:
            reads = self.reads.pop(victim)
            if self.on_evict is not None:
                self.on_evict(victim, reads)
        return key in self.policy

    def add_new(self, keys: Sequence[Hashable]) -> int:
        return self.add_many(keys, only_new=True)

    def add_many(self, keys: Sequence[Hashable], only_new: bool = False) -> int:
        new = 0
        for key in keys:
            if key in self.policy:
                if not only_new:
                    self.policy.hit(key)
            elif self.add(key):
                new += 1
        return new


def tier(name: str, capacity: int, policy: str, on_evict=None) -> Tier | PolicyTier:
    """A tier of ``capacity`` chunks evicting by ``policy``: ``Tier`` for lmtier's own order."""
    if policy == "lru":
        return Tier(name, capacity, on_evict)
    return PolicyTier(name, capacity, policy, on_evict)


# The replay's loops over a prompt's chunks, run by the interpreter's own iterators (a
# tier's membership test or move mapped over the keys) rather than one bytecode loop per chunk.


def consume(calls: Iterable) -> None:
    """Runs an iterator of calls for their effect (``map(tier.move_to_end, keys)``)."""
    deque(calls, maxlen=0)


def run_end(keys: Sequence[Hashable], start: int, tier, above: Sequence = ()) -> int:
    """Where the run of ``keys`` from ``start`` that ``tier`` holds ends, cut at the first
    key one of the tiers ``above`` (read from first) holds too."""
    end = start + len(list(takewhile(tier.__contains__, islice(keys, start, None))))
    for faster in above:
        if len(faster):
            end = start + next(compress(count(), map(faster.__contains__, islice(keys, start, end))), end - start)
    return end
