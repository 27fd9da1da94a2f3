"""``Match``, the router lookup: how many leading tokens of a prompt the server holds for
the caller's tenant, from the prompt's token ids and the engine's namespace digests (one
per tensor-parallel rank). The server chains the keys itself (``keys.chained_keys``), so a
router needs no key scheme of its own; the keys are scoped to the tenant like every call's.
Bounded: ``MATCH_TOKENS`` token ids, ``max_keys`` chunks and ``MATCH_RANKS`` ranks per request,
and each rank's keys are computed only for the chunks the ranks before it hold.
"""

from __future__ import annotations

import grpc
import numpy as np

from lmtier.errors import LayoutError
from lmtier.kv.keys import HASHES, chained_keys
from lmtier.server.calls import Abort
from lmtier.store.tiered import TieredStore
from lmtier.v1 import cache_pb2

MATCH_RANKS = 64  # namespaces (tensor-parallel ranks) one Match may name
MATCH_TOKENS = 1 << 21  # token ids one Match may carry (2M: longer than any model's context)


def match(store: TieredStore, request: cache_pb2.MatchRequest, tag: bytes, max_keys: int) -> cache_pb2.MatchResponse:
    """The leading whole chunks of the prompt that every rank's namespace holds for the
    caller's tenant (keys scoped to it, as every call's), and the tiers rank 0's lie in."""
    hash_name = request.hash or "xxh3"
    if hash_name not in HASHES:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown key hash {hash_name!r}; one of {HASHES}")
    size = 16 if hash_name == "xxh3" else 32
    if not 1 <= len(request.namespaces) <= MATCH_RANKS:
        raise Abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{len(request.namespaces)} namespace digests; name 1 to {MATCH_RANKS} (one per tensor-parallel rank)",
        )
    for i, digest in enumerate(request.namespaces):
        if len(digest) != size:
            raise Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"namespace {i} is {len(digest)} bytes; a {hash_name} namespace digest is {size}",
            )
    chunk = request.chunk_tokens
    if not 1 <= chunk <= 1 << 20:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"chunk_tokens must lie in [1, 2^20], got {chunk}")
    count = len(request.token_ids)  # no conversion yet: a prompt past the bound costs nothing more
    if count > MATCH_TOKENS:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{count} token ids in one prompt; the limit is {MATCH_TOKENS}")
    chunks = count // chunk
    if chunks > max_keys:
        raise Abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{chunks} chunks in one prompt; the limit is {max_keys} (max_keys)",
        )
    ids = np.fromiter(request.token_ids, dtype=np.int64, count=count)
    if count and int(ids.max()) >= 1 << 31:
        first = int(np.argmax(ids >= 1 << 31))
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"token id {first} is {int(ids[first])}; ids lie in [0, 2**31)")
    tokens = ids[: chunks * chunk].astype("<i4")
    # rank after rank, each asked only for what the ranks before it hold
    held, runs = chunks, []
    for rank, digest in enumerate(request.namespaces):
        try:
            keys = chained_keys(tokens[: held * chunk], digest, chunk, hash_name)
        except LayoutError as exc:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        found = store.lookup_tiers([tag + k for k in keys])
        held = sum(n for _, n in found)
        if rank == 0:
            runs = found
        if held == 0:
            break
    out, left = [], held
    for tier, n in runs:
        if left > 0:
            out.append(cache_pb2.MatchRun(tier=tier.name, chunks=min(n, left)))
            left -= n
    return cache_pb2.MatchResponse(tokens=held * chunk, chunks=held, runs=out)
