"""lmtier in a vLLM environment without starting an engine (tests/user_envs.py's lighter
vLLM cells: one cell per engine starts real engines, the others check what the protobuf /
grpcio versions can break):

    vllm_light.py set|get TIER_URL[,TIER_URL...] SEED

``set`` imports the installed connector the way vLLM does (``lmtier.connectors.vllm``,
which imports vLLM's connector base and registers itself in vLLM's ``KVConnectorFactory``)
and stores 1,024 tokens of random KV from SEED through one store over all the tiers given;
``get`` (no vLLM import: half a minute on a small machine) reads them back through one
store per tier. Both print one JSON line: per tier, the tokens read and a sha256 of the
KV, and which lmtier ran (the wheel's, not a checkout's).
"""

from __future__ import annotations

import hashlib
import json
import sys

TOKENS = 1024


def main(op: str, urls: str, seed: str) -> None:
    import numpy as np

    import lmtier.api
    from lmtier.api import open_store
    from lmtier.kv.layout import KVLayout

    where, registered = lmtier.api.__file__, None
    if op == "set":
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        import lmtier.connectors.vllm as connector

        where, registered = connector.__file__, "LMTierConnector" in KVConnectorFactory._registry
    layout = KVLayout(2, 2, 64, "float16")
    rng = np.random.default_rng(int(seed))
    tokens = [int(x) for x in rng.integers(5, 500, TOKENS)]
    kv = rng.standard_normal(layout.tensor_shape(TOKENS)).astype(np.float16)
    common = {"model": f"user-env-{seed}", "layout": layout, "chunk_tokens": 256}
    tiers = urls.split(",")
    outs = []
    for group in [tiers] if op == "set" else [[t] for t in tiers]:
        with open_store(group, **common) as store:
            if op == "set":
                stored = store.put(tokens, kv)
                store.flush()
                got = kv[:, :, :stored]
            else:
                got = store.get(tokens).numpy()
            digest = hashlib.sha256(got.tobytes()).hexdigest()
            outs.append({"tokens": int(got.shape[layout.token_axis]), "sha256": digest})
    want = hashlib.sha256(kv.tobytes()).hexdigest()
    print(json.dumps({"tiers": outs, "want": want, "registered": registered, "lmtier": where}))


if __name__ == "__main__":
    main(*sys.argv[1:])
