"""The GPU data path against the hardware, all in one run (``make gpu-check`` runs it).

References, measured in the same run: one large pinned device-to-host copy and one
host-to-device copy (the PCIe ceiling), and a device-to-device copy; each gather and
scatter row against a copy of the same bytes through the same pinned host buffer, timed
in turn with it. lmtier's rows, on a
Llama-3-8B-shaped cache (32 layers x 8 KV heads x 128, bf16, 16-token blocks; 8k tokens =
1 GiB of KV) in two of vLLM's layouts (LBNHC, and the cross-layer BLNHC):

- gather + D2H of 8k tokens from 512 scattered blocks (``CopyEngine.gather``) against the
  pinned D2H copy: target >= 0.8x;
- H2D + scatter of the same (``CopyEngine.scatter``) against the H2D copy: >= 0.8x;
- forward steps of an 8k-token prefill (an 8B model's 32 layers of MLP matmuls, ~0.13 s
  each), each step's KV saved as the connector saves it (an event marked after the step,
  the gather on a save thread while the next step runs): the steps' slowdown, target <= 2%;
- the stress case beside it: a save thread gathering 8k tokens back to back while short
  steps run (about 30 times the KV those steps produce), reported without a target.

- a layer-pipelined load of 8k tokens (``CopyEngine.load_layers``, 256-token chunks)
  issued right before a 32-layer synthetic forward pass that waits on each layer's copy:
  the forward pass's time against the same pass with no load, target <= 1.1x.

Writes JSON (``--json-out``) and, with ``--report``, the gpu-check report that
joins it with the GPU suite's results (``--tests``, a JUnit XML file); prints a table.

    python benchmarks/bench_gpu.py [--json-out FILE] [--tests XML] [--report FILE] [--quick]
                                   [--profile DIR]

``--profile DIR`` also runs ``torch.profiler`` over one gather and scatter and one
layer-pipelined load, and writes their kernel and host-call tables to DIR (the tables
where-the-time-goes quotes).
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmtier.engine.transfer import CopyEngine
from lmtier.kv.layout import KVLayout
from lmtier.testing.layouts import paged_layers

GiB = 1 << 30


def timed(fn, repeat: int, best: bool = False) -> float:
    """Median (``best``: least) seconds of ``fn`` after one warm-up, the device idle before
    and after. The references take their best: a ceiling, not a typical run."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times) if best else statistics.median(times)


