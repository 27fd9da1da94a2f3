"""The GPU data path against the hardware, all in one run (``make gpu-check`` runs it).

References, measured in the same run: one large pinned device-to-host copy and one
host-to-device copy (the PCIe ceiling), and a device-to-device copy. lmtier's rows, on a
Llama-3-8B-shaped cache (32 layers x 8 KV heads x 128, bf16, 16-token blocks; 8k tokens =
1 GiB of KV) in two of vLLM's layouts (LBNHC, and the cross-layer BLNHC):

- gather + D2H of 8k tokens from 512 scattered blocks (``CopyEngine.gather``) against the
  pinned D2H copy: target >= 0.8x;
- H2D + scatter of the same (``CopyEngine.scatter``) against the H2D copy: >= 0.8x;
- a save thread gathering 8k-token chunks while the compute stream runs synthetic forward
  steps (matmuls the size of an 8B model's MLP): the steps' slowdown, target <= 2%.

- a layer-pipelined load of 8k tokens (``CopyEngine.load_layers``, 256-token chunks)
  issued right before a 32-layer synthetic forward pass that waits on each layer's copy:
  the forward pass's time against the same pass with no load, target <= 1.1x.

Writes JSON (``--json-out``) and, with ``--report``, the gpu-check report that
joins it with the GPU suite's results (``--tests``, a JUnit XML file); prints a table.

    python benchmarks/bench_gpu.py [--json-out FILE] [--tests XML] [--report FILE] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmtier.layout import KVLayout
from lmtier.testing.layouts import paged_layers
from lmtier.transfer import CopyEngine

GiB = 1 << 30


def timed(fn, repeat: int) -> float:
    """Median seconds of ``fn`` (after one warm-up), the device idle before and after."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def references(nbytes: int, repeat: int) -> dict[str, float]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return {
        "d2h": nbytes / timed(lambda: pinned.copy_(dev, non_blocking=True), repeat) / 1e9,
        "h2d": nbytes / timed(lambda: dev.copy_(pinned, non_blocking=True), repeat) / 1e9,
        "d2d": nbytes / timed(lambda: dev2.copy_(dev), repeat) / 1e9,
    }


def llama_cache(order: str, tokens: int):
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    blocks = 2 * tokens // 16
    layers, _ = paged_layers(order, layers=32, blocks=blocks, heads=8, tokens=16, content=256,
                             dtype=torch.bfloat16, device="cuda")  # fmt: skip
    engine = CopyEngine(layers, layout, 16, blocks)
    ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(0))[: tokens // 16].tolist()
    host = torch.empty(layout.tensor_shape(tokens), dtype=torch.bfloat16, pin_memory=True)
    return engine, ids, host, layout.chunk_bytes(tokens)


def save_during_forward(engine: CopyEngine, ids: list[int], host: torch.Tensor, steps: int) -> dict[str, float]:
    """Synthetic forward steps on a compute stream, alone and with a save thread running."""
    x = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, 14336, dtype=torch.bfloat16, device="cuda")
    compute = torch.cuda.Stream()

    def forward() -> float:
        start = time.perf_counter()
        with torch.cuda.stream(compute):
            for _ in range(steps):
                for _ in range(8):
                    torch.matmul(x, w)
        compute.synchronize()
        return time.perf_counter() - start

    forward()
    alone = statistics.median(forward() for _ in range(3))
    stop = threading.Event()
    saves = 0

    def saver() -> None:
        nonlocal saves
        while not stop.is_set():
            with torch.cuda.stream(compute):
                written = engine.mark()
            engine.gather(ids, host, after=written)
            saves += 1

    thread = threading.Thread(target=saver)
    thread.start()
    try:
        busy = statistics.median(forward() for _ in range(3))
    finally:
        stop.set()
        thread.join()
    return {"alone_s": alone, "with_saves_s": busy, "slowdown": busy / alone - 1, "saves": saves}


