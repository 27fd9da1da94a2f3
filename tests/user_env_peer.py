"""One side of a cache-server exchange between two environments (tests/user_envs.py): the
embedded API of whatever lmtier this interpreter has installed, numpy only.

    user_env_peer.py put|get GRPC_URL SEED

``put`` stores a prompt's KV (random from SEED) through the ``grpc://`` tier; ``get``
reads it back into a buffer of its own. Both print one JSON line: the tokens stored or
found, the sha256 of the KV, whether it is the KV that SEED makes, the protobuf, grpcio
and lmtier this side ran with, and what the store counted (a write dropped, the tier's
retries) to explain a short read.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import sys

import numpy as np

import lmtier

LAYOUT = lmtier.KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16")
TOKENS = 1024
TIER_STATS = ("error", "retries", "skipped", "breaker_open")


def main(op: str, url: str, seed: str) -> None:
    rng = np.random.default_rng(int(seed))
    tokens = rng.integers(0, 30_000, TOKENS).tolist()
    store = lmtier.open_store([url], model="user-env-peer", layout=LAYOUT, chunk_tokens=256)
    # [layers, 2, tokens, kv_heads, head_dim]: random fp16 bit patterns (NaNs included)
    shape = (LAYOUT.num_layers, 2, TOKENS, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    expected = rng.integers(0, 2**16, shape, dtype=np.uint16)  # the same from the same SEED
    if op == "put":
        kv = expected
        done = store.put(tokens, kv.view(np.float16))
        flushed = store.flush(60)  # the write is in the background
    else:
        kv = np.zeros(shape, dtype=np.uint16)
        done = store.get_into(tokens, kv.view(np.float16))
        flushed = True
    stats = store.stats()
    store.close()
    print(
        json.dumps(
            {
                "tokens": done,
                "sha256": hashlib.sha256(kv[:, :, :done].tobytes()).hexdigest(),
                "matches": bool(np.array_equal(kv[:, :, :done], expected[:, :, :done])),
                "protobuf": md.version("protobuf"),
                "grpcio": md.version("grpcio"),
                "lmtier": lmtier.__file__,
                "flushed": flushed,
                "dropped_writes": stats["dropped_writes"],
                "tier": {k: v for k, v in stats["tiers"][0].items() if k in TIER_STATS},
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
