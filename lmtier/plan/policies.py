"""Eviction policies a plan can give a tier, beside lmtier's own order (least recently
used first, a prompt's head made most recent: ``lru``), judged by
``benchmarks/bench_eviction.py`` on public traces (docs/results/eviction.md).

Every policy holds at most ``capacity`` chunks of equal size and answers three calls:

    key in policy            held
    policy.hit(key)          a held chunk was used
    policy.insert(key)       a new chunk: the keys evicted for it (a list, maybe empty),
                             or None where the policy did not admit it

A prompt's chunks are offered tail first, so that its head is the most recent (the order
lmtier's store uses). The candidates are the ones the fleet's peers ship or propose
(``../shared/FLEET.md``):

- ``arc``: Megiddo and Modha's adaptive replacement cache (vLLM's CPU tier offers it);
- ``s3fifo``: a small FIFO (10%) for new chunks, a main FIFO with reinsertion for chunks
  used again while small, a ghost list of what the small one let go (AIBrix, kvblockd);
- ``tinylfu``: W-TinyLFU (a 1% recency window in front of a segmented LRU, a chunk leaving
  the window admitted only when used more often than the main part's victim; counts
  halved every ten capacities of uses: Dynamo KVBM's filter, vLLM RFC #54779);
- ``slru``: our own, a segmented LRU that keeps chunks read at least once (a prefix
  someone came back for) in a protected fifth of the capacity.
"""

from __future__ import annotations

from collections import OrderedDict

EVICTION = ("lru", "arc", "s3fifo", "tinylfu", "slru")


class Policy:
    name = ""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"a capacity is a count of chunks, got {capacity}")
        self.capacity = capacity

    def __contains__(self, key: object) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def hit(self, key: bytes) -> None:
        raise NotImplementedError

    def insert(self, key: bytes) -> list[bytes] | None:
        raise NotImplementedError


class LRU(Policy):
    """Least recently used first: lmtier's memory tier (``lmtier.tiers.cpu.index.Index``)."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.order: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self.order

    def __len__(self) -> int:
        return len(self.order)

    def hit(self, key: bytes) -> None:
        self.order.move_to_end(key)

    def insert(self, key: bytes) -> list[bytes] | None:
        if not self.capacity:
            return None
        gone = []
        while len(self.order) >= self.capacity:
            gone.append(self.order.popitem(last=False)[0])
        self.order[key] = None
        return gone


class SLRU(Policy):
    """New chunks in a probation LRU; a chunk read there moves to a protected LRU (at most
    ``protected`` of the capacity), whose overflow goes back to probation's recent end;
    probation's oldest is evicted first."""

    name = "slru"

    def __init__(self, capacity: int, protected: float = 0.2) -> None:
        super().__init__(capacity)
        self.limit = int(capacity * protected)
        self.probation: OrderedDict[bytes, None] = OrderedDict()
        self.protected: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self.probation or key in self.protected

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def hit(self, key: bytes) -> None:
        if key in self.protected:
            self.protected.move_to_end(key)
            return
        del self.probation[key]
        self.protected[key] = None
        while len(self.protected) > self.limit:
            self.probation[self.protected.popitem(last=False)[0]] = None

    def insert(self, key: bytes) -> list[bytes] | None:
        if not self.capacity:
            return None
        gone = []
        while len(self) >= self.capacity:
            gone.append((self.probation or self.protected).popitem(last=False)[0])
        self.probation[key] = None
        return gone