def layered_load(engine: CopyEngine, ids: list[int], repeat: int, partial: bool = False) -> dict[str, float]:
    """A forward pass of 32 layers (one MLP-sized matmul each) alone, and with an 8k-token
    load issued layer by layer just before it, each layer waiting for its own copy.
    ``partial``: each item is the second half of a chunk's tokens (as the connector passes
    a chunk the engine's own prefix hit covers in part): two copies per layer, not one."""
    x = torch.randn(8192, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, 14336, dtype=torch.bfloat16, device="cuda")
    compute = torch.cuda.Stream()
    per_chunk = 16  # blocks per 256-token chunk, each in its own pinned buffer: the connector's items
    shape = engine.layout.tensor_shape(per_chunk * 16 * (2 if partial else 1))
    step = per_chunk
    items = []
    for i in range(0, len(ids), step):
        buf = torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
        items.append((ids[i : i + step], buf.narrow(2, per_chunk * 16, per_chunk * 16) if partial else buf))

    def forward(load: bool) -> None:
        with torch.cuda.stream(compute):
            pending = engine.load_layers(items) if load else None
            for i in range(len(engine.layers)):
                if pending is not None:
                    pending.wait(i)
                torch.matmul(x, w)
        compute.synchronize()
        if pending is not None:
            pending.finish()

    alone = timed(lambda: forward(False), repeat)
    loaded = timed(lambda: forward(True), repeat)
    return {"alone_s": alone, "with_load_s": loaded}


def test_counts(xml: Path | None) -> dict[str, int] | None:
    if xml is None or not xml.exists():
        return None
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--tests", type=Path)
    parser.add_argument("--report", type=Path)
    parser.add_argument("--quick", action="store_true", help="1k tokens, few repeats: a smoke run")
    args = parser.parse_args()
    tokens, repeat, steps = (1024, 2, 2) if args.quick else (8192, 5, 10)
    refs = references(GiB if not args.quick else GiB // 8, repeat)
    rows = []
    for order in ("LBNHC", "BLNHC"):
        engine, ids, host, nbytes = llama_cache(order, tokens)
        gather = nbytes / timed(lambda e=engine, i=ids, h=host: e.gather(i, h), repeat) / 1e9
        scatter = nbytes / timed(lambda e=engine, i=ids, h=host: e.scatter(i, h), repeat) / 1e9
        rows.append({"what": f"gather + D2H, {tokens} tokens, {order} (GB/s)", "lmtier": gather,
                     "reference": "pinned D2H", "reference_value": refs["d2h"], "ratio": gather / refs["d2h"],
                     "target": ">= 0.8x", "met": gather / refs["d2h"] >= 0.8})  # fmt: skip
        rows.append({"what": f"H2D + scatter, {tokens} tokens, {order} (GB/s)", "lmtier": scatter,
                     "reference": "pinned H2D", "reference_value": refs["h2d"], "ratio": scatter / refs["h2d"],
                     "target": ">= 0.8x", "met": scatter / refs["h2d"] >= 0.8})  # fmt: skip
        if order == "LBNHC":
            fwd = save_during_forward(engine, ids, host, steps)
            for partial in (False, True):
                lay = layered_load(engine, ids, repeat, partial)
                what = f"forward of 32 layers with a layer-pipelined load of {tokens} tokens"
                rows.append({"what": what + (", token slices of chunks (s)" if partial else " (s)"),
                             "lmtier": lay["with_load_s"], "reference": "the same forward, no load",
                             "reference_value": lay["alone_s"], "ratio": lay["with_load_s"] / lay["alone_s"],
                             "target": "<= 1.1x", "met": lay["with_load_s"] / lay["alone_s"] <= 1.1})  # fmt: skip
            rows.append({"what": "forward steps with a save thread running (s)", "lmtier": fwd["with_saves_s"],
                         "reference": "the same steps alone", "reference_value": fwd["alone_s"],
                         "ratio": 1 + fwd["slowdown"], "target": "<= 1.02x",
                         "met": fwd["slowdown"] <= 0.02, "saves": fwd["saves"]})  # fmt: skip
        del engine, host
        torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "references_gb_s": refs,
              "rows": rows, "tests": test_counts(args.tests)}  # fmt: skip
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))
    if args.report:
        args.report.write_text(json.dumps(report, indent=2))
    print(f"device: {report['device']}; references (GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in refs.items()))
    if report["tests"]:
        print("GPU suite: " + ", ".join(f"{k} {v}" for k, v in report["tests"].items()))
    print("| what | lmtier | reference | reference value | ratio | target | met |")
    print("|---|---:|---|---:|---:|---|---|")
    for r in rows:
        cell = lambda v: "n/a" if v is None else f"{v:.3g}"  # noqa: E731
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        met = "yes" if r["met"] else "**no**"
        print(f"| {r['what']} | {cell(r['lmtier'])} | {r['reference']} | {cell(r['reference_value'])} | {ratio} "
              f"| {r['target']} | {met} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