def paired(reference, fn, repeat: int) -> tuple[float, float]:
    """Median seconds of ``reference`` and of ``fn``, timed in turn (one warm-up each), so
    that drift and where the host buffer lies touch both alike."""
    ref, mine = [], []
    for i in range(repeat + 1):
        for f, out in ((reference, ref), (fn, mine)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            f()
            torch.cuda.synchronize()
            if i:
                out.append(time.perf_counter() - start)
    return statistics.median(ref), statistics.median(mine)


def references(nbytes: int, repeat: int) -> dict[str, float]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return {
        "d2h": nbytes / timed(lambda: pinned.copy_(dev, non_blocking=True), repeat, best=True) / 1e9,
        "h2d": nbytes / timed(lambda: dev.copy_(pinned, non_blocking=True), repeat, best=True) / 1e9,
        "d2d": nbytes / timed(lambda: dev2.copy_(dev), repeat, best=True) / 1e9,
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


def profiled(path: Path, fn) -> None:
    """``fn`` once under ``torch.profiler``: its operations by device time and by host time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = prof.key_averages()
    parts = []
    for key in ("device_time_total", "cpu_time_total"):
        try:
            parts.append(f"by {key}\n" + table.table(sort_by=key, row_limit=20))
        except (KeyError, AttributeError, ValueError) as e:  # older torch names it cuda_time_total
            parts.append(f"by {key}: {e}\n" + table.table(sort_by="cuda_time_total", row_limit=20))
    path.write_text("\n\n".join(parts))


def save_each_step(engine: CopyEngine, ids: list[int], host: torch.Tensor, steps: int) -> dict[str, float]:
    """Prefill steps of 8k tokens through an 8B model's MLPs (32 layers x gate, up, down),
    alone and with each step's KV saved the way the connector saves it: ``mark()`` on the
    compute stream after the step, the gather on a save thread while the next step runs."""
    x = torch.randn(8192, 4096, dtype=torch.bfloat16, device="cuda")
    up = torch.randn(4096, 14336, dtype=torch.bfloat16, device="cuda")
    down = torch.randn(14336, 4096, dtype=torch.bfloat16, device="cuda")
    compute = torch.cuda.Stream()

    def run(save: bool) -> float:
        marks: queue.Queue = queue.Queue()
        saver = threading.Thread(target=lambda: [engine.gather(ids, host, after=m) for m in iter(marks.get, None)])
        saver.start()
        start = time.perf_counter()
        with torch.cuda.stream(compute):
            for _ in range(steps):
                for _ in range(32):
                    torch.matmul(torch.matmul(x, up) * torch.matmul(x, up), down)
                if save:
                    marks.put(engine.mark())
        compute.synchronize()
        elapsed = time.perf_counter() - start
        marks.put(None)
        saver.join()
        return elapsed

    run(False)
    alone = statistics.median(run(False) for _ in range(3))
    saved = statistics.median(run(True) for _ in range(3))
    return {"alone_s": alone, "with_saves_s": saved, "slowdown": saved / alone - 1}


def layered_load(engine: CopyEngine, ids: list[int], repeat: int, partial: bool = False,
                 profile_to: Path | None = None) -> dict[str, float]:  # fmt: skip
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
    if profile_to is not None:
        profiled(profile_to, lambda: forward(True))
    return {"alone_s": alone, "with_load_s": loaded}


def driver() -> str | None:
    """The NVIDIA driver's version, as nvidia-smi reports it (None where it cannot)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


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
    parser.add_argument("--profile", type=Path, help="write torch.profiler tables of a gather, scatter and load here")
    args = parser.parse_args()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    tokens, repeat, steps = (1024, 2, 2) if args.quick else (8192, 7, 10)
    refs = references(GiB if not args.quick else GiB // 8, repeat)
    rows = []
    for order in ("LBNHC", "BLNHC"):
        engine, ids, host, nbytes = llama_cache(order, tokens)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        flat = host.view(torch.uint8).view(-1)
        d2h, gather = paired(lambda f=flat, d=dev: f.copy_(d, non_blocking=True),
                             lambda e=engine, i=ids, h=host: e.gather(i, h), repeat)  # fmt: skip
        h2d, scatter = paired(lambda f=flat, d=dev: d.copy_(f, non_blocking=True),
                              lambda e=engine, i=ids, h=host: e.scatter(i, h), repeat)  # fmt: skip
        del dev
        for what, mine, ref, name in (
            (f"gather + D2H, {tokens} tokens, {order} (GB/s)", gather, d2h, "D2H"),
            (f"H2D + scatter, {tokens} tokens, {order} (GB/s)", scatter, h2d, "H2D"),
        ):
            mine, ref = nbytes / mine / 1e9, nbytes / ref / 1e9
            rows.append({"what": what, "lmtier": mine, "reference": f"pinned {name}, same host buffer",
                         "reference_value": ref, "ratio": mine / ref, "target": ">= 0.8x",
                         "met": mine / ref >= 0.8})  # fmt: skip
        if args.profile:
            profiled(args.profile / f"profile-gather-scatter-{order}.txt",
                     lambda e=engine, i=ids, h=host: (e.gather(i, h), e.scatter(i, h)))  # fmt: skip
        if order == "LBNHC":
            fwd = save_during_forward(engine, ids, host, steps)
            for partial in (False, True):
                where = args.profile / "profile-layered-load.txt" if args.profile and not partial else None
                lay = layered_load(engine, ids, repeat, partial, profile_to=where)
                what = f"forward of 32 layers with a layer-pipelined load of {tokens} tokens"
                rows.append({"what": what + (", token slices of chunks (s)" if partial else " (s)"),
                             "lmtier": lay["with_load_s"], "reference": "the same forward, no load",
                             "reference_value": lay["alone_s"], "ratio": lay["with_load_s"] / lay["alone_s"],
                             "target": "<= 1.1x", "met": lay["with_load_s"] / lay["alone_s"] <= 1.1})  # fmt: skip
            each = save_each_step(engine, ids, host, 2 if args.quick else 4)
            rows.append({"what": f"prefill steps of {tokens} tokens, each step's KV saved (s)",
                         "lmtier": each["with_saves_s"], "reference": "the same steps, no save",
                         "reference_value": each["alone_s"], "ratio": 1 + each["slowdown"], "target": "<= 1.02x",
                         "met": each["slowdown"] <= 0.02})  # fmt: skip
            rows.append({"what": "stress: short steps beside saves back to back (s)", "lmtier": fwd["with_saves_s"],
                         "reference": "the same steps alone", "reference_value": fwd["alone_s"],
                         "ratio": 1 + fwd["slowdown"], "target": "none", "met": None,
                         "saves": fwd["saves"]})  # fmt: skip
        del engine, host
        torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(), "driver": driver(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "references_gb_s": refs,
              "rows": rows, "tests": test_counts(args.tests)}  # fmt: skip
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))
    if args.report:
        args.report.write_text(json.dumps(report, indent=2))
    print(f"device: {report['device']}, driver {report['driver']}, torch {report['torch']} (CUDA {report['cuda']})")
    print("references (GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in refs.items()))
    if report["tests"]:
        print("GPU suite: " + ", ".join(f"{k} {v}" for k, v in report["tests"].items()))
    print("| what | lmtier | reference | reference value | ratio | target | met |")
    print("|---|---:|---|---:|---:|---|---|")
    for r in rows:
        cell = lambda v: "n/a" if v is None else f"{v:.3g}"  # noqa: E731
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        met = "-" if r["met"] is None else "yes" if r["met"] else "**no**"
        print(f"| {r['what']} | {cell(r['lmtier'])} | {r['reference']} | {cell(r['reference_value'])} | {ratio} "
              f"| {r['target']} | {met} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
