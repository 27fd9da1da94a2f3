"""lmtier's tiers in vLLM's KV event stream (``KVEventsConfig``: the ZMQ publisher routers
subscribe to), beside vLLM's own events for its GPU blocks.

    WorkerEvents(store, rank, tp_size)     worker side: the store's tier records, per step
      .remember(local_keys, lead_keys)     which rank-0 key names a chunk this rank holds
      .take() -> LMTierKVEvents | None     for get_kv_connector_kv_cache_events
    EventBook(tier_urls, chunk_tokens, tp_size)    scheduler side
      .remember(keys, tokens)              the token ids behind a request's chunk keys
      .absorb(LMTierKVEvents)              from update_connector_output
      .take() -> list[KVCacheEvent]        for take_events: vLLM publishes them

What each event says:

- ``BlockStored`` when chunks land in a tier, ``BlockRemoved`` when a tier evicts or
  deletes them (or drops one that failed its check). A chunk is announced as the
  engine's blocks (``event_blocks: engine``: ``block_size`` the engine's, each block's
  hash the chunk's key and the block's place in it, two bytes), so that a router that
  indexes one block size (vllm-router's ``kv_aware``) takes them beside vLLM's own; or as
  one block (``event_blocks: chunk``: ``block_size`` the chunk size, the hash its key).
  Keys are rank 0's, so every rank of a tensor-parallel engine names a chunk alike, each
  a hash of all the tokens before it; ``parent_block_hash`` is the previous chunk's last
  block; ``token_ids`` the chunks' tokens. A router can rebuild the prefix from the
  tokens alone.
- ``medium``: ``CPU`` for the memory tier, ``STORAGE`` for a local disk, ``CPU`` for Redis
  and a cache server (memory, elsewhere), ``STORAGE`` for an object store (S3).
  ``locality``: ``LOCAL`` for this instance's own tiers, ``REMOTE`` for a tier every
  instance reaches. ``ownership`` (``tier_labels``)
  names who holds the chunks: a shared tier alike from every instance however its URL is
  written (never a secret), so a router counts a shared chunk once rather than as each
  pod's; a disk by host and directory. The memory tier has none: it is the instance's own
  host memory (vllm-router credits a chunk with an owner at its "external" rate, one in
  host memory at its "host" rate).
- With tensor parallelism a chunk is stored once every rank has stored its slice, and
  removed as soon as one rank has lost its own.
- After vLLM resets its cache with the connector (a weight update), the instance has moved
  to a fresh namespace and serves nothing it announced before: vLLM's own
  ``AllBlocksCleared`` (no medium: every tier of the instance) says so.
- Stores are published at the step after they land (a save finishes in the background);
  an idle engine publishes at its next step. With ``event_relay`` (connectors/vllm/relay.py)
  the shared tiers' events of every instance of the model are announced by each. What a
  tier evicts on its own (Redis, a cache server, another process sharing a disk) is not
  seen here: routers ask a shared tier (``lmtier match``, the server's ``Match``).

Bounded: the store's queue (``lmtier.store.events``, drops counted), the book of token ids
(``BOOK_CHUNKS``), the pending tensor-parallel counts and the worker's key map.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)

from lmtier import metrics
from lmtier.tiers.base import DEFAULT_PORTS, TierURL

BOOK_CHUNKS = 1 << 16  # chunks whose tokens the scheduler keeps for events (~chunk_tokens x 4 bytes each)
TENANT_SEED = b"lmtier.tenant\x00"  # what a cache server tenant's digest in ownership is seeded with
TENANT_ROUNDS = 200_000  # PBKDF2 rounds of that digest (~0.1 s once per token and process)
SHARED_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster", "unix", "grpc", "grpcs")


def tier_labels(url: str) -> tuple[str, str, str]:
    """(medium, locality, ownership) of the tier a URL opens. ``ownership`` names what the
    tier's chunks are shared by, the same however the URL is written (user info,
    passwords, option order, the host's case and a default port or database left out): a
    Redis key space (server, database, key prefix), a cache server and the caller's tenant
    on it (a slow digest of the bearer token, never the token), a disk directory on this
    host; the memory tier is this instance's own (host and process)."""
    parsed = TierURL.parse(url)
    scheme, opts = parsed.scheme, parsed.options
    if scheme in ("grpc", "grpcs"):
        token = opts.get("token") or os.environ.get(opts.get("token_env", "LMTIER_TOKEN"), "")
        where = _endpoints(parsed.netloc, DEFAULT_PORTS["grpc"])
        tenant = f"/tenant={tenant_digest(token, where)}" if token else ""
        return MEDIUM_CPU, "REMOTE", f"lmtier:grpc://{where}{tenant}"
    if scheme in SHARED_SCHEMES:  # Redis: its key space
        if scheme == "unix":
            where = f"redis+unix://{parsed.path}"
        else:
            where = f"{scheme.replace('rediss', 'redis')}://{_endpoints(parsed.netloc, DEFAULT_PORTS['redis'])}"
        db = opts.get("db") or ("" if scheme == "unix" else parsed.path.strip("/"))
        space = [f"db={db}"] if db and db != "0" else []
        space += [f"prefix={opts['prefix']}"] if opts.get("prefix", "lmtier:") != "lmtier:" else []
        return MEDIUM_CPU, "REMOTE", f"lmtier:{where}" + (f"?{'&'.join(space)}" if space else "")
    if scheme == "s3":  # a bucket's prefix, wherever it is served from (AWS's region, or an endpoint)
        endpoint = opts.get("endpoint", "").rstrip("/").lower()
        where = endpoint.split("://", 1)[-1] if endpoint else f"s3.{opts.get('region') or 'aws'}"
        prefix = parsed.path.strip("/") or "lmtier"
        return MEDIUM_STORAGE, "REMOTE", f"lmtier:s3://{where}/{parsed.netloc}/{prefix}"
    if scheme == "file":  # shared by the instances on this host that name the same directory
        return MEDIUM_STORAGE, "LOCAL", f"lmtier:file://{socket.gethostname()}{os.path.abspath(parsed.path)}"
    # a memory tier is this process's alone: no owner but the instance, whose event stream
    # this is (routers credit a chunk with an owner as a shared pool's, vllm-router at its
    # "external" rate rather than as host memory)
    return MEDIUM_CPU, "LOCAL", ""


