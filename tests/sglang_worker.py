"""One SGLang engine's L3 side in a process of its own (tests/test_sglang_backend.py):

    sglang_worker.py set|get TIER_URL mha|mla HOST_LAYOUT SEED

``set`` fills 8 pages with random KV from SEED and stores them; ``get`` asks how many
exist and loads them into its own host pool. Both print one JSON line: the per-page
results and a sha256 of the pages in canonical order, read through SGLang's own per-layer
views, so that two processes with different host layouts can be compared.
"""

from __future__ import annotations

import hashlib
import json
import sys

import sglang_env


def main(op: str, url: str, kind: str, layout: str, seed: str) -> None:
    sglang_env.use()
    from test_sglang_backend import alloc, backend, page_keys, token_kv

    storage, pool = backend([url], mla=kind == "mla", layout=layout)
    keys = page_keys(8, seed=int(seed))
    indices = alloc(pool, 8)
    out: dict = {}
    if op == "set":
        sglang_env.fill_random(pool, indices, seed=int(seed))
        out["results"] = storage.batch_set_v1(keys, indices)
        storage.store.flush()
    else:
        out["exists"] = storage.batch_exists(keys)
        out["results"] = storage.batch_get_v1(keys, indices)
    kv = token_kv(pool, indices).contiguous()
    out["canonical_sha256"] = hashlib.sha256(kv.view(-1).view(__import__("torch").uint8).numpy()).hexdigest()
    storage.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
