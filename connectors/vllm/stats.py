"""lmtier's figures inside vLLM's own metrics: the connector's stats hooks.

vLLM collects a connector's ``KVConnectorStats`` from every worker each step
(``get_kv_connector_stats``), adds them up (``aggregate``), sends them to its front end as
plain data (``to_dict``), rebuilds them there (``build_kv_connector_stats``), logs them
(``reduce``) and hands them to the connector's Prometheus metrics
(``build_prom_metrics``), which the OpenAI server's ``/metrics`` shows:

    vllm:lmtier_tokens_total{result=loaded|failed|stored|dropped}
        prompt tokens the workers loaded from lmtier, failed to load (recomputed), stored,
        and could not store (a full queue or no free buffer)
    vllm:lmtier_tier_reads_total{tier=NAME, result=hits|misses}
        chunks read from each tier of the workers' stores
    vllm:lmtier_handoffs_total{result=ready|late|down|ignored}
        a decode instance's hand-offs (the scheduler half's: vLLM asks it for stats too)
    vllm:lmtier_object_store_requests_total{tier=NAME, kind=get|put|head|delete|list}
        requests the workers' object-storage tiers sent: what a cloud bill counts

It also tells vLLM where an external hit came from (``hit_sources``): the memory tier is
``host``, a disk tier ``disk``, a peers tier ``p2p`` (another instance's sidecar), a shared
tier (Redis, the cache server) unspecified, as vLLM's ``CacheHitSource`` has no member for
a store every instance reaches.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

TOKEN_RESULTS = ("loaded", "failed", "stored", "dropped")
HANDOFF_RESULTS = ("ready", "late", "down", "ignored")
# a peer's sidecar: another instance's KV (vLLM's p2p); other shared tiers: unspecified
SOURCES = {
    "cpu": CacheHitSource.HOST,
    "file": CacheHitSource.DISK,
    "peers": getattr(CacheHitSource, "P2P", CacheHitSource.EXTERNAL_UNSPECIFIED),
}


def hit_sources(runs: list[tuple[str, int]], chunk_tokens: int, start: int, count: int) -> dict[CacheHitSource, int]:
    """Split ``count`` tokens from ``start`` by the tier (scheme) of the chunk runs that
    hold them (``runs``: (scheme, chunks) in prompt order); sums to ``count``."""
    out: dict[CacheHitSource, int] = {}
    pos, end = 0, start + count
    for scheme, chunks in runs:
        lo, hi = pos, pos + chunks * chunk_tokens
        n = max(0, min(hi, end) - max(lo, start))
        if n:
            source = SOURCES.get(scheme, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + n
        pos = hi
    rest = count - sum(out.values())
    if rest > 0:
        out[CacheHitSource.EXTERNAL_UNSPECIFIED] = out.get(CacheHitSource.EXTERNAL_UNSPECIFIED, 0) + rest
    return out


@dataclass
class LMTierStats(KVConnectorStats):
    """``{"tokens": {result: n}, "tiers": {name: {"hits": n, "misses": n}}, "handoffs":
    {result: n}, "requests": {name: {kind: n}}}``: plain data."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> LMTierStats:
        mine, theirs = self.data, other.data
        tokens, handoffs = _added(mine, theirs, "tokens"), _added(mine, theirs, "handoffs")
        tiers, requests = _nested(mine, theirs, "tiers"), _nested(mine, theirs, "requests")
        return LMTierStats({"tokens": tokens, "tiers": tiers, "handoffs": handoffs, "requests": requests})

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {f"{k}_tokens": v for k, v in self.data.get("tokens", {}).items()}
        out.update({f"handoffs_{k}": v for k, v in self.data.get("handoffs", {}).items()})
        for name, counts in self.data.get("tiers", {}).items():
            out.update({f"{name}_{k}": v for k, v in counts.items()})
        for name, counts in self.data.get("requests", {}).items():
            out.update({f"{name}_requests_{k}": v for k, v in counts.items()})
        return out

    def is_empty(self) -> bool:
        return not any(self.reduce().values())


def _added(mine: dict[str, Any], theirs: dict[str, Any], part: str) -> dict[str, int]:
    out = dict(mine.get(part, {}))
    for k, v in theirs.get(part, {}).items():
        out[k] = out.get(k, 0) + v
    return out


