"""One SGLang engine's L3 side in a process of its own (tests/test_sglang_backend.py,
tests/user_envs.py):

    sglang_worker.py set|get TIER_URL[,TIER_URL...] mha|mla HOST_LAYOUT SEED [TIER_URLS KIND LAYOUT SEED ...]

``set`` fills 8 pages with random KV from SEED and stores them through one backend over
all the tiers given (every tier gets every page); ``get`` reads them back through one
backend per tier given, each into its own host pool. Both print one JSON line: per tier,
the per-page results and a sha256 of the pages in canonical order, read through SGLang's
own per-layer views, so that two processes with different host layouts can be compared
(for one tier, those fields at the top level). Several jobs (four arguments each) run one
after another in the one process, a line each: SGLang is imported once (ten seconds).
"""

from __future__ import annotations

import hashlib
import json
import sys

import sglang_env


def main(op: str, *jobs: str) -> None:
    if op not in ("set", "get") or not jobs or len(jobs) % 4:
        raise SystemExit(__doc__)
    sglang_env.use()
    for urls, kind, layout, seed in zip(*[iter(jobs)] * 4, strict=True):
        job(op, urls, kind, layout, seed)


def job(op: str, urls: str, kind: str, layout: str, seed: str) -> None:
    import torch

    from sglang_env import alloc, backend, page_keys, token_kv

    tiers = urls.split(",")
    keys = page_keys(8, seed=int(seed))
    outs = []
    for group in [tiers] if op == "set" else [[t] for t in tiers]:
        storage, pool = backend(group, mla=kind == "mla", layout=layout)
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
        out["canonical_sha256"] = hashlib.sha256(kv.view(-1).view(torch.uint8).numpy()).hexdigest()
        storage.close()
        outs.append(out)
    import lmtier.connectors.sglang

    result = outs[0] if len(outs) == 1 else {"tiers": outs}
    print(json.dumps({**result, "connector": lmtier.connectors.sglang.__file__}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
