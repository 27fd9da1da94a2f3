"""``FairQueue``: a bounded ``queue.Queue`` that serves its producers in turn.

The store's background writes (``TieredStore``'s write queue) are one queue for every
caller; on the cache server the callers are tenants, and one tenant saving as fast as it
can would fill the queue and have every other tenant's writes to the lower tiers
dropped. Here each producer (``owner(item)``: the tenant's tag) has a lane; ``get`` takes
from the lanes in turn, and once the queue is half full a producer holding its share of
the room (three quarters of it over the producers with items waiting: a quarter is kept
for a producer that comes) gets ``queue.Full`` rather than more of it.
"""

from __future__ import annotations

import queue
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any


class FairQueue(queue.Queue):
    def __init__(self, maxsize: int, owner: Callable[[Any], bytes]) -> None:
        self._owner = owner
        super().__init__(maxsize)

    # queue.Queue's storage hooks, called with its mutex held
    def _init(self, maxsize: int) -> None:
        self._lanes: OrderedDict[bytes, deque] = OrderedDict()  # producers with items waiting: bounded
        self._count = 0

    def _qsize(self) -> int:
        return self._count

    def _put(self, item: Any) -> None:
        self._lanes.setdefault(self._owner(item), deque()).append(item)
        self._count += 1

    def _get(self) -> Any:
        owner, lane = next(iter(self._lanes.items()))
        item = lane.popleft()
        if lane:
            self._lanes.move_to_end(owner)  # the next producer's turn
        else:
            del self._lanes[owner]
        self._count -= 1
        return item

    def put_nowait(self, item: Any) -> None:
        owner = self._owner(item)
        with self.mutex:
            lanes = len(self._lanes) + (owner not in self._lanes)
            held = len(self._lanes.get(owner, ()))
            share = (self.maxsize - self.maxsize // 4) // lanes  # a quarter kept for newcomers
            if self._count * 2 >= self.maxsize and held >= max(1, share):
                raise queue.Full
        super().put_nowait(item)