def _nested(mine: dict[str, Any], theirs: dict[str, Any], part: str) -> dict[str, dict[str, int]]:
    out = {name: dict(c) for name, c in mine.get(part, {}).items()}
    for name, counts in theirs.get(part, {}).items():
        into = out.setdefault(name, {})
        for k, v in counts.items():
            into[k] = into.get(k, 0) + v
    return out


def _since(now: dict[str, dict[str, int]], was: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Each name's counts that grew since ``was``, by how much."""
    out = {}
    for name, counts in now.items():
        before = was.get(name, {})
        grown = {k: v - before.get(k, 0) for k, v in counts.items() if v != before.get(k, 0)}
        if grown:
            out[name] = grown
    return out


class Interval:
    """A worker's figures since it last reported (thread-safe: the saver thread counts too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens = dict.fromkeys(TOKEN_RESULTS, 0)
        self._handoffs = dict.fromkeys(HANDOFF_RESULTS, 0)
        self._reads: dict[str, tuple[int, int]] = {}
        self._requests: dict[str, dict[str, int]] = {}

    def count(self, result: str, tokens: int) -> None:
        with self._lock:
            self._tokens[result] += tokens

    def handoff(self, result: str) -> None:
        with self._lock:
            self._handoffs[result] += 1

    def take(
        self, reads: dict[str, tuple[int, int]], requests: dict[str, dict[str, int]] | None = None
    ) -> LMTierStats | None:
        """This interval's stats (``reads`` and ``requests``: the store's totals now), or
        None if nothing happened; the next interval starts."""
        with self._lock:
            tokens, self._tokens = self._tokens, dict.fromkeys(TOKEN_RESULTS, 0)
            handoffs, self._handoffs = self._handoffs, dict.fromkeys(HANDOFF_RESULTS, 0)
            tiers = {}
            for name, (hits, misses) in reads.items():
                was = self._reads.get(name, (0, 0))
                if (hits, misses) != was:
                    tiers[name] = {"hits": hits - was[0], "misses": misses - was[1]}
            self._reads = dict(reads)
            sent = _since(requests or {}, self._requests)
            if requests is not None:
                self._requests = {name: dict(c) for name, c in requests.items()}
        stats = LMTierStats({"tokens": {k: v for k, v in tokens.items() if v}, "tiers": tiers,
                             "handoffs": {k: v for k, v in handoffs.items() if v}, "requests": sent})  # fmt: skip
        return None if stats.is_empty() else stats


class LMTierPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._tokens = self._counter_cls(
            name="vllm:lmtier_tokens",
            documentation="Prompt tokens lmtier loaded, failed to load (recomputed), stored, or dropped.",
            labelnames=[*labelnames, "result"],
        )
        self._reads = self._counter_cls(
            name="vllm:lmtier_tier_reads",
            documentation="Chunks read from each lmtier tier: hits and misses.",
            labelnames=[*labelnames, "tier", "result"],
        )
        self._requests = self._counter_cls(
            name="vllm:lmtier_object_store_requests",
            documentation="Requests lmtier's object-storage tiers sent (what a cloud bill counts), by kind.",
            labelnames=[*labelnames, "tier", "kind"],
        )
        self._handoffs = self._counter_cls(
            name="vllm:lmtier_handoffs",
            documentation="A decode instance's hand-offs from its prefill instance: ready, late, down, ignored.",
            labelnames=[*labelnames, "result"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues[engine_idx]
        for result, n in transfer_stats_data.get("tokens", {}).items():
            if n:
                self._tokens.labels(*values, result).inc(n)
        for result, n in transfer_stats_data.get("handoffs", {}).items():
            if n:
                self._handoffs.labels(*values, result).inc(n)
        for tier, counts in transfer_stats_data.get("tiers", {}).items():
            for result, n in counts.items():
                if n > 0:
                    self._reads.labels(*values, tier, result).inc(n)
        for tier, counts in transfer_stats_data.get("requests", {}).items():
            for kind, n in counts.items():
                if n > 0:
                    self._requests.labels(*values, tier, kind).inc(n)
