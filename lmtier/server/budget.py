"""``ReceiveBudget``: the memory that half-received chunks may hold, all Puts together.

A chunk that arrives in several pieces is rebuilt in a buffer of its full size, taken when
its first piece arrives (``pieces.FrameAssembler``). Each Put holds at most one such
buffer, but a client may open many Puts that announce large chunks and then stall (each
for up to ``stall_timeout``): without a bound for them all, a few tenants' calls would
hold ``max_concurrent_rpcs`` x ``max_chunk_bytes`` of the server's memory. Past the
bound, or past a tenant's part of it where several tenants share the server, a new
frame is refused (``RESOURCE_EXHAUSTED``, which the grpc tier retries with backoff).
"""

from __future__ import annotations

import threading

RECEIVING_CHUNKS = 4  # largest chunks that may be half-received at once, all Puts together


class ReceiveBudget:
    def __init__(self, total: int, per_tenant: int) -> None:
        self.total = total
        self.per_tenant = per_tenant
        self._held = 0
        self._by_tenant: dict[bytes, int] = {}  # tenants with a frame half-received: bounded by calls
        self._lock = threading.Lock()

    def for_call(self, tag: bytes) -> TenantBudget:
        return TenantBudget(self, tag)

    def take(self, tag: bytes, nbytes: int) -> bool:
        with self._lock:
            mine = self._by_tenant.get(tag, 0)
            if self._held + nbytes > self.total or mine + nbytes > self.per_tenant:
                return False
            self._held += nbytes
            self._by_tenant[tag] = mine + nbytes
            return True

    def give(self, tag: bytes, nbytes: int) -> None:
        with self._lock:
            self._held -= nbytes
            left = self._by_tenant.pop(tag, 0) - nbytes
            if left > 0:
                self._by_tenant[tag] = left

    @property
    def held(self) -> int:
        return self._held


class TenantBudget:
    """One call's view of the budget: its tenant's."""

    def __init__(self, budget: ReceiveBudget, tag: bytes) -> None:
        self.budget, self.tag = budget, tag

    def take(self, nbytes: int) -> bool:
        return self.budget.take(self.tag, nbytes)

    def give(self, nbytes: int) -> None:
        self.budget.give(self.tag, nbytes)
