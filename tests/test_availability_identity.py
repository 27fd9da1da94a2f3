"""Availability is part of isolation: who a caller of a shared ``lmtier serve`` is and what
it may see of the others. Mutual-TLS tenants named by their alternative names, Stats that
shows a tenant only its own chunks, /metrics behind its own token, and the secrets
themselves: tokens as parsed and as read from a file, one secret per tenant, the salted
tenant digest in events.

Calls, workers and connections are in test_availability_calls.py; memory and shared memory
in test_availability_memory.py.
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from lmtier.config import ServerConfig, parse_token, read_token_file
from lmtier.errors import ConfigError
from lmtier.server import create_server
from lmtier.server.auth import certificate_identity, tenant_tag
from lmtier.testing.certs import make_certificates
from lmtier.v1 import cache_pb2

from conftest import make_prompt
from raw_client import S, call, puts, two_tenant_server


def test_mutual_tls_tenants_without_a_common_name_are_their_alternative_names(tmp_path):
    """Certificates with no common name (SAN-only, as SPIFFE/SPIRE and cert-manager issue
    them) are each their own tenant, by URI or DNS name, never all the empty name (two
    such clients once read, listed and deleted each other's chunks)."""
    paths = make_certificates(
        tmp_path,
        ["carol"],
        {"spiffe-a": "URI:spiffe://example.org/ns/a/sa/engine", "spiffe-b": "URI:spiffe://example.org/ns/b/sa/engine",
         "dns-c": "DNS:engine-c.example", "nothing": "IP:127.0.0.9"},
    )  # fmt: skip
    config = ServerConfig(port=0, tiers=("cpu://?size=16MiB&slot=64KiB",), tls_cert=paths["server.crt"],
                          tls_key=paths["server.key"], tls_client_ca=paths["ca.crt"], shm_dir="")  # fmt: skip
    srv, port = create_server(config)
    ca = Path(paths["ca.crt"]).read_bytes()

    def channel(name: str) -> grpc.Channel:
        key, cert = (Path(paths[f"client-{name}.{ext}"]).read_bytes() for ext in ("key", "crt"))
        credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        return grpc.secure_channel(f"localhost:{port}", credentials)

    prompt = make_prompt(2, seed=402)
    channels = {name: channel(name) for name in ("carol", "spiffe-a", "spiffe-b", "dns-c", "nothing")}
    try:
        assert call(channels["spiffe-a"], "Put", puts(prompt)).stored == 2
        lookup = cache_pb2.LookupRequest(keys=prompt.keys)
        assert call(channels["spiffe-a"], "Lookup", lookup).hits == 2
        for other in ("spiffe-b", "dns-c", "carol"):  # other identities see nothing of it
            assert call(channels[other], "Lookup", lookup).hits == 0, other
            assert call(channels[other], "Delete", cache_pb2.DeleteRequest(keys=prompt.keys)) is not None
        assert call(channels["spiffe-a"], "Lookup", lookup).hits == 2
        assert len(srv.service.tenant_keys(tenant_tag("uri:spiffe://example.org/ns/a/sa/engine"))) == 2
        with pytest.raises(grpc.RpcError) as refused:
            call(channels["nothing"], "Lookup", lookup)
        assert refused.value.code() == S.UNAUTHENTICATED and "names no identity" in refused.value.details()
    finally:
        for c in channels.values():
            c.close()
        srv.stop(0)


def test_a_common_name_cannot_pass_for_an_alternative_name():
    assert certificate_identity({"x509_common_name": [b"uri:spiffe://x"], "peer_uri": [b"spiffe://y"]}, "auto") == (
        "uri:spiffe://y"
    )
    assert certificate_identity({"x509_common_name": [b""]}, "auto") is None
    assert certificate_identity({"x509_common_name": [b"carol"], "peer_dns": [b"e.example"]}, "dns") == "dns:e.example"


def test_stats_shows_a_tenant_its_own_chunks_and_only_an_operator_the_whole_server():
    """Where tenants share the server, Stats once gave every caller every tenant's name and
    the tiers' live counters (one tenant could watch another's reads and writes)."""
    srv, address = two_tenant_server(operators=("alice",))
    channel = grpc.insecure_channel(address)
    try:
        call(channel, "Put", puts(make_prompt(2, seed=403)), token="alice-secret")
        call(channel, "Put", puts(make_prompt(3, seed=404)), token="bob-secret")
        bob = call(channel, "Stats", cache_pb2.StatsRequest(), token="bob-secret")
        assert bob.tenant_chunks == 3
        assert all(t.capacity_bytes > 0 and t.used_bytes == 0 and not t.counters for t in bob.tiers)
        assert "alice" not in bob.config_json and "bob" not in bob.config_json
        alice = call(channel, "Stats", cache_pb2.StatsRequest(), token="alice-secret")
        assert alice.tenant_chunks == 2 and alice.tiers[0].counters["stored"] == 5
        assert "alice" in alice.config_json and "bob" in alice.config_json
    finally:
        channel.close()
        srv.stop(0)


# -- /metrics ------------------------------------------------------------------------------------
def test_metrics_ask_for_their_token_and_probes_do_not(caplog):
    """/metrics sums every tenant's traffic: with ``metrics_token`` set, it answers only a
    scrape that brings the token; /healthz and /readyz stay open for the kubelet; and a
    shared server whose metrics anyone may reach says so when it starts."""

    def get(port: int, path: str, token: str | None = None) -> int:
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                return answer.status
        except urllib.error.HTTPError as refused:
            return refused.code

    srv, _ = two_tenant_server(metrics_port=0, metrics_token="scrape-0123456789abcdef")
    try:
        assert get(srv.metrics_port, "/metrics") == 401
        assert get(srv.metrics_port, "/metrics", "alice-secret") == 401  # a tenant's token is not it
        assert get(srv.metrics_port, "/metrics", "scrape-0123456789abcdef") == 200
        assert get(srv.metrics_port, "/readyz") == 200 and get(srv.metrics_port, "/healthz") == 200
    finally:
        srv.stop(0)
    with caplog.at_level(logging.WARNING, logger="lmtier.server.app"):
        srv, _ = two_tenant_server(metrics_port=0, metrics_host="0.0.0.0")
        srv.stop(0)
    assert any("sums every tenant's traffic" in r.getMessage() for r in caplog.records)


# -- secrets ----------------------------------------------------------------------------------------
def test_tokens_keep_their_equals_signs_and_lose_their_spaces():
    assert parse_token("c2VjcmV0==") == ("c2VjcmV0==", "default")  # base64 padding: all secret
    assert parse_token("c2VjcmV0===alice") == ("c2VjcmV0==", "alice")  # the tenant follows the last "="
    assert parse_token("  s3cret-s3cret-1 = bob \r") == ("s3cret-s3cret-1", "bob")
    for bad in ("two words=bob", "secret=two words", "=bob", "   "):
        with pytest.raises(ConfigError):
            parse_token(bad)


def test_a_loose_token_file_and_a_short_token_are_warned_about(tmp_path, caplog):
    path = tmp_path / "tokens"
    path.write_text("# tenants\n  short=alice  \n\nlong-enough-secret-0123=bob\r\n")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="lmtier"):
        tokens = read_token_file(path)
        srv, _ = create_server(ServerConfig(port=0, tiers=("cpu://?size=1MiB&slot=64KiB",), tokens=tuple(tokens),
                                            shm_dir=""))  # fmt: skip
        srv.stop(0)
    assert tokens == [("short", "alice"), ("long-enough-secret-0123", "bob")]
    text = caplog.text
    assert "can be read by other users" in text and "tenant alice has a token of 5 characters" in text
    assert "tenant bob" not in text
    path.write_text("a b c\n")
    with pytest.raises(ConfigError, match="line 1"):
        read_token_file(path)


