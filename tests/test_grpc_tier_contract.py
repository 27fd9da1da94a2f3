"""The grpc:// tier against real cache servers on port 0: the shared tier contract over each
transport (the bulk data channel, plain gRPC messages, shared memory), tenants kept apart,
TLS and mutual TLS, and what the tier answers (Stats and List per tenant, a chunk's layout).

Bad input, failures, readiness and health are in test_grpc_tier_faults.py; shared memory
and leases in test_grpc_tier_shm.py.
"""

from __future__ import annotations

import json

import grpc
import pytest

from lmtier import metrics
from lmtier.errors import RetryableError, TierError
from lmtier.kv.chunk import release_all
from lmtier.server.auth import tenant_tag
from lmtier.testing.certs import make_certificates
from lmtier.tiers.base import open_tier
from lmtier.v1 import cache_pb2

from conftest import SMALL, make_namespace, make_prompt
from grpc_servers import (
    code_of,
    flip_a_stored_byte,
    misses_through_a_store,
    raw,
    read_back,
    start,
    tenants_server,
)
from tier_contract import EvictingTierContract


def shm_bytes(direction: str) -> float:
    labels = {"direction": direction, "transport": "shm"}
    return metrics.SERVER_REGISTRY.get_sample_value("lmtier_server_bytes_total", labels) or 0


def grpc_bytes(direction: str) -> float:
    labels = {"direction": direction, "transport": "grpc"}
    return metrics.SERVER_REGISTRY.get_sample_value("lmtier_server_bytes_total", labels) or 0


class TestGrpcTier(EvictingTierContract):
    """The shared contract over TCP (the server's bulk data channel): each tier gets its own
    server, bounded like the tier."""

    shm = "off"
    data = "true"

    @pytest.fixture(autouse=True)
    def _servers(self):
        self.servers = {}
        yield
        for server in self.servers.values():
            server.stop(0)

    def make_tier(self, capacity_chunks, chunk_bytes):
        server, port = start(tiers=(f"cpu://?size={capacity_chunks * chunk_bytes}&slot={chunk_bytes}",))
        tier = open_tier(f"grpc://127.0.0.1:{port}?shm={self.shm}&data={self.data}")
        self.servers[id(tier)] = server
        return tier

    def corrupt(self, tier, key):
        flip_a_stored_byte(self.servers[id(tier)], "default", key)


class TestGrpcTierPlainGrpc(TestGrpcTier):
    """The same contract with frame bytes in gRPC messages (a server without a data channel)."""

    data = "false"

    @pytest.fixture(autouse=True)
    def _through_grpc(self, _servers):
        before = grpc_bytes("put") + grpc_bytes("get")
        yield
        assert grpc_bytes("put") + grpc_bytes("get") > before, "no frame went through gRPC messages"


class TestGrpcTierSharedMemory(TestGrpcTier):
    """The same contract with frame bytes moving through the client's shared memory (saves
    too: no data channel)."""

    shm = "on"
    data = "false"

    @pytest.fixture(autouse=True)
    def _through_shared_memory(self, _servers):
        before = shm_bytes("put") + shm_bytes("get")
        yield
        assert shm_bytes("put") + shm_bytes("get") > before, "no frame went through shared memory"


@pytest.fixture(scope="module")
def server():
    srv = tenants_server()
    yield srv
    srv.stop(0)


# -- tenants ----------------------------------------------------------------------------------
def test_no_token_or_a_wrong_token_is_unauthenticated(server):
    lookup = cache_pb2.LookupRequest(keys=[make_prompt(1).keys[0]])
    for token in (None, "nope", "alice-secret-but-longer"):
        assert code_of(lambda t=token: raw(server.address, "Lookup", lookup, cache_pb2.LookupResponse, t)) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
    assert code_of(lambda: raw(server.address, "Get", cache_pb2.GetRequest(keys=lookup.keys), token=None)) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    # The tier raises a refusal as an error not worth retrying; the store the engine
    # calls turns it into misses and a count, not an exception.
    tier = open_tier(server.url + "?token=wrong&retries=0")
    prompt = make_prompt(2, seed=41)
    with pytest.raises(TierError) as info:
        tier.contains(prompt.keys)
    assert not isinstance(info.value, RetryableError) and "UNAUTHENTICATED" in str(info.value)
    assert misses_through_a_store(tier, prompt)