def _endpoints(netloc: str, default_port: int) -> str:
    """``host:port[,host:port...]`` of a URL's authority, written one way: no user info,
    hosts in lower case, the scheme's default port where none is given."""
    hosts = []
    for host in netloc.rsplit("@", 1)[-1].split(","):
        host = host.strip().lower()
        bracketed = host.startswith("[")  # an IPv6 address: its port follows the ']'
        has_port = host.rsplit("]", 1)[-1].count(":") == 1 if bracketed else host.count(":") == 1
        hosts.append(host if has_port or not host else f"{host}:{default_port}")
    return ",".join(sorted(hosts))  # a cluster named by the same nodes in another order is the same


@functools.lru_cache(maxsize=16)
def tenant_digest(token: str, server: str) -> str:
    """A cache server tenant's name in events: a digest of its bearer token that is the
    same from every instance of a fleet yet slow to test guesses against (PBKDF2, 200,000
    rounds, all 256 bits: the events stream is readable by whoever reaches the
    publisher's socket), salted by the server's address and ``LMTIER_EVENTS_SALT`` (set
    it to a secret of the deployment's): a table of guesses made for one deployment is
    worth nothing at another."""
    salt = TENANT_SEED + server.encode() + b"\x00" + os.environ.get("LMTIER_EVENTS_SALT", "").encode()
    return hashlib.pbkdf2_hmac("sha256", token.encode(), salt, TENANT_ROUNDS).hex()


class LMTierKVEvents(KVConnectorKVEvents):
    """Records ``(rank, kind, tier, keys)`` from the workers of one step (vLLM adds the
    workers' lists up; ``EventBook`` makes events of them)."""

    def __init__(self, records: list[tuple] | None = None, workers: int = 1) -> None:
        self.records = list(records or [])
        self.workers = workers

    def add_events(self, events: list[Any]) -> None:
        self.records.extend(events)

    def aggregate(self) -> LMTierKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list[Any]:
        return list(self.records)

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.records.clear()


class WorkerEvents:
    def __init__(self, store: Any, rank: int, tp_size: int) -> None:
        self.queue = store.watch()
        self.rank, self.tp_size = rank, tp_size
        self._lead: OrderedDict[bytes, bytes] = OrderedDict()  # this rank's key -> rank 0's
        self._lock = threading.Lock()  # the save thread remembers, the step takes

    def remember(self, local: Sequence[bytes], lead: Sequence[bytes]) -> None:
        if self.tp_size == 1:
            return  # rank 0's keys are ours
        with self._lock:
            for mine, first in zip(local, lead, strict=False):
                self._lead[mine] = first
                self._lead.move_to_end(mine)
            while len(self._lead) > BOOK_CHUNKS:
                self._lead.popitem(last=False)

    def take(self) -> LMTierKVEvents | None:
        records = []
        for record in self.queue.drain():
            if self.tp_size == 1:
                keys = list(record.keys)
            else:
                with self._lock:
                    keys = [self._lead[k] for k in record.keys if k in self._lead]
                if len(keys) < len(record.keys):
                    metrics.EVENTS_DROPPED.inc(len(record.keys) - len(keys))
            if keys:
                records.append((self.rank, record.kind, record.tier, keys))
        return LMTierKVEvents(records) if records else None