def test_a_bracketed_ipv6_host_is_its_address():
    assert ServerConfig(host="[::]", tiers=("cpu://?size=1MiB",)).host == "::"


def test_the_events_tenant_digest_is_salted_per_deployment_and_full_length(monkeypatch):
    from lmtier.connectors.vllm.events import tenant_digest, tier_labels

    monkeypatch.delenv("LMTIER_EVENTS_SALT", raising=False)
    tenant_digest.cache_clear()
    one = tenant_digest("secret-token-0123456789", "cache:50051")
    assert len(one) == 64 and one != tenant_digest("secret-token-0123456789", "other:50051")
    monkeypatch.setenv("LMTIER_EVENTS_SALT", "deployment-secret")
    tenant_digest.cache_clear()
    assert tenant_digest("secret-token-0123456789", "cache:50051") != one
    # the same from every instance of the fleet, however the URL is written
    assert tier_labels("grpc://CACHE?token=secret-token-0123456789") == tier_labels(
        "grpc://cache:50051?token=secret-token-0123456789"
    )
    tenant_digest.cache_clear()


def test_one_secret_for_two_tenants_is_refused():
    with pytest.raises(ConfigError, match="tenants alice and bob"):
        ServerConfig(tiers=("cpu://?size=1MiB",), tokens=(("same-secret-0123456789", "alice"),
                                                         ("same-secret-0123456789", "bob")))  # fmt: skip
    ServerConfig(tiers=("cpu://?size=1MiB",), tokens=(("same-secret-0123456789", "alice"),) * 2)  # a repeat is fine
