"""``Published``: the server's directory of its memory tier, for its one tenant.

Where every call is one tenant's and same-host clients may map the memory tier
(``CacheServer.zero_copy``), the server publishes which of that tenant's chunks lie in
which slot (``lmtier.transport.directory``), under the keys the tenant knows them by (its tag taken
off), so that a same-host client loads them with no call. The memory tier tells it each
chunk that becomes readable and each that stops being (``CpuTier.publisher``); the
server's probe loop beats its heartbeat, and ``close`` takes it down with the server.
Chunks of the readiness probe, and keys of any other shape, are never published.
"""

from __future__ import annotations

from lmtier.kv import codec
from lmtier.kv.layout import KVLayout
from lmtier.tiers.cpu.tier import CpuTier
from lmtier.transport.directory import HEAD_BYTES, DirectoryWriter


class Published:
    def __init__(self, tier: CpuTier, shm_dir: str, tag: bytes, key_lengths: tuple[int, ...], interval: float) -> None:
        slab = tier.shared_name
        if slab is None:
            raise ValueError("the memory tier's slab is not shared")
        self.tag, self._lengths = tag, key_lengths
        self.writer = DirectoryWriter(shm_dir, slab, tier.num_slots, tier.slot_bytes, interval)
        self.name = self.writer.name
        self._tier = tier
        tier.set_publisher(self)

    def publish(self, key: bytes, slot: int, namespace: bytes, layout: KVLayout, num_tokens: int,
                checksum: int, head: bytes = b"") -> None:  # fmt: skip
        own = self._own(key)
        if own is not None:
            if not head or len(head) > HEAD_BYTES:  # none came with it, or one padded past a head's room
                head = codec.frame_head(own, namespace, layout, num_tokens, checksum)
            self.writer.publish(own, slot, head)

    def withdraw(self, key: bytes) -> None:
        own = self._own(key)
        if own is not None:
            self.writer.withdraw(own)

    def _own(self, key: bytes) -> bytes | None:
        if key.startswith(self.tag) and len(key) - len(self.tag) in self._lengths:
            return key[len(self.tag) :]
        return None

    def beat(self) -> None:
        self.writer.beat()

    def close(self) -> None:
        self._tier.set_publisher(None)  # under the tier's lock: no publish runs past this
        self.writer.close()
