"""``lmtier demo``: two engine instances, two processes, one prefill.

Instance A (a separate process) "prefills" a prompt (a shared system prompt plus its own
question; the KV is random, standing in for a real prefill) and stores it through host
memory to a disk directory. It exits. Instance B, in this process, with empty memory of
its own, gets a prompt with the same system prompt and another question: lmtier finds
the system prompt's chunks on disk and hands back A's KV byte for byte, so B would
prefill only its question. Then the demo shows what lmtier refuses: another model's
namespace, and a chunk damaged on disk.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from lmtier.api import open_store
from lmtier.kv.layout import KVLayout, preset
from lmtier.kv.sizing import plan
from lmtier.tiers.disk import DiskTier
from lmtier.units import format_bytes

# A small Llama-like layout, so the demo runs in seconds on a laptop.
DEMO_LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, dtype="bfloat16", num_attention_heads=32)
SYSTEM_TOKENS = 4096
QUESTION_TOKENS = 300
MODEL = "demo-llama"


def prompts() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, SYSTEM_TOKENS)
    a = np.concatenate([system, rng.integers(0, 32000, QUESTION_TOKENS)])
    b = np.concatenate([system, rng.integers(0, 32000, QUESTION_TOKENS)])
    return a, b


def kv_of_a():
    import torch

    a, _ = prompts()
    gen = torch.Generator().manual_seed(0)
    # [layers, 2, tokens, kv_heads, head_dim]
    return torch.randn(DEMO_LAYOUT.tensor_shape(len(a)), generator=gen).to(torch.bfloat16)


def instance_a(tiers: list[str]) -> None:
    """Runs in its own process: prefill (pretend), store, exit."""
    a, _ = prompts()
    kv = kv_of_a()
    with open_store(tiers, model=MODEL, layout=DEMO_LAYOUT) as store:
        t0 = time.perf_counter()
        stored = store.put(a, kv)
        elapsed = time.perf_counter() - t0
        store.flush()
    nbytes = stored * DEMO_LAYOUT.bytes_per_token
    print(
        f"[A] stored {stored} of {len(a)} tokens ({format_bytes(nbytes)}) in {elapsed * 1e3:.0f} ms; "
        f"the {len(a) - stored}-token tail stays with the engine",
        flush=True,
    )


def run_demo(tiers: list[str] | None = None, directory: str | None = None) -> int:
    import torch

    print("== memory plan: Llama-3-8B at 8k tokens, 1 GiB host tier, 100 GiB disk ==")
    print(plan("llama-3-8b", preset("llama-3-8b"), 8192, tiers={"cpu": 1024**3, "disk": 100 * 1024**3}).to_text())

    with tempfile.TemporaryDirectory(prefix="lmtier-demo-", dir=directory) as tmp:
        tiers = tiers or ["cpu://?size=1GiB", f"file://{tmp}?size=2GiB"]
        print(f"\n== instance A in another process, then instance B here; tiers {tiers} ==")
        script = f"from lmtier.demo.embedded import instance_a; instance_a({tiers!r})"
        subprocess.run([sys.executable, "-c", script], check=True)

        _, b = prompts()
        kv_a = kv_of_a()
        with open_store(tiers, model=MODEL, layout=DEMO_LAYOUT) as store:
            hit = store.lookup(b)
            t0 = time.perf_counter()
            kv_b = store.get(b[:hit])
            elapsed = time.perf_counter() - t0
            same = torch.equal(kv_b, kv_a[:, :, :hit])
            print(
                f"[B] found {hit} of {len(b)} tokens cached; loaded {format_bytes(kv_b.nbytes)} in "
                f"{elapsed * 1e3:.0f} ms; byte-identical to A's KV: {same}"
            )
            print(f"[B] prefills {len(b) - hit} tokens instead of {len(b)}")
            ok = same and hit == (SYSTEM_TOKENS // store.chunk_tokens) * store.chunk_tokens

        with open_store(tiers, model="another-model", layout=DEMO_LAYOUT) as other:
            other_hit = other.lookup(b)
            print(f"another model, same prompt: {other_hit} tokens found (namespaces never share)")
            ok = ok and other_hit == 0

        disk_dirs = [Path(t.split("://", 1)[1].split("?", 1)[0]) for t in tiers if t.startswith("file://")]
        if disk_dirs:
            with open_store(tiers[-1:], model=MODEL, layout=DEMO_LAYOUT) as store:
                disk = DiskTier(disk_dirs[-1], size=1 << 62)  # only to find the chunk's bytes
                path, offset, length = disk.locate(store.keys(b)[2])
                disk.close()
                with open(path, "r+b") as f:  # one bit-rotted byte in chunk 2
                    f.seek(offset + length // 2)
                    byte = f.read(1)
                    f.seek(offset + length // 2)
                    f.write(bytes([byte[0] ^ 0xFF]))
                got = store.get(b).shape[2]
                print(
                    f"after damaging one byte of chunk 2 on disk: get returns {got} tokens (chunks 0-1), never bad KV"
                )
                ok = ok and got == 2 * store.chunk_tokens
    print("\ndemo", "passed" if ok else "FAILED")
    return 0 if ok else 1
