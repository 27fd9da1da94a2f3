"""Shared-tier events from every instance, in each instance's own KV event stream
(``event_relay: redis://...``).

A router that indexes KV events per instance (vllm-router's ``kv_aware``) credits a chunk
only to the instance whose stream announced it; a chunk one instance stored in a shared
tier (Redis, a cache server, a peer's sidecar) is loadable by all of them, yet only the
one that stored it is credited. With a relay, each instance publishes its shared-tier
events (``locality`` ``REMOTE``: ``BlockStored`` with their tokens, ``BlockRemoved``) on a
Redis channel of its model's namespace, and announces the other instances' as its own:
every instance that can load a shared chunk is credited with it.

    EventRelay(url, namespace)
      .publish(events)          this step's events: the shared tiers' go to the others
      .take() -> list           the others' since the last step (at most QUEUE)
      .close()

Only what a router reads travels: no KV. What arrives is bounded: messages of at most
``MAX_MESSAGE`` bytes, decoded at most ``DECODE_RATE`` bytes a second with msgpack's own
limits, each field checked for the type vLLM's events carry (one bad value would make
vLLM's publisher drop the step's whole batch), at most ``HELD_BYTES`` and ``QUEUE`` events
waiting for the next step; what is refused is dropped and counted. Whoever
can publish on that Redis can sway routing, never what is loaded (every load is
verified). A Redis that does not answer costs the relay, never the engine's step: the
publish is queued to a thread of its own, dropped when the queue is full.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from typing import Any

import msgpack
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from lmtier import metrics

log = logging.getLogger(__name__)

QUEUE = 4096  # events received and not yet announced, at most
MAX_MESSAGE = 256 << 10  # bytes of one relayed message, at most (larger ones are not published)
HELD_BYTES = 8 << 20  # bytes of the messages whose events wait for the next step, at most
DECODE_RATE = 2 << 20  # bytes a second decoded at most (a flood costs the engine's process little)
OUTBOX = 256  # messages waiting to be published, at most
PER_MESSAGE = 64  # events in one message, at most
MAX_TOKENS = 1 << 16  # tokens of one relayed event, at most
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "group_idx",
                 "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership")  # fmt: skip
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")


def channel(namespace: bytes) -> str:
    return f"lmtier:events:{namespace.hex()[:32]}"


def _encode(sender: bytes, events: list) -> bytes:
    items = []
    for e in events:
        if isinstance(e, BlockStored):
            items.append(["stored", {f: getattr(e, f) for f in STORED_FIELDS}])
        elif isinstance(e, BlockRemoved):
            items.append(["removed", {f: getattr(e, f) for f in REMOVED_FIELDS}])
    return msgpack.packb([sender, items], use_bin_type=True)


def _refuse_ext(code: int, data: bytes):
    raise ValueError(f"msgpack extension type {code}")


def _decode(raw: bytes, me: bytes) -> list:
    sender, items = msgpack.unpackb(raw, raw=False, strict_map_key=True, ext_hook=_refuse_ext, timestamp=0,
                                    max_str_len=4096, max_bin_len=4096, max_array_len=MAX_TOKENS,
                                    max_map_len=16, max_ext_len=0)  # fmt: skip
    if sender == me:
        return []
    if not isinstance(items, list) or len(items) > QUEUE:
        raise ValueError("not a list of events")
    out: list = []
    for item in items:
        kind, fields = item
        if not isinstance(fields, dict) or fields.get("locality") != "REMOTE":  # shared tiers' only
            raise ValueError("not a shared tier's event")
        if kind == "stored":
            out.append(BlockStored(**_checked(fields, STORED_FIELDS), lora_id=None, lora_name=None))
        elif kind == "removed":
            out.append(BlockRemoved(**_checked(fields, REMOVED_FIELDS)))
        else:
            raise ValueError(f"unknown event kind {kind!r}")
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 31


def _short(x: Any, kind: type, size: int) -> bool:
    return isinstance(x, kind) and len(x) <= size


def _checked(fields: dict, names: tuple[str, ...]) -> dict:
    """``fields`` with the types vLLM's events carry, or ValueError: one wrong value must
    not make vLLM's publisher drop the step's batch (this instance's own events with it)."""
    out = {f: fields[f] for f in names}
    hashes = out["block_hashes"]
    ok = isinstance(hashes, list) and 0 < len(hashes) <= MAX_TOKENS and all(_short(h, bytes, 64) for h in hashes)
    ok = ok and out["medium"] in ("CPU", "STORAGE") and _is_int(out["group_idx"])
    ok = ok and (out["ownership"] is None or _short(out["ownership"], str, 512))
    if "token_ids" in out:
        tokens, size = out["token_ids"], out["block_size"]
        ok = ok and _is_int(size) and size > 0 and isinstance(tokens, list) and len(tokens) == size * len(hashes)
        ok = ok and all(_is_int(t) for t in tokens) and (out["parent_block_hash"] is None
                                                        or _short(out["parent_block_hash"], bytes, 64))  # fmt: skip
        ok = ok and (out["kv_cache_spec_kind"] is None or _short(out["kv_cache_spec_kind"], str, 64))
        ok = ok and (out["kv_cache_spec_sliding_window"] is None or _is_int(out["kv_cache_spec_sliding_window"]))
    if not ok:
        raise ValueError("a field of the wrong type or size")
    return out


class EventRelay:
    def __init__(self, url: str, namespace: bytes) -> None:
        import redis

        self.channel = channel(namespace)
        self.me = os.urandom(8)
        self._redis = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2, health_check_interval=30)
        self._held: deque = deque()  # (message bytes, its events), oldest first
        self._held_bytes = 0
        self._held_events = 0  # events in _held
        self._budget, self._budget_at = float(DECODE_RATE), time.monotonic()
        self._outbox: queue.Queue = queue.Queue(OUTBOX)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.dropped = 0
        threading.Thread(target=self._listen, name="lmtier-event-relay-in", daemon=True).start()
        threading.Thread(target=self._send, name="lmtier-event-relay-out", daemon=True).start()

    def publish(self, events: list) -> None:
        shared = [e for e in events if getattr(e, "locality", None) == "REMOTE"]
        if not shared:
            return
        for i in range(0, len(shared), PER_MESSAGE):
            batch = shared[i : i + PER_MESSAGE]
            message = _encode(self.me, batch)
            if len(message) > MAX_MESSAGE:  # the others would drop it
                self._drop(len(batch))
                continue
            try:
                self._outbox.put_nowait(message)
            except queue.Full:
                self._drop(len(batch))

    def take(self) -> list:
        with self._lock:
            held, self._held, self._held_bytes, self._held_events = self._held, deque(), 0, 0
        return [event for _, events in held for event in events]

    def close(self) -> None:
        self._stop.set()
        try:
            self._outbox.put_nowait(b"")
        except queue.Full:
            pass
        self._redis.close()

    def _drop(self, n: int) -> None:
        self.dropped += n
        metrics.EVENTS_DROPPED.inc(n)

    def _send(self) -> None:
        while not self._stop.is_set():
            message = self._outbox.get()
            if not message:
                continue
            try:
                self._redis.publish(self.channel, message)
            except Exception as exc:
                log.debug("event relay: publish failed: %s", exc)
                self._drop(1)

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.channel)
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self._receive(message.get("data"))
            except Exception as exc:
                log.debug("event relay: subscription lost: %s", exc)
                self._stop.wait(1.0)

    def _receive(self, raw: Any) -> None:
        if not isinstance(raw, bytes) or len(raw) > MAX_MESSAGE or not self._afford(len(raw)):
            self._drop(1)
            return
        try:
            events = _decode(raw, self.me)
        except Exception:
            self._drop(1)
            return
        if not events:
            return
        with self._lock:  # at most HELD_BYTES of messages and QUEUE events wait: the oldest go
            self._held.append((len(raw), events))
            self._held_bytes += len(raw)
            self._held_events += len(events)
            while self._held and (self._held_bytes > HELD_BYTES or self._held_events > QUEUE):
                size, gone = self._held.popleft()
                self._held_bytes -= size
                self._held_events -= len(gone)
                self._drop(len(gone))

    def _afford(self, size: int) -> bool:
        """Whether ``size`` more bytes fit this second's decoding (``DECODE_RATE``)."""
        now = time.monotonic()
        self._budget = min(float(DECODE_RATE), self._budget + (now - self._budget_at) * DECODE_RATE)
        self._budget_at = now
        if size > self._budget:
            return False
        self._budget -= size
        return True
