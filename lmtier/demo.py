"""``lmtier demo``: two engine instances share the KV of a system prompt through lmtier.

Instance A "prefills" a prompt (a shared system prompt plus its own question; the KV is
random, standing in for a real prefill) and stores it. Instance B gets a prompt with the
same system prompt and another question: lmtier finds the system prompt's chunks and
hands back A's KV byte for byte, so B would prefill only its question. Then the demo
shows what lmtier refuses: another model's namespace, and a corrupted chunk.
"""

from __future__ import annotations

import time

import numpy as np

from lmtier.api import open_store
from lmtier.layout import KVLayout
from lmtier.planner import plan
from lmtier.units import format_bytes

# A small Llama-like layout, so the demo runs in a second on a laptop.
DEMO_LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, dtype="bfloat16", num_attention_heads=32)
SYSTEM_TOKENS = 4096
QUESTION_TOKENS = 300


def run_demo(tiers: list[str] | None = None) -> int:
    import torch

    tiers = tiers or ["cpu://?size=1GiB"]
    print("== memory plan: Llama-3-8B at 8k tokens, 1 GiB host tier ==")
    from lmtier.layout import preset

    print(plan("llama-3-8b", preset("llama-3-8b"), 8192, tiers={"cpu": 1024**3}).to_text())

    print(f"\n== two instances, tiers {tiers} ==")
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, SYSTEM_TOKENS)
    prompt_a = np.concatenate([system, rng.integers(0, 32000, QUESTION_TOKENS)])
    prompt_b = np.concatenate([system, rng.integers(0, 32000, QUESTION_TOKENS)])
    kv_a = torch.randn(DEMO_LAYOUT.tensor_shape(len(prompt_a)), generator=torch.Generator().manual_seed(0)).to(
        torch.bfloat16
    )  # [layers, 2, tokens, kv_heads, head_dim]

    with open_store(tiers, model="demo-llama", layout=DEMO_LAYOUT) as store:
        t0 = time.perf_counter()
        stored = store.put(prompt_a, kv_a)
        t_put = time.perf_counter() - t0
        nbytes = stored * DEMO_LAYOUT.bytes_per_token
        print(
            f"A stored {stored} of {len(prompt_a)} tokens ({format_bytes(nbytes)}) in {t_put * 1e3:.1f} ms"
            f" ({nbytes / t_put / 1e9:.2f} GB/s); the {len(prompt_a) - stored}-token tail stays with the engine"
        )

        hit = store.lookup(prompt_b)
        t0 = time.perf_counter()
        kv_b = store.get(prompt_b[:hit])
        t_get = time.perf_counter() - t0
        same = torch.equal(kv_b, kv_a[:, :, :hit])
        print(
            f"B found {hit} of {len(prompt_b)} tokens cached; loaded {format_bytes(kv_b.nbytes)} in "
            f"{t_get * 1e3:.1f} ms ({kv_b.nbytes / t_get / 1e9:.2f} GB/s); byte-identical to A's KV: {same}"
        )
        print(f"B prefills {len(prompt_b) - hit} tokens instead of {len(prompt_b)}")
        ok = same and hit == (SYSTEM_TOKENS // store.chunk_tokens) * store.chunk_tokens

    with open_store(tiers, model="another-model", layout=DEMO_LAYOUT) as other:
        other_hit = other.lookup(prompt_b)
        print(f"another model, same prompt: {other_hit} tokens found (namespaces never share)")
        ok = ok and other_hit == 0

    with open_store(tiers, model="demo-llama", layout=DEMO_LAYOUT) as store:
        store.put(prompt_a, kv_a)
        tier = store.store.tiers[0]
        slab = getattr(tier, "_slab", None)
        if slab is not None:  # corrupt one byte of the third chunk, as a failing DIMM would
            slab[2 * tier.slot_bytes + 12345] ^= 0xFF
            got = store.get(prompt_b).shape[2]
            print(f"after corrupting one byte of chunk 2: get returns {got} tokens (chunks 0-1), never bad KV")
            ok = ok and got == 2 * store.chunk_tokens
    print("\ndemo", "passed" if ok else "FAILED")
    return 0 if ok else 1
