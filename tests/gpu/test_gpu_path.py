"""The GPU data path on a real GPU: run by ``make gpu-check`` (not by the CPU suite, which
ignores this directory; a CPU test collects it so that it stays importable).

Byte equality with the CPU path for every vLLM layout and dtype, MLA and kernel-block
splits; a save ordered after the compute stream's write (the bug that served wrong KV in
other systems: the copy must see the final values); a load the next kernel reads at once.
"""

from __future__ import annotations

import threading

import pytest
import torch

from lmtier.engine import layerload
from lmtier.engine.transfer import CopyEngine, HostBuffers
from lmtier.kv.layout import KVLayout
from lmtier.testing.layouts import ORDERS, paged_layers

LAYERS, BLOCKS, BLOCK = 4, 64, 16
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


@pytest.fixture(scope="module")
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.fail("the GPU suite needs a CUDA device (make gpu-check runs it on one)")
    return torch.device("cuda")


def both(order: str, dtype: torch.dtype, *, mla: bool = False, ratio: int = 1):
    """The same cache, byte for byte, on the CPU and on the GPU, and its layout."""
    heads, head = (1, 64) if mla else (4, 32)
    layout = KVLayout(LAYERS, heads, head, dtype=str(dtype).removeprefix("torch."), mla=mla)
    shape = dict(layers=LAYERS, blocks=BLOCKS * ratio, heads=heads, tokens=BLOCK // ratio,
                 content=head * layout.kv_factor, dtype=dtype, seed=3)  # fmt: skip
    cpu, cpu_raw = paged_layers(order, device="cpu", **shape)
    gpu, gpu_raw = paged_layers(order, device="cuda", **shape)
    assert torch.equal(cpu_raw, gpu_raw.cpu())
    return (cpu, cpu_raw), (gpu, gpu_raw), layout


def host(layout: KVLayout, tokens: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    return torch.empty(layout.tensor_shape(tokens), dtype=dtype, pin_memory=pinned)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("order", list(ORDERS))
def test_gather_and_scatter_equal_the_cpu_path(cuda, order, dtype):
    (cpu, cpu_raw), (gpu, gpu_raw), layout = both(order, dtype)
    blocks, dest = [9, 2, 40, 41], [5, 63, 0, 17]
    ref, out = host(layout, 4 * BLOCK, dtype, False), host(layout, 4 * BLOCK, dtype, True)
    CopyEngine(cpu, layout, BLOCK, BLOCKS).gather(blocks, ref)
    engine = CopyEngine(gpu, layout, BLOCK, BLOCKS)
    engine.gather(blocks, out)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
    CopyEngine(cpu, layout, BLOCK, BLOCKS).scatter(dest, ref)
    engine.scatter(dest, out)
    assert torch.equal(gpu_raw.cpu(), cpu_raw)


@pytest.mark.parametrize(("mla", "ratio"), [(True, 1), (False, 2), (True, 2)])
def test_mla_and_kernel_block_splits(cuda, mla, ratio):
    (cpu, cpu_raw), (gpu, gpu_raw), layout = both("BLNHC", torch.bfloat16, mla=mla, ratio=ratio)
    ref, out = host(layout, 2 * BLOCK, torch.bfloat16, False), host(layout, 2 * BLOCK, torch.bfloat16, True)
    CopyEngine(cpu, layout, BLOCK, BLOCKS).gather([7, 30], ref)
    engine = CopyEngine(gpu, layout, BLOCK, BLOCKS)
    engine.gather([7, 30], out)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
    CopyEngine(cpu, layout, BLOCK, BLOCKS).scatter([1, 2], ref, layers=[0, 3])
    engine.scatter([1, 2], out, layers=[0, 3])
    assert torch.equal(gpu_raw.cpu(), cpu_raw)


def test_one_engine_moves_loads_and_saves_of_every_size(cuda):
    """The staging buffers are reused and grown: any size after any other stays exact."""
    (cpu, _), (gpu, _), layout = both("LBNHC", torch.float16)
    ref_engine, engine = CopyEngine(cpu, layout, BLOCK, BLOCKS), CopyEngine(gpu, layout, BLOCK, BLOCKS)
    for n in (3, 1, 8, 2, 8):
        blocks = list(range(40, 40 + n))
        ref, out = host(layout, n * BLOCK, torch.float16, False), host(layout, n * BLOCK, torch.float16, True)
        ref_engine.gather(blocks, ref)
        engine.gather(blocks, out)
        assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
        engine.scatter(list(range(n)), out)
        back = host(layout, n * BLOCK, torch.float16, True)
        engine.gather(list(range(n)), back)
        assert torch.equal(back.view(torch.uint8), ref.view(torch.uint8))


def test_a_batch_of_saves_equals_the_cpu_path_chunk_by_chunk(cuda):
    (cpu, _), (gpu, _), layout = both("BLHNC", torch.bfloat16)
    blocks = [[1, 50], [7, 7], [63, 0], [12, 13]]
    outs = [host(layout, 2 * BLOCK, torch.bfloat16, True) for _ in blocks]
    CopyEngine(gpu, layout, BLOCK, BLOCKS).gather_many(blocks, outs)
    reference = CopyEngine(cpu, layout, BLOCK, BLOCKS)
    for ids, out in zip(blocks, outs, strict=True):
        ref = host(layout, 2 * BLOCK, torch.bfloat16, False)
        reference.gather(ids, ref)
        assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))


