"""Real cache servers on port 0 for the grpc:// tier's tests (test_grpc_tier_*.py,
test_grpc_saves.py, test_grpc_directory.py): starting one, one for two tenants, raw calls
written from the ``.proto``, and what a test reads back from a tier or breaks in a server."""

from __future__ import annotations

import grpc
import pytest

from lmtier import metrics
from lmtier.config import ServerConfig
from lmtier.kv.chunk import release_all
from lmtier.server import create_server
from lmtier.server.auth import tenant_tag
from lmtier.store.tiered import TieredStore
from lmtier.v1 import cache_pb2

SERVICE = "/lmtier.v1.CacheService/"


def start(tmp_path=None, **overrides):
    config = ServerConfig(port=0, tiers=overrides.pop("tiers", ("cpu://?size=64MiB&slot=64KiB",)), **overrides)
    server, port = create_server(config)
    return server, port


def flip_a_stored_byte(server, tenant: str, key: bytes) -> None:
    cpu = server.store.tiers[0]
    entry = cpu._index[tenant_tag(tenant) + key]
    cpu.slab.array[entry.slots[0] * cpu.slot_bytes + 100] ^= 0x40


def tenants_server():
    """A server for tenants alice and bob, its ``url`` and ``address`` set: each test file's
    module-scoped ``server`` fixture (which stops it)."""
    srv, port = start(tokens=(("alice-secret", "alice"), ("bob-secret", "bob")))
    srv.url = f"grpc://127.0.0.1:{port}"
    srv.address = f"127.0.0.1:{port}"
    return srv


def tier_errors(tier) -> float:
    """The store's count of a tier's failed calls (every operation)."""
    return sum(
        s.value
        for m in metrics.TIER_ERRORS.collect()
        for s in m.samples
        if s.name.endswith("_total") and s.labels["tier"] == tier.name
    )


def misses_through_a_store(tier, prompt) -> bool:
    """What the engine sees of ``tier`` inside a store: no exception, misses, errors counted."""
    before = tier_errors(tier)
    with TieredStore([tier]) as store:  # closing the store closes the tier
        store.put(prompt.chunks())
        missed = store.lookup(prompt.keys) == 0 and store.get(prompt.keys) == []
    return missed and tier_errors(tier) > before


def read_back(tier, keys) -> list[bytes]:
    """The bytes of the chunks ``tier`` holds for ``keys``, released after reading."""
    got = tier.get(keys)
    try:
        return [c.tobytes() for c in got]
    finally:
        release_all(got)


def raw(address: str, method: str, request, response_type=None, token: str | None = "alice-secret", stream=False):
    """One call on a bare channel; returns the response (or raises the RpcError)."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(address) as channel:
        if method == "Put":
            call = channel.stream_unary(SERVICE + "Put", None, cache_pb2.PutResponse.FromString)
            return call(iter(request), metadata=metadata, timeout=10)
        if method == "Get":
            call = channel.unary_stream(SERVICE + "Get", cache_pb2.GetRequest.SerializeToString, None)
            return list(call(request, metadata=metadata, timeout=10))
        call = channel.unary_unary(SERVICE + method, type(request).SerializeToString, response_type.FromString)
        return call(request, metadata=metadata, timeout=10)


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()