def group_specs(kv_cache_config: Any) -> list[tuple[str | None, int | None]]:
    """(kind, sliding window) of each KV cache group, as vLLM's own events describe a
    group: what lets a router tell a sliding-window group's chunks from full attention's."""
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
    except ImportError:  # a vLLM without them: groups go undescribed
        return []
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return [
        (get_kv_cache_spec_kind(g.kv_cache_spec).value, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
        for g in groups
    ]


class EventBook:
    def __init__(
        self,
        tier_urls: Sequence[str],
        chunk_tokens: int,
        tp_size: int,
        specs: Sequence[tuple[str | None, int | None]] = (),
        block_size: int = 0,
    ) -> None:
        self.labels = [tier_labels(u) for u in tier_urls]
        # blocks per chunk in the events (block_size: the engine's, which a chunk is a multiple of)
        self.per = chunk_tokens // block_size if block_size and chunk_tokens % block_size == 0 else 1
        self.specs = list(specs)  # per KV cache group: (kind, sliding window)
        self.chunk_tokens = chunk_tokens
        self.tp_size = tp_size
        # key -> (parent, int32 tokens, KV cache group)
        self._tokens: OrderedDict[bytes, tuple[bytes | None, bytes, int]] = OrderedDict()
        self._ranks: OrderedDict[tuple[int, bytes], set[int]] = OrderedDict()  # stored by some ranks so far
        self._ready: list[tuple[int, bytes]] = []  # (tier, key) stored by every rank
        self._removed: list[tuple[int, bytes]] = []

    def clear(self) -> None:
        """The engine's cache was reset with its connector: nothing announced before
        serves it any longer. vLLM publishes ``AllBlocksCleared`` for the reset itself (an
        event of no medium: every tier of the instance); the records still in flight are
        dropped here."""
        self._tokens.clear()
        self._ranks.clear()
        self._ready, self._removed = [], []

    def remember(self, keys: Sequence[bytes], tokens: Any, first: int = 0, group: int = 0) -> None:
        """The token ids behind ``keys[first:]`` (rank 0's keys of a request's full chunks,
        in one KV cache group of the model's)."""
        flat = np.asarray(tokens, dtype=np.int32)
        n = self.chunk_tokens
        for i in range(first, min(len(keys), len(flat) // n)):
            self._tokens[keys[i]] = (keys[i - 1] if i else None, flat[i * n : (i + 1) * n].tobytes(), group)
            self._tokens.move_to_end(keys[i])
        while len(self._tokens) > BOOK_CHUNKS:
            self._tokens.popitem(last=False)

    def absorb(self, events: LMTierKVEvents) -> None:
        for rank, kind, tier, keys in events.get_all_events():
            for key in keys:
                if kind == "removed":
                    self._ranks.pop((tier, key), None)
                    self._removed.append((tier, key))
                    continue
                ranks = self._ranks.setdefault((tier, key), set())
                ranks.add(rank)
                if len(ranks) >= self.tp_size:
                    del self._ranks[(tier, key)]
                    self._ready.append((tier, key))
        while len(self._ranks) > BOOK_CHUNKS:
            self._ranks.popitem(last=False)

    def take(self) -> list[KVCacheEvent]:
        """This step's events in the order things happened per tier: stores, then removals
        (a chunk stored and evicted within one step is announced both ways)."""
        events: list[KVCacheEvent] = []
        ready, self._ready = self._ready, []
        removed, self._removed = self._removed, []
        for tier, run in _runs(ready, self._tokens):
            medium, locality, ownership = self.labels[tier]
            parent, _, group = self._tokens[run[0]]
            kind, window = self.specs[group] if group < len(self.specs) else (None, None)
            events.append(
                BlockStored(
                    block_hashes=self._blocks(run),
                    parent_block_hash=self._blocks([parent])[-1] if parent is not None else None,
                    token_ids=np.frombuffer(b"".join(self._tokens[k][1] for k in run), dtype=np.int32).tolist(),
                    block_size=self.chunk_tokens // self.per,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    group_idx=group,
                    kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=window,
                    locality=locality,
                    ownership=ownership or None,
                )
            )
        unknown = sum(1 for _, k in ready if k not in self._tokens)
        if unknown:  # no tokens to describe them with (older than the book): not announced
            metrics.EVENTS_DROPPED.inc(unknown)
        by_tier: dict[tuple[int, int], dict[bytes, None]] = {}  # (tier, group) -> keys, in order
        for tier, key in removed:
            known = self._tokens.get(key)
            by_tier.setdefault((tier, known[2] if known else 0), {})[key] = None
        for (tier, group), keys in by_tier.items():
            medium, locality, ownership = self.labels[tier]
            events.append(
                BlockRemoved(
                    block_hashes=self._blocks(keys),
                    medium=medium,
                    group_idx=group,
                    locality=locality,
                    ownership=ownership or None,
                )
            )
        return events

    def _blocks(self, keys) -> list[bytes]:
        """The hashes of the blocks of chunks ``keys``: the chunk keys themselves (one block
        a chunk), or each key followed by its block's index in two bytes."""
        if self.per == 1:
            return list(keys)
        return [key + j.to_bytes(2, "big") for key in keys for j in range(self.per)]


def _runs(ready: list[tuple[int, bytes]], book: OrderedDict) -> list[tuple[int, list[bytes]]]:
    """Stored keys grouped into chains (each key's parent the one before it), per tier."""
    runs: list[tuple[int, list[bytes]]] = []
    for tier, key in ready:
        if key not in book:
            continue
        if runs and runs[-1][0] == tier and book[key][0] == runs[-1][1][-1]:  # the same group
            runs[-1][1].append(key)
        else:
            runs.append((tier, [key]))
    return runs