class ARC(Policy):
    """Adaptive replacement: T1 (seen once), T2 (seen again) and their ghosts B1, B2; a hit
    in a ghost list moves the target size of T1 (``p``) toward the list that missed it."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0
        self.t1: OrderedDict[bytes, None] = OrderedDict()
        self.t2: OrderedDict[bytes, None] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def hit(self, key: bytes) -> None:
        if key in self.t1:
            del self.t1[key]
        self.t2[key] = None
        self.t2.move_to_end(key)

    def _replace(self, in_b2: bool) -> bytes:
        if self.t1 and (len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p)):
            old = self.t1.popitem(last=False)[0]
            self.b1[old] = None
        else:
            old = self.t2.popitem(last=False)[0]
            self.b2[old] = None
        return old

    def insert(self, key: bytes) -> list[bytes] | None:
        c, t1, t2, b1, b2 = self.capacity, self.t1, self.t2, self.b1, self.b2
        if not c:
            return None
        if key in b1 or key in b2:
            if key in b1:
                self.p = min(c, self.p + max(len(b2) // max(len(b1), 1), 1))
            else:
                self.p = max(0, self.p - max(len(b1) // max(len(b2), 1), 1))
            gone = [self._replace(key in b2)] if len(self) >= c else []
            (b1 if key in b1 else b2).pop(key)
            t2[key] = None
            return gone
        gone = []
        if len(t1) + len(b1) >= c:
            if len(t1) < c:
                b1.popitem(last=False)
                gone.append(self._replace(False))
            else:
                gone.append(t1.popitem(last=False)[0])
        elif len(t1) + len(t2) + len(b1) + len(b2) >= c:
            if len(t1) + len(t2) + len(b1) + len(b2) >= 2 * c:
                b2.popitem(last=False)
            if len(self) >= c:
                gone.append(self._replace(False))
        t1[key] = None
        return gone


class S3FIFO(Policy):
    """Small FIFO (``small`` of the capacity) for new chunks; one used while there moves to
    the main FIFO when it leaves, else it leaves for the ghost list; a chunk found in the
    ghost list goes straight to main. Main reinserts a chunk used since it was last passed
    (its count, at most 3, decremented) and evicts the first one unused."""

    name = "s3fifo"

    def __init__(self, capacity: int, small: float = 0.1) -> None:
        super().__init__(capacity)
        self.small_cap = max(1, int(capacity * small))
        self.small: OrderedDict[bytes, None] = OrderedDict()
        self.main: OrderedDict[bytes, None] = OrderedDict()
        self.ghost: OrderedDict[bytes, None] = OrderedDict()
        self.freq: dict[bytes, int] = {}

    def __contains__(self, key: object) -> bool:
        return key in self.small or key in self.main

    def __len__(self) -> int:
        return len(self.small) + len(self.main)

    def hit(self, key: bytes) -> None:
        self.freq[key] = min(3, self.freq[key] + 1)

    def _evict(self) -> bytes:
        while True:
            if len(self.small) >= self.small_cap or not self.main:
                key = self.small.popitem(last=False)[0]
                if self.freq[key] > 0:
                    self.freq[key] = 0
                    self.main[key] = None
                    continue
                del self.freq[key]
                self.ghost[key] = None
                if len(self.ghost) > self.capacity:
                    self.ghost.popitem(last=False)
                return key
            key = self.main.popitem(last=False)[0]
            if self.freq[key] > 0:
                self.freq[key] -= 1
                self.main[key] = None
                continue
            del self.freq[key]
            return key

    def insert(self, key: bytes) -> list[bytes] | None:
        if not self.capacity:
            return None
        gone = []
        while len(self) >= self.capacity:
            gone.append(self._evict())
        if key in self.ghost:  # evicted from small not long ago: it comes back, and stays longer
            del self.ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None
        self.freq[key] = 0
        return gone


class TinyLFU(Policy):
    """W-TinyLFU: new chunks enter a recency window (``window`` of the capacity); the one
    leaving it enters the main segmented LRU if there is room, or if it was used more often
    than main's victim (else it is evicted itself). Uses are counted per key and halved
    every ``10 * capacity`` counts (at most that many keys counted)."""

    name = "tinylfu"

    def __init__(self, capacity: int, window: float = 0.01) -> None:
        super().__init__(capacity)
        self.window_cap = max(1, int(capacity * window)) if capacity else 0
        self.window: OrderedDict[bytes, None] = OrderedDict()
        self.main = SLRU(capacity - self.window_cap, protected=0.8)
        self.counts: dict[bytes, int] = {}
        self.counted, self.period = 0, 10 * max(1, capacity)

    def __contains__(self, key: object) -> bool:
        return key in self.window or key in self.main

    def __len__(self) -> int:
        return len(self.window) + len(self.main)

    def _count(self, key: bytes) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1
        self.counted += 1
        if self.counted >= self.period:
            self.counted = 0
            self.counts = {k: n // 2 for k, n in self.counts.items() if n > 1}

    def hit(self, key: bytes) -> None:
        self._count(key)
        if key in self.window:
            self.window.move_to_end(key)
        else:
            self.main.hit(key)

    def insert(self, key: bytes) -> list[bytes] | None:
        if not self.capacity:
            return None
        self._count(key)
        self.window[key] = None
        if len(self.window) <= self.window_cap:
            return []
        candidate = self.window.popitem(last=False)[0]
        main = self.main
        if not main.capacity:  # a tier of one chunk: the window is all of it
            return [candidate]
        if len(main) < main.capacity:
            main.insert(candidate)
            return []
        victim = next(iter(main.probation or main.protected))
        if self.counts.get(candidate, 0) > self.counts.get(victim, 0):
            return main.insert(candidate)
        return [candidate]


MAKERS = {"lru": LRU, "arc": ARC, "s3fifo": S3FIFO, "tinylfu": TinyLFU, "slru": SLRU}


def make(name: str, capacity: int) -> Policy:
    """One of ``EVICTION`` holding ``capacity`` chunks."""
    if name not in MAKERS:
        raise ValueError(f"an eviction policy is one of {', '.join(EVICTION)}, got {name!r}")
    return MAKERS[name](capacity)