def test_pinned_host_buffers_stay_bounded_under_pressure(cuda):
    layout = KVLayout(LAYERS, 4, 32, dtype="bfloat16")
    buffers = HostBuffers(layout, BLOCK, pinned=True, max_bytes=8 * layout.chunk_bytes(BLOCK))
    got, lock = [], threading.Lock()

    def grab() -> None:
        for _ in range(10):
            buf = buffers.acquire()
            if buf is not None:
                assert buf.is_pinned()
                with lock:
                    got.append(buf)

    threads = [threading.Thread(target=grab) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and buffers.made == 8 and buffers.acquire() is None


def test_a_save_sees_what_the_compute_stream_wrote_last(cuda):
    """A long kernel, then the KV write, on the compute stream; the save is asked for at
    once from another thread, with the event marked after the write. The saved bytes are
    the final values, never what the blocks held before."""
    (_, _), (gpu, _), layout = both("LBHNC", torch.float16)
    engine = CopyEngine(gpu, layout, BLOCK, BLOCKS)
    compute = torch.cuda.Stream()
    out = host(layout, BLOCK, torch.float16, True)
    for attempt in range(3):
        value = float(attempt + 1)
        with torch.cuda.stream(compute):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the write lands
            for layer in gpu:
                layer[11].fill_(value)
            written = engine.mark()
        saver = threading.Thread(target=engine.gather, args=([11], out), kwargs={"after": written})
        saver.start()
        saver.join()
        assert bool((out == value).all()), f"attempt {attempt}: the save read the blocks before the write"
    compute.synchronize()


@pytest.mark.parametrize(("ahead", "stage_bytes"), [(None, None), (1, 1)], ids=["default", "lazy-per-item"])
def test_layer_loads_land_before_the_kernels_that_wait_for_them(cuda, ahead, stage_bytes, monkeypatch):
    """``load_layers`` returns at once; a compute stream that waits on layer ``i`` (as an
    attention layer does through wait_for_layer_load) reads exactly the loaded bytes: the
    first item a token slice of a chunk (a partial hit), and also with one layer issued
    ahead of the wait and a device buffer of one item at a time."""
    if ahead is not None:
        monkeypatch.setattr(layerload, "LOAD_AHEAD", ahead)
        monkeypatch.setattr(layerload, "LOAD_STAGE_BYTES", stage_bytes)
    (cpu, cpu_raw), (gpu, gpu_raw), layout = both("BLNHC", torch.bfloat16)
    srcs = []
    for tokens in (3 * BLOCK, 2 * BLOCK):
        src = host(layout, tokens, torch.bfloat16, True)
        src.copy_(torch.randn(src.shape).to(torch.bfloat16))
        srcs.append(src)
    items = [([8, 20], srcs[0].narrow(layout.token_axis, BLOCK, 2 * BLOCK)), ([33, 2], srcs[1])]
    reference = CopyEngine(cpu, layout, BLOCK, BLOCKS)
    for blocks, src in items:
        reference.scatter(blocks, src.contiguous())
    engine = CopyEngine(gpu, layout, BLOCK, BLOCKS)
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        load = engine.load_layers(items)
        seen = []
        for i, layer in enumerate(gpu):
            load.wait(i)
            seen.append(layer[[8, 20, 33, 2]].clone())  # what an attention layer would read
    compute.synchronize()
    load.finish()
    assert torch.equal(gpu_raw.cpu(), cpu_raw)
    for i, got in enumerate(seen):
        assert torch.equal(got.cpu(), cpu[i][[8, 20, 33, 2]])


def test_a_load_is_complete_for_the_next_kernel(cuda):
    (_, _), (gpu, _), layout = both("BLHNC", torch.bfloat16)
    engine = CopyEngine(gpu, layout, BLOCK, BLOCKS)
    src = host(layout, 2 * BLOCK, torch.bfloat16, True)
    src.copy_(torch.randn(src.shape).to(torch.bfloat16))
    engine.scatter([3, 4], src)
    back = host(layout, 2 * BLOCK, torch.bfloat16, True)
    engine.gather([3, 4], back)
    assert torch.equal(back.view(torch.uint8), src.view(torch.uint8))
    total = sum(float(layer[3].float().sum()) for layer in gpu)  # a kernel on the default stream
    expect = float(src[:, :, :BLOCK].float().sum())
    assert abs(total - expect) <= 1e-2 * max(1.0, abs(expect))
