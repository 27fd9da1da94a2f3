"""The router lookup: a cache server's ``Match`` (token ids and an engine's namespace
digests in; the leading tokens held and their tiers out) and ``lmtier match``, against a
real server on port 0. Tenant isolation is in test_security_access.py's catalogue of every RPC."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import numpy as np
import pytest

from lmtier.config import ServerConfig
from lmtier.errors import TierError
from lmtier.kv.keys import Namespace, chained_keys
from lmtier.kv.layout import preset
from lmtier.server import create_server
from lmtier.tiers.base import open_tier

from conftest import make_namespace, make_prompt

TOKENS = (("router-secret", "fleet"),)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    disk = tmp_path_factory.mktemp("disk")
    config = ServerConfig(
        port=0, tiers=("cpu://?size=16MiB&slot=64KiB", f"file://{disk}/d?size=64MiB"), tokens=TOKENS, shm_dir=""
    )
    srv, port = create_server(config)
    tier = open_tier(f"grpc://127.0.0.1:{port}?token=router-secret&shm=off")
    yield srv, port, tier
    tier.close()
    srv.stop(0)


def test_chained_keys_from_a_digest_are_the_namespace_keys():
    ns = make_namespace()
    tokens = np.arange(5 * ns.chunk_tokens + 3, dtype=np.int32)
    assert chained_keys(tokens, ns.digest, ns.chunk_tokens, ns.hash) == ns.keys(tokens)
    sha = make_namespace(hash="sha256")
    assert chained_keys(tokens, sha.digest, sha.chunk_tokens, "sha256") == sha.keys(tokens)


def test_match_counts_the_leading_tokens_held_and_names_their_tiers(server):
    _, _, tier = server
    a = make_prompt(4, seed=11)
    b = make_prompt(6, seed=12, shared_with=a, shared_chunks=2)  # diverges after two chunks
    ns, size = a.namespace, a.namespace.chunk_tokens
    tier.put(a.chunks())
    tail = list(range(7))  # a partial chunk after the prompt: never counted
    got = tier.match(a.tokens.tolist() + tail, [ns.digest], size)
    assert got == {"tokens": 4 * size, "chunks": 4, "runs": [{"tier": "cpu", "chunks": 4}]}
    assert tier.match(b.tokens.tolist(), [ns.digest], size)["tokens"] == 2 * size
    other = Namespace(model="another-model", layout=ns.layout, chunk_tokens=size)
    assert tier.match(a.tokens.tolist(), [other.digest], size)["tokens"] == 0
    assert tier.match([], [ns.digest], size)["tokens"] == 0


def test_match_with_tensor_parallel_ranks_counts_what_every_rank_holds(server):
    _, _, tier = server
    base = make_namespace(model="tp-model")
    ranks = [make_namespace(model="tp-model", tp_rank=r, tp_size=2) for r in range(2)]
    tokens = make_prompt(3, seed=13, namespace=base).tokens
    from conftest import Prompt

    r0, r1 = (Prompt(ns, tokens, seed=20 + i) for i, ns in enumerate(ranks))
    tier.put(r0.chunks())
    tier.put(r1.chunks(0, 2))  # rank 1 has only the first two chunks
    got = tier.match(tokens.tolist(), [ns.digest for ns in ranks], base.chunk_tokens)
    assert got["chunks"] == 2 and got["tokens"] == 2 * base.chunk_tokens
    assert got["runs"] == [{"tier": "cpu", "chunks": 2}]


@pytest.mark.parametrize(
    "request_kw, says",
    [
        ({"namespaces": []}, "namespace digests"),
        ({"namespaces": [b"x" * 15]}, "15 bytes"),
        ({"namespaces": [b"x" * 16] * 65}, "namespace digests"),
        ({"hash": "md5"}, "unknown key hash"),
        ({"hash": "sha256"}, "sha256 namespace digest is 32"),
        ({"chunk_tokens": 0}, "chunk_tokens"),
        ({"token_ids": [2**31] * 16}, "[0, 2**31)"),
        ({"token_ids": list(range(16 * 5000))}, "the limit is 4096"),
        ({"token_ids": [1] * ((1 << 21) + 1), "chunk_tokens": 1 << 20}, "token ids in one prompt; the limit is"),
        ({"token_ids": [1] * 32 + [2**31]}, "token id 32 is 2147483648"),  # in the partial tail too
    ],
)
def test_a_malformed_match_is_invalid_argument_with_the_reason(server, request_kw, says):
    _, port, _ = server
    from lmtier.v1 import cache_pb2

    fields = {"token_ids": list(range(32)), "namespaces": [b"n" * 16], "chunk_tokens": 16, **request_kw}
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    fn = channel.unary_unary(
        "/lmtier.v1.CacheService/Match",
        cache_pb2.MatchRequest.SerializeToString,
        cache_pb2.MatchResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as info:
        fn(cache_pb2.MatchRequest(**fields), metadata=(("authorization", "Bearer router-secret"),), timeout=10)
    channel.close()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in info.value.details()


def test_match_against_a_dead_server_is_a_tier_error(tmp_path):
    from lmtier.testing.redis_server import free_port

    tier = open_tier(f"grpc://127.0.0.1:{free_port()}?timeout=0.5&retries=0")
    with pytest.raises(TierError):
        tier.match([1] * 16, [b"n" * 16], 16)
    tier.close()


def lmtier(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lmtier", *args], input=stdin, capture_output=True, text=True, timeout=120, check=False
    )


def test_the_cli_asks_match_by_digest_or_by_model(server, tmp_path):
    _, port, tier = server
    layout = preset("llama-3-8b").shard(2)  # what each of two ranks holds
    size = 16
    ranks = [Namespace(model="llama-3-8b", layout=layout, chunk_tokens=size, tp_rank=r, tp_size=2) for r in range(2)]
    tokens = np.random.default_rng(5).integers(0, 50_000, 3 * size + 4).astype(np.int32)
    from conftest import Prompt

    # small stand-ins for the engine's chunks: the server checks frames, not model sizes
    small = [make_namespace(model=ns.model) for ns in ranks]
    for ns, small_ns in zip(ranks, small, strict=True):
        p = Prompt(small_ns, tokens, seed=ns.tp_rank)
        tier.put([c.view_as(k) for c, k in zip(p.chunks(), ns.keys(tokens), strict=True)])
    path = tmp_path / "prompt.json"
    path.write_text(json.dumps(tokens.tolist()))
    url = f"grpc://127.0.0.1:{port}"

    by_digest = ["--namespace", ranks[0].digest.hex(), "--namespace", ranks[1].digest.hex(), "--chunk-tokens", "16"]
    run = lmtier("match", "--server", url, "--token", "router-secret", "--tokens-file", str(path), *by_digest, "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert (out["tokens"], out["chunks"], out["prompt_tokens"]) == (3 * size, 3, len(tokens))
    assert out["runs"] == [{"tier": "cpu", "chunks": 3}]

    by_model = ["--model", "llama-3-8b", "--tp-size", "2", "--chunk-tokens", "16"]
    run = lmtier(
        "match", "--server", url, "--token", "router-secret", "--tokens-file", "-", *by_model, stdin=path.read_text()
    )
    assert run.returncode == 0 and "48 of 52 tokens held (3 chunks of 16: 3 in cpu)" in run.stdout, run.stderr
    keys = lmtier("keys", "--model", "llama-3-8b", "--tp-size", "2", "--tp-rank", "1", "--chunk-tokens", "16",
                  "--tokens-file", str(path), "--json")  # fmt: skip
    assert keys.returncode == 0, keys.stderr
    assert json.loads(keys.stdout)["namespace"]["layout"] == layout.to_dict()  # each rank's shard

    wrong_token = lmtier("match", "--server", url, "--token", "nope", "--tokens-file", str(path), *by_digest)
    assert wrong_token.returncode != 0 and "match at" in wrong_token.stderr
    no_size = lmtier("match", "--server", url, "--tokens-file", str(path), "--namespace", "ab" * 16)
    assert no_size.returncode != 0 and "--chunk-tokens" in no_size.stderr