def test_a_tenant_cannot_read_list_delete_or_probe_another_tenants_chunks(server, monkeypatch):
    alice = open_tier(server.url + "?token=alice-secret")
    monkeypatch.setenv("LMTIER_TOKEN", "bob-secret")  # the token may come from the environment
    bob = open_tier(server.url)
    try:
        prompt = make_prompt(4, seed=42)
        alice.put(prompt.chunks())
        assert alice.contains(prompt.keys) == 4
        assert bob.contains(prompt.keys) == 0  # probe
        assert bob.get(prompt.keys) == [None] * 4  # read
        assert not set(bob.keys()) & set(prompt.keys)  # list
        assert set(prompt.keys) <= set(alice.keys())
        bob.delete(prompt.keys)  # delete
        assert alice.contains(prompt.keys) == 4
        assert bob.stats()["chunks"] == 0 and alice.stats()["chunks"] >= 4
        # Bob storing other bytes under the same keys gets his own copies; Alice's stay.
        other = make_prompt(4, seed=43)
        bob.put([c.view_as(k) for c, k in zip(other.chunks(), prompt.keys, strict=True)])
        for tier, owner in ((alice, prompt), (bob, other)):
            assert read_back(tier, prompt.keys) == [owner.chunk_bytes(i) for i in range(4)]
    finally:
        alice.close()
        bob.close()


# -- TLS ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("certs"), clients=("carol", "dave"))


def test_tls_serves_clients_that_trust_its_ca_and_refuses_plaintext(certs):
    srv, port = start(tls_cert=certs["server.crt"], tls_key=certs["server.key"])
    try:
        prompt = make_prompt(3, seed=44)
        good = open_tier(f"grpcs://localhost:{port}?tls_ca={certs['ca.crt']}")
        good.put(prompt.chunks())
        assert good.contains(prompt.keys) == 3
        plain = open_tier(f"grpc://127.0.0.1:{port}?retries=0")
        assert misses_through_a_store(plain, prompt)  # cannot talk to a TLS server: misses
        good.close()
    finally:
        srv.stop(0)


def test_mutual_tls_maps_the_client_certificate_to_its_tenant(certs):
    srv, port = start(tls_cert=certs["server.crt"], tls_key=certs["server.key"], tls_client_ca=certs["ca.crt"])
    base = f"grpcs://localhost:{port}?tls_ca={certs['ca.crt']}"
    carol = open_tier(f"{base}&tls_cert={certs['client-carol.crt']}&tls_key={certs['client-carol.key']}")
    dave = open_tier(f"{base}&tls_cert={certs['client-dave.crt']}&tls_key={certs['client-dave.key']}")
    anonymous = open_tier(base + "&retries=0")
    try:
        prompt = make_prompt(3, seed=45)
        carol.put(prompt.chunks())
        assert carol.contains(prompt.keys) == 3
        assert dave.contains(prompt.keys) == 0
        with pytest.raises(TierError):
            anonymous.contains(prompt.keys)  # no certificate: refused ...
        assert misses_through_a_store(anonymous, make_prompt(3, seed=145))  # ... which the engine sees as misses
        assert len(srv.service.tenant_keys(tenant_tag("carol"))) == 3
    finally:
        for tier in (carol, dave, anonymous):
            tier.close()
        srv.stop(0)


# -- what the tier answers -------------------------------------------------------------------------
def test_stats_and_list_are_per_tenant(server):
    alice = open_tier(server.url + "?token=alice-secret")
    try:
        prompt = make_prompt(3, seed=52)
        alice.put(prompt.chunks())
        listing = raw(server.address, "List", cache_pb2.ListRequest(limit=2), cache_pb2.ListResponse)
        assert len(listing.keys) == 2 and listing.truncated
        stats = alice.stats()
        assert stats["server_tiers"][0]["name"] == "cpu"
        assert stats["chunks"] == len(alice.keys())
        assert json.dumps(stats)  # plain data, for `lmtier stats` and logs
    finally:
        alice.delete(prompt.keys)
        alice.close()


def test_the_layout_travels_with_the_chunk(server):
    """A chunk of another layout comes back with that layout (the engine checks it)."""
    ns = make_namespace(layout=SMALL.with_dtype("bfloat16"))
    prompt = make_prompt(2, seed=53, namespace=ns)
    tier = open_tier(server.url + "?token=alice-secret")
    tier.put(prompt.chunks())
    got = tier.get(prompt.keys)
    assert [c.layout for c in got] == [ns.layout, ns.layout]
    release_all(got)
    tier.close()
