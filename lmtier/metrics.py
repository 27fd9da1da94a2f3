"""Every Prometheus metric lmtier exports, defined once.

They live in lmtier's own ``REGISTRY`` rather than prometheus-client's global one, so an
engine that exports its own metrics never collides with ours; the server and the engine
adapters expose this registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

TIER_OPS = Counter(
    "lmtier_tier_ops_total",
    "Chunk operations per tier and result (hit, miss, stored, dropped).",
    ["tier", "op", "result"],
    registry=REGISTRY,
)
TIER_BYTES = Counter(
    "lmtier_tier_bytes_total",
    "Chunk payload bytes read from or written to a tier.",
    ["tier", "op"],
    registry=REGISTRY,
)
TIER_SECONDS = Histogram(
    "lmtier_tier_op_seconds",
    "Latency of one call into a tier (a batch of chunks), per tier and operation.",
    ["tier", "op"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    registry=REGISTRY,
)
BREAKER_OPEN = Gauge(
    "lmtier_tier_breaker_open",
    "1 while a tier's circuit breaker is open (calls skipped as misses), else 0.",
    ["tier"],
    registry=REGISTRY,
)
TIER_ERRORS = Counter(
    "lmtier_tier_errors_total",
    "Tier calls that failed and were turned into misses.",
    ["tier", "op"],
    registry=REGISTRY,
)
SLOT_MAP_REFRESHES = Counter(
    "lmtier_redis_slot_map_refreshes_total",
    "Slot maps a Redis Cluster tier asked for, by what made it ask (moved, connection).",
    ["tier", "reason"],
    registry=REGISTRY,
)
SLOT_MAP_CHANGES = Counter(
    "lmtier_redis_slot_map_changes_total",
    "Slot maps learnt that differ from the one before (a failover, a reshard, a node added or lost).",
    ["tier"],
    registry=REGISTRY,
)
EVICTIONS = Counter(
    "lmtier_evictions_total",
    "Chunks evicted to make room.",
    ["tier"],
    registry=REGISTRY,
)
OBJECT_REQUESTS = Counter(
    "lmtier_object_store_requests_total",
    "Requests an object-storage tier sent (what a cloud bill counts): get, put (each part of a "
    "multipart upload and its start and end), head, delete, list.",
    ["tier", "kind"],
    registry=REGISTRY,
)
INTEGRITY_FAILURES = Counter(
    "lmtier_integrity_failures_total",
    "Stored chunks that failed verification and were dropped.",
    ["tier"],
    registry=REGISTRY,
)
TIER_USED_BYTES = Gauge(
    "lmtier_tier_used_bytes",
    "Bytes of chunks held by a tier.",
    ["tier"],
    registry=REGISTRY,
)
TIER_CAPACITY_BYTES = Gauge(
    "lmtier_tier_capacity_bytes",
    "Configured capacity of a tier.",
    ["tier"],
    registry=REGISTRY,
)
WRITE_QUEUE_DROPS = Counter(
    "lmtier_write_queue_drops_total",
    "Background writes dropped because the queue was full.",
    ["tier"],
    registry=REGISTRY,
)
UNWRITTEN_CHUNKS = Counter(
    "lmtier_unwritten_chunks_total",
    "Chunks put into the first tier that never reached this lower tier (not kept, or the queue was full).",
    ["tier"],
    registry=REGISTRY,
)
EVENTS_DROPPED = Counter(
    "lmtier_events_dropped_total",
    "Tier events (chunks stored or removed, for routers) dropped: the queue was full between two drains.",
    registry=REGISTRY,
)
PROMOTIONS = Counter(
    "lmtier_promotions_total",
    "Chunks copied up into a faster tier after a hit.",
    ["tier"],
    registry=REGISTRY,
)
LOAD_DEADLINES = Counter(
    "lmtier_load_deadlines_total",
    "Loads cut short by the load deadline (the engine recomputed the rest).",
    registry=REGISTRY,
)
LOOKUP_TOKENS = Counter(
    "lmtier_lookup_tokens_total",
    "Tokens asked for and tokens found by prefix lookups.",
    ["result"],
    registry=REGISTRY,
)
ENGINE_TOKENS = Counter(
    "lmtier_engine_tokens_total",
    "Prompt tokens seen by an engine adapter: requested (looked up), hit (found), loaded "
    "(copied into the engine), failed (a load that failed and was recomputed), stored, dropped "
    "(a save with no free buffer or a full queue: a future miss).",
    ["engine", "result"],
    registry=REGISTRY,
)
HANDOFF_WAIT = Histogram(
    "lmtier_handoff_wait_seconds",
    "Prefill/decode disaggregation: how long a producer's step held its output for its chunks "
    "to reach every tier (kv_role kv_producer, no parameters forwarded).",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)
HANDOFFS = Counter(
    "lmtier_handoffs_total",
    "Prefill/decode disaggregation on a decode instance: forwarded hand-offs by outcome "
    "(ready: every chunk readable in time; late: the deadline passed first; down: the shared "
    "tier stopped answering; ignored: of another model, layout or prompt).",
    ["result"],
    registry=REGISTRY,
)
PEER_CHUNKS = Counter(
    "lmtier_peer_chunks_total",
    "Chunks this instance asked other instances' sidecars for, per peer (host:port) and result "
    "(hit, miss, error: the peer failed or answered too late).",
    ["peer", "result"],
    registry=REGISTRY,
)
PEER_BYTES = Counter(
    "lmtier_peer_bytes_total",
    "Chunk payload bytes loaded from other instances' sidecars, per peer (host:port).",
    ["peer"],
    registry=REGISTRY,
)
# The cache server's own figures live apart: an engine's exporter would otherwise show a
# server gauge (lmtier_server_ready 0) that an alert would read as a server down.
SERVER_REGISTRY = CollectorRegistry(auto_describe=True)
SERVER_RPCS = Counter(
    "lmtier_server_rpcs_total",
    "Calls the cache server finished, per method and gRPC status code.",
    ["method", "code"],
    registry=SERVER_REGISTRY,
)
SERVER_DIRECTORY_READS = Counter(
    "lmtier_server_directory_reads_total",
    "Chunks same-host clients read through the published directory, with no Get (as they report them).",
    registry=SERVER_REGISTRY,
)
SERVER_BYTES = Counter(
    "lmtier_server_bytes_total",
    "Frame bytes the cache server received (put) and sent (get), per transport (grpc, shm).",
    ["direction", "transport"],
    registry=SERVER_REGISTRY,
)
SERVER_INFLIGHT = Gauge(
    "lmtier_server_inflight_rpcs",
    "Calls the cache server is serving now.",
    registry=SERVER_REGISTRY,
)
SERVER_CANCELLED = Counter(
    "lmtier_server_cancelled_total",
    "Calls the cache server cancelled: stalled on their client, or over the call time limit.",
    ["reason"],
    registry=SERVER_REGISTRY,
)
SERVER_REFUSED = Counter(
    "lmtier_server_refused_total",
    "Calls refused when their headers arrived, before any worker or memory: unauthenticated.",
    registry=SERVER_REGISTRY,
)
SERVER_PEER_CHUNKS = Counter(
    "lmtier_server_peer_chunks_total",
    "Chunks the cache server served to other instances (callers with a peer's read-only token).",
    registry=SERVER_REGISTRY,
)
SERVER_READY = Gauge(
    "lmtier_server_ready",
    "1 when every tier of the cache server passed its last probe, else 0.",
    registry=SERVER_REGISTRY,
)


_EXPORTERS: dict[tuple[int, int], object] = {}  # (pid, port) -> server


def export(port: int, host: str = "0.0.0.0") -> bool:
    """Serve ``REGISTRY`` on ``http://host:port/metrics`` from this process (idempotent).
    A port that cannot be bound is logged and skipped: metrics never stop an engine."""
    import logging
    import os

    from prometheus_client import start_http_server

    key = (os.getpid(), port)
    if key in _EXPORTERS:
        return True
    try:
        _EXPORTERS[key] = start_http_server(port, addr=host, registry=REGISTRY)
    except OSError as exc:
        logging.getLogger(__name__).warning("lmtier: cannot serve metrics on port %d: %s", port, exc)
        return False
    return True
