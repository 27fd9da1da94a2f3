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

Only what a router reads travels: no KV. What arrives is bounded (``QUEUE`` events,
messages of at most ``MAX_MESSAGE`` bytes, malformed ones dropped and counted); whoever
can publish on that Redis can sway routing, never what is loaded (every load is
verified). A Redis that does not answer costs the relay, never the engine's step: the
publish is queued to a thread of its own, dropped when the queue is full.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from typing import Any

import msgpack
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from lmtier import metrics

log = logging.getLogger(__name__)

QUEUE = 4096  # events received and not yet announced, at most
MAX_MESSAGE = 4 << 20  # bytes of one relayed message, at most
OUTBOX = 256  # messages waiting to be published, at most
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


def _decode(raw: bytes, me: bytes) -> list:
    sender, items = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    if sender == me:
        return []
    out: list = []
    for kind, fields in items:
        if not isinstance(fields, dict) or fields.get("locality") != "REMOTE":  # shared tiers' only
            raise ValueError("not a shared tier's event")
        if kind == "stored":
            out.append(BlockStored(**{f: fields[f] for f in STORED_FIELDS}, lora_id=None, lora_name=None))
        elif kind == "removed":
            out.append(BlockRemoved(**{f: fields[f] for f in REMOVED_FIELDS}))
        else:
            raise ValueError(f"unknown event kind {kind!r}")
    return out


class EventRelay:
    def __init__(self, url: str, namespace: bytes) -> None:
        import redis

        self.channel = channel(namespace)
        self.me = os.urandom(8)
        self._redis = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2, health_check_interval=30)
        self._received: deque = deque(maxlen=QUEUE)
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
        try:
            self._outbox.put_nowait(_encode(self.me, shared))
        except queue.Full:
            self._drop(len(shared))

    def take(self) -> list:
        with self._lock:
            out = list(self._received)
            self._received.clear()
        return out

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
        if not isinstance(raw, bytes) or len(raw) > MAX_MESSAGE:
            self._drop(1)
            return
        try:
            events = _decode(raw, self.me)
        except Exception:
            self._drop(1)
            return
        with self._lock:
            overflow = len(self._received) + len(events) - QUEUE
            if overflow > 0:
                self._drop(overflow)
            self._received.extend(events)
