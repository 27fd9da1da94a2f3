"""One side of a cache-server exchange between two environments (tests/user_envs.py): the
embedded API of whatever lmtier this interpreter has installed, numpy only.

    user_env_peer.py put|get GRPC_URL SEED

``put`` stores a prompt's KV (random from SEED) through the ``grpc://`` tier; ``get``
reads it back into a buffer of its own. Both print one JSON line: the tokens stored or
found, the sha256 of the KV, and the protobuf, grpcio and lmtier this side ran with.
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


def main(op: str, url: str, seed: str) -> None:
    rng = np.random.default_rng(int(seed))
    tokens = rng.integers(0, 30_000, TOKENS).tolist()
    store = lmtier.open_store([url], model="user-env-peer", layout=LAYOUT, chunk_tokens=256)
    # [layers, 2, tokens, kv_heads, head_dim]: random fp16 bit patterns (NaNs included)
    shape = (LAYOUT.num_layers, 2, TOKENS, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    if op == "put":
        kv = rng.integers(0, 2**16, shape, dtype=np.uint16)
        done = store.put(tokens, kv.view(np.float16))
        store.close()  # waits for the write
    else:
        kv = np.zeros(shape, dtype=np.uint16)
        done = store.get_into(tokens, kv.view(np.float16))
        store.close()
    print(
        json.dumps(
            {
                "tokens": done,
                "sha256": hashlib.sha256(kv[:, :, :done].tobytes()).hexdigest(),
                "protobuf": md.version("protobuf"),
                "grpcio": md.version("grpcio"),
                "lmtier": lmtier.__file__,
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
