"""The service's small calls, which move no chunk: what a tenant holds (``List``,
``Stats``, and ``Match`` for routers), ``Delete``, and ``OpenData`` for a ticket to the
bulk data channel.

    ControlMethods   OpenData, Delete, List, Match, Stats: methods of ``CacheService``
        .tenant_keys(tag, limit=None) -> a tenant's distinct keys, fastest tier first

A tenant sees its own chunks only; where several tenants share the server, the tiers'
use, their counters and the settings with the tenants' names are an operator's
(``operators``). Listing walks the tiers' keys, so every listing is bounded (``LIST_MAX``,
``STATS_COUNT_LIMIT``) and a tenant's ``Stats`` answer is reused a while.
"""

from __future__ import annotations

import time

import grpc

from lmtier.server.auth import peer_lane
from lmtier.server.calls import Abort
from lmtier.server.match import match
from lmtier.server.methods.checks import RequestChecks
from lmtier.v1 import cache_pb2

STATS_COUNT_LIMIT = 100_000  # Stats counts a tenant's chunks up to this many (a bounded listing)
STATS_REFRESH_S = 1.0  # a tenant's Stats answer is reused this long
STATS_CACHED = 1024  # tenants whose last answer is kept
LIST_DEFAULT, LIST_MAX = 1000, 100_000


class ControlMethods(RequestChecks):
    """Uses the service's ``store``, ``config`` (``max_keys``), ``auth``, ``data`` (the data
    channel, or None), and for ``Stats`` ``_operators`` (the operators' tags),
    ``_config_json``/``_tenant_config_json`` (the settings, whole and as a tenant sees them)
    and ``_stats``/``_stats_lock`` (the tenants' last answers)."""

    def OpenData(
        self, request: cache_pb2.OpenDataRequest, context: grpc.ServicerContext, tag: bytes
    ) -> cache_pb2.OpenDataResponse:
        if self.data is None:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, "this server runs no data channel")
        lane = peer_lane(tag) if self.auth.reads_only(context.invocation_metadata()) else tag
        return cache_pb2.OpenDataResponse(ticket=self.data.issue(tag, lane), port=self.data.port, tls=self.data.tls)

    def Delete(
        self, request: cache_pb2.DeleteRequest, context: grpc.ServicerContext, tag: bytes
    ) -> cache_pb2.DeleteResponse:
        self.store.delete(self._scoped(tag, request.keys))
        return cache_pb2.DeleteResponse()

    def List(self, request: cache_pb2.ListRequest, context: grpc.ServicerContext, tag: bytes) -> cache_pb2.ListResponse:
        limit = min(request.limit or LIST_DEFAULT, LIST_MAX)
        keys = self.tenant_keys(tag, limit + 1)
        return cache_pb2.ListResponse(keys=[k[len(tag) :] for k in keys[:limit]], truncated=len(keys) > limit)

    def tenant_keys(self, tag: bytes, limit: int | None = None) -> list[bytes]:
        """Distinct keys of one tenant across the tiers that can list (fastest first)."""
        seen: dict[bytes, None] = {}
        for tier in self.store.tiers:
            if not tier.capabilities.listing:
                continue
            for key in tier.keys(tag, limit):
                seen.setdefault(key, None)
            if limit is not None and len(seen) >= limit:
                break
        keys = list(seen)
        return keys if limit is None else keys[:limit]

    def Match(
        self, request: cache_pb2.MatchRequest, context: grpc.ServicerContext, tag: bytes
    ) -> cache_pb2.MatchResponse:
        return match(self.store, request, tag, self.config.max_keys)

    def Stats(
        self, request: cache_pb2.StatsRequest, context: grpc.ServicerContext, tag: bytes
    ) -> cache_pb2.StatsResponse:
        """The caller's own chunks, and the tiers; where several tenants share the server,
        only an operator (``operators``) sees the tiers' use, their counters (every
        tenant's reads and writes) and the settings with the tenants' names. A tenant's answer
        is reused for ``STATS_REFRESH_S`` (an operator's is always fresh): counting a
        tenant's chunks walks the tiers' keys, and a tenant asking in a loop would
        otherwise spend the server's time for all."""
        if self.auth.single_tenant or tag in self._operators:
            return self._stats_answer(tag)  # theirs to spend: always fresh
        now = time.monotonic()
        with self._stats_lock:
            cached = self._stats.get(tag)
            if cached is not None and now - cached[0] < STATS_REFRESH_S:
                return cached[1]
        answer = self._stats_answer(tag)
        with self._stats_lock:
            if len(self._stats) >= STATS_CACHED:
                self._stats.clear()
            self._stats[tag] = (now, answer)
        return answer

    def _stats_answer(self, tag: bytes) -> cache_pb2.StatsResponse:
        own = len(self.tenant_keys(tag, STATS_COUNT_LIMIT))
        if not (self.auth.single_tenant or tag in self._operators):
            tiers = [
                cache_pb2.TierStats(name=str(stats.get("tier", "")), capacity_bytes=int(stats.get("capacity_bytes", 0)))
                for stats in self.store.stats()["tiers"]
            ]
            return cache_pb2.StatsResponse(tiers=tiers, tenant_chunks=own, config_json=self._tenant_config_json)
        tiers = []
        for stats in self.store.stats()["tiers"]:
            counters = {
                k: int(v) for k, v in stats.items() if isinstance(v, int | bool) and k not in _SIZES and int(v) >= 0
            }
            tiers.append(
                cache_pb2.TierStats(
                    name=str(stats.get("tier", "")),
                    capacity_bytes=int(stats.get("capacity_bytes", 0)),
                    used_bytes=int(stats.get("used_bytes", 0)),
                    chunks=int(stats.get("chunks", 0)),
                    counters=counters,
                )
            )
        return cache_pb2.StatsResponse(tiers=tiers, tenant_chunks=own, config_json=self._config_json)


_SIZES = {"capacity_bytes", "used_bytes", "kv_bytes", "chunks"}
