"""What the S3 tier knows the bucket holds under its prefix, and the order it deletes in.

    Held(capacity, max_entries)        key -> object size, front = deleted first
      .add(keys, sizes)                stored: the batch's first key becomes the most recent
      .recent(keys)                    read: the same order (a prompt loses its tail first)
      .learn(objects, generation, fresh_after)   what a listing found: objects written since
                                       ``fresh_after`` (another writer's new ones) behind all
                                       that is known, older ones in front of it, oldest first
      .forget_unlisted(generation)     keys two listings in a row did not show
      .victims(need, keep, new) -> keys   what to delete so that ``need`` more bytes (and
                                       ``new`` more entries) fit

The bound is kept on what this process knows: its own writes, what its reads and checks
found, and what the listings (at start and every ``relist`` seconds) show other writers
stored. A key missing from one listing may only be one the listing lags behind; missing
from two in a row, it is gone (another writer deleted it, or a lifecycle rule). Bounded
by the capacity: an entry is at least one object, and objects past the capacity are
deleted as they are learned; and ``max_entries`` bounds the count of keys whatever their
sizes (a listing of tiny objects named like chunks).

Deleting from the front stays safe with several writers: what another writer deleted stays
in the front part of this one's order (it was this one's own older write, or learnt old),
so this one deletes those first (a 404, harmless) before anything another writer stored
since its last listing, which goes to the back.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

GONE_KEPT = 1 << 16  # removed keys remembered, against listing pages older than their delete


class Held:
    def __init__(self, capacity: int, max_entries: int = 1 << 62) -> None:
        self.capacity = capacity
        self.max_entries = max_entries
        self.sizes: OrderedDict[bytes, int] = OrderedDict()
        self.used = 0
        self._listed: dict[bytes, int] = {}  # key -> the last listing generation that showed it
        # key -> when it was removed (time.monotonic()): a listing page fetched before that
        # must not bring it back (bounded: the oldest are dropped past GONE_KEPT)
        self.gone: OrderedDict[bytes, float] = OrderedDict()
        self._added: dict[bytes, int] = {}  # key -> the generation running when it was added

    def __len__(self) -> int:
        return len(self.sizes)

    def __contains__(self, key: object) -> bool:
        return key in self.sizes

    def size(self, key: bytes) -> int | None:
        return self.sizes.get(key)

    def add(self, keys: Sequence[bytes], sizes: Sequence[int], generation: int = 0) -> None:
        for key, size in zip(reversed(keys), reversed(sizes), strict=True):
            self.gone.pop(key, None)
            old = self.sizes.get(key)
            self.used += size - (old or 0)
            self.sizes[key] = size
            self.sizes.move_to_end(key)
            self._added[key] = generation

    def recent(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):
            if key in self.sizes:
                self.sizes.move_to_end(key)

    def remove(self, keys: Iterable[bytes]) -> list[bytes]:
        gone = []
        for key in keys:
            self.gone[key] = time.monotonic()
            self.gone.move_to_end(key)
            if len(self.gone) > GONE_KEPT:
                self.gone.popitem(last=False)
            size = self.sizes.pop(key, None)
            if size is not None:
                self.used -= size
                self._listed.pop(key, None)
                self._added.pop(key, None)
                gone.append(key)
        return gone

    def learn(
        self,
        objects: Sequence[tuple[bytes, int, float]],
        generation: int,
        fresh_after: float = 0.0,
        fetched: float = 0.0,
    ) -> None:
        """A listing's objects (key, size, last modified): those not known go in front of all
        that is known (deleted first), the oldest first, but those written since
        ``fresh_after`` behind it (used last); every one is marked as seen by this listing.
        A key removed after the page was asked for (``fetched``, ``time.monotonic()``) is
        not brought back: the page is older than its delete."""
        unknown = [o for o in objects if o[0] not in self.sizes and self.gone.get(o[0], -1.0) < fetched]
        old = sorted((o for o in unknown if o[2] < fresh_after), key=lambda o: o[2], reverse=True)
        new = sorted((o for o in unknown if o[2] >= fresh_after), key=lambda o: o[2])
        for (key, size, _), front in [*((o, True) for o in old), *((o, False) for o in new)]:
            self.sizes[key] = size
            self.sizes.move_to_end(key, last=not front)
            self.used += size
            self._added[key] = generation
        for key, _, _ in objects:
            self._listed[key] = generation

    def forget_unlisted(self, generation: int) -> list[bytes]:
        """Keys known before listing ``generation - 1`` began that neither it nor listing
        ``generation`` showed: gone from the bucket."""
        stale = [
            key
            for key in self.sizes
            if self._added.get(key, 0) < generation - 1 and self._listed.get(key, -1) < generation - 1
        ]
        return self.remove(stale)

    def victims(self, need: int, keep: Iterable[bytes] = (), new: int = 0) -> list[bytes]:
        """Keys to delete, front first, so that ``need`` more bytes and ``new`` more keys fit
        in the capacity and the count bound; ``keep`` (the batch being stored) is passed over."""
        over = self.used + need - self.capacity
        extra = len(self.sizes) + new - self.max_entries
        out: list[bytes] = []
        if over <= 0 and extra <= 0:
            return out
        keep = set(keep)
        for key, size in self.sizes.items():
            if key in keep:
                continue
            out.append(key)
            over -= size
            extra -= 1
            if over <= 0 and extra <= 0:
                break
        return out
