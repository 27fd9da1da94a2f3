"""CopyEngine: paged engine layouts <-> canonical chunks, for any physical order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmtier.engine.transfer import CopyEngine, HostBuffers, check_chunk_size
from lmtier.errors import LayoutError
from lmtier.kv.chunk import Chunk, checksum
from lmtier.kv.layout import KVLayout

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16")
BLOCKS, BLOCK = 10, 4


def paged(
    order: tuple[int, int, int, int] = (0, 1, 2, 3),
    blocks: int = BLOCKS,
    tokens: int = BLOCK,
    heads: int = 2,
    content: int = 16,
) -> list[torch.Tensor]:
    """Per-layer logical [B, H, N, C] views whose memory is laid out in ``order``."""
    logical = (blocks, heads, tokens, content)
    layers = []
    for i in range(LAYOUT.num_layers):
        physical = torch.randn([logical[d] for d in order], generator=torch.Generator().manual_seed(i))
        inverse = [order.index(d) for d in range(4)]
        layers.append(physical.to(torch.bfloat16).permute(*inverse))  # logical view over that memory
    return layers


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (0, 2, 1, 3), (1, 0, 2, 3)], ids=["BHNC", "BNHC", "HBNC"])
def test_gather_then_scatter_elsewhere_moves_exactly_those_blocks(order):
    layers = paged(order)
    engine = CopyEngine(layers, LAYOUT, BLOCK, BLOCKS)
    out = torch.empty(LAYOUT.tensor_shape(2 * BLOCK), dtype=torch.bfloat16)
    engine.gather([7, 2], out)
    # canonical: [layers, K/V, tokens, heads, dim]; token t of block b is layers[l][b, :, t]
    assert torch.equal(out[1, 0, BLOCK + 3], layers[1][2, :, 3, :8])  # K of block 2, token 3
    assert torch.equal(out[2, 1, 0], layers[2][7, :, 0, 8:])  # V of block 7, token 0
    before = [t.clone() for t in layers]
    engine.scatter([5, 9], out)
    for layer, old in zip(layers, before, strict=True):
        assert torch.equal(layer[5], old[7]) and torch.equal(layer[9], old[2])
        untouched = [b for b in range(BLOCKS) if b not in (5, 9)]
        assert torch.equal(layer[untouched], old[untouched])


def test_engine_blocks_split_into_kernel_blocks():
    layers = paged(blocks=2 * BLOCKS, tokens=BLOCK // 2)  # each engine block = 2 kernel blocks
    engine = CopyEngine(layers, LAYOUT, BLOCK, BLOCKS)
    out = torch.empty(LAYOUT.tensor_shape(BLOCK), dtype=torch.bfloat16)
    engine.gather([3], out)
    assert torch.equal(out[0, 0, :2], layers[0][6, :, :, :8].transpose(0, 1))
    assert torch.equal(out[0, 0, 2:], layers[0][7, :, :, :8].transpose(0, 1))


def test_mla_latents_and_layer_by_layer_scatter():
    layout = KVLayout(num_layers=3, num_kv_heads=1, head_dim=24, dtype="bfloat16", mla=True)
    layers = paged(heads=1, content=24)
    engine = CopyEngine(layers, layout, BLOCK, BLOCKS)
    out = torch.empty(layout.tensor_shape(BLOCK), dtype=torch.bfloat16)  # [layers, tokens, latent]
    engine.gather([4], out)
    assert torch.equal(out[2], layers[2][4, 0])
    engine.scatter([0], out, layers=[1])
    assert torch.equal(layers[1][0], layers[1][4]) and not torch.equal(layers[0][0], layers[0][4])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"heads": 4}, "heads"), ({"content": 8}, "values per token"), ({"blocks": 7}, "does not match")],
)
def test_layouts_that_disagree_with_the_tensors_are_refused(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        CopyEngine(paged(**kwargs), LAYOUT, BLOCK, BLOCKS)
    with pytest.raises(LayoutError, match="dtype"):
        CopyEngine([t.float() for t in paged()], LAYOUT, BLOCK, BLOCKS)
    with pytest.raises(LayoutError, match="layers"):
        CopyEngine(paged()[:2], LAYOUT, BLOCK, BLOCKS)


def test_chunk_size_must_be_a_multiple_of_the_block_size():
    check_chunk_size(256, 64)
    with pytest.raises(LayoutError, match="multiple of the engine's block size"):
        check_chunk_size(100, 64)


def test_cpu_item_path_equals_torch_path_on_strided_chunks():
    """The numpy path (CPU) and the torch path (any device) move the same bytes, also
    for a chunk that is a token slice of a larger tensor."""
    layers = paged((0, 2, 1, 3))
    fast = CopyEngine(layers, LAYOUT, BLOCK, BLOCKS)
    slow = CopyEngine(layers, LAYOUT, BLOCK, BLOCKS)
    slow._items = None  # force the torch path
    assert fast._items is not None
    big = torch.randn(LAYOUT.tensor_shape(4 * BLOCK)).to(torch.bfloat16)
    part = big.narrow(LAYOUT.token_axis, BLOCK, 2 * BLOCK)  # strided: not contiguous
    assert not part.is_contiguous()
    fast.scatter([6, 1], part)
    a, b = torch.empty_like(part), torch.empty_like(part)
    fast.gather([6, 1], a)
    slow.gather([6, 1], b)
    assert torch.equal(a, part) and torch.equal(b, part)
    window = big.narrow(LAYOUT.token_axis, 0, 2 * BLOCK)
    fast.gather([1, 6], window)  # into a strided destination
    assert torch.equal(window, torch.cat([part[:, :, BLOCK:], part[:, :, :BLOCK]], dim=LAYOUT.token_axis))


def test_chunk_bytes_move_like_tensors_on_a_cpu_engine():
    layers = paged((1, 0, 2, 3))
    engine = CopyEngine(layers, LAYOUT, BLOCK, BLOCKS)
    tensor = torch.empty(LAYOUT.tensor_shape(2 * BLOCK), dtype=torch.bfloat16)
    engine.gather([3, 8], tensor)
    raw = np.empty(LAYOUT.byte_shape(2 * BLOCK), dtype=np.uint8)
    engine.gather([3, 8], raw)
    assert raw.tobytes() == tensor.view(torch.uint8).numpy().tobytes()
    engine.scatter([0, 1], raw)
    assert torch.equal(layers[2][0], layers[2][3]) and torch.equal(layers[2][1], layers[2][8])
    with pytest.raises(LayoutError, match="expected uint8"):
        engine.scatter([0], raw)


@pytest.mark.parametrize("damaged_layer", [None, 0, 2])
def test_a_chunk_verified_layer_by_layer_while_it_is_scattered(damaged_layer):
    """The engine's load path: each layer is hashed right before it is copied; the layers'
    hashes in order are the chunk's checksum, so one flipped byte in any layer fails the
    chunk (its blocks are recomputed) and an intact chunk lands exactly as a plain copy."""
    layers = paged((0, 2, 1, 3))
    engine = CopyEngine(layers, LAYOUT, BLOCK, BLOCKS)
    raw = np.empty(LAYOUT.byte_shape(2 * BLOCK), dtype=np.uint8)
    engine.gather([3, 8], raw)
    dropped = []
    stored = Chunk(b"k" * 16, LAYOUT, raw.copy(), checksum=checksum(raw), verified=False)
    stored._on_corrupt = lambda: dropped.append(True)
    if damaged_layer is not None:
        stored.data[damaged_layer, 1, BLOCK + 1, 5] ^= 0x04
    check = stored.layer_check()
    engine.scatter([0, 1], stored.data, before_layer=check)
    assert check.passed() is (damaged_layer is None)
    assert dropped == ([] if damaged_layer is None else [True])
    if damaged_layer is None:
        assert stored.verified
        assert all(torch.equal(layer[0], layer[3]) and torch.equal(layer[1], layer[8]) for layer in layers)


def test_a_layer_check_refuses_layers_out_of_order_or_missing():
    raw = np.zeros(LAYOUT.byte_shape(BLOCK), dtype=np.uint8)
    check = Chunk(b"k" * 16, LAYOUT, raw, checksum=checksum(raw), verified=False).layer_check()
    with pytest.raises(ValueError, match="in order"):
        check(1)
    check(0)
    with pytest.raises(ValueError, match="1 of 3 layers"):
        check.passed()


def test_host_buffers_are_reused_and_bounded():
    buffers = HostBuffers(LAYOUT, 2 * BLOCK, pinned=False, max_bytes=3 * LAYOUT.chunk_bytes(2 * BLOCK))
    held = [buffers.acquire() for _ in range(3)]
    assert all(b is not None and b.shape == LAYOUT.tensor_shape(2 * BLOCK) for b in held)
    assert buffers.acquire() is None  # the bound: a future miss, never a wait
    buffers.release(held[1])
    assert buffers.acquire() is held[1] and buffers.made == 3
    assert HostBuffers(LAYOUT, BLOCK, pinned=False, max_bytes=0).limit == 2  # at least two


def test_gather_many_is_each_chunk_gathered():
    layers = paged()
    engine = CopyEngine(layers, LAYOUT, BLOCK, BLOCKS)
    outs = [torch.empty(LAYOUT.tensor_shape(2 * BLOCK), dtype=torch.bfloat16) for _ in range(3)]
    blocks = [[1, 8], [3, 3], [9, 0]]
    engine.gather_many(blocks, outs)
    for ids, out in zip(blocks, outs, strict=True):
        one = torch.empty_like(out)
        engine.gather(ids, one)
        assert torch.equal(one, out)
