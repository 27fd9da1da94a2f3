"""IndexCopier (the GPU data path's gather and scatter) on CPU tensors, over every KV
cache layout vLLM allocates (each ``KVCacheLayout``, built by ``lmtier.testing.layouts``
and checked here against vLLM's own ``compute_layout_strides``), each dtype, MLA, and
engine blocks split into kernel blocks. The reference is a plain per-block loop."""

from __future__ import annotations

import math

import pytest
import torch
from vllm.v1 import kv_cache_interface as kv_interface
from vllm.v1.kv_cache_layout import KVCacheLayout

from lmtier.engine import layerload
from lmtier.engine.devicecopy import IndexCopier
from lmtier.engine.layerload import LayerLoad
from lmtier.engine.transfer import CopyEngine
from lmtier.errors import LayoutError
from lmtier.kv.layout import KVLayout
from lmtier.testing.layouts import ORDERS, paged_layers, strides

LAYERS, BLOCKS, BLOCK = 3, 12, 4
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


def cache(order: str, dtype: torch.dtype, *, mla: bool = False, kernel_block: int | None = None):
    """Per-layer [B, H, N, C] views as vLLM lays out ``order`` (see ``lmtier.testing.layouts``,
    whose strides are checked against vLLM's below), and the layout they hold."""
    ratio = BLOCK // kernel_block if kernel_block else 1
    heads, head = (1, 24) if mla else (2, 8)
    kv = KVLayout(LAYERS, heads, head, dtype=str(dtype).removeprefix("torch."), mla=mla)
    layers, raw = paged_layers(
        order, layers=LAYERS, blocks=BLOCKS * ratio, heads=heads, tokens=BLOCK // ratio,
        content=head * kv.kv_factor, dtype=dtype, seed=7,
    )  # fmt: skip
    return layers, kv, raw


@pytest.mark.parametrize("kernel_block", [None, BLOCK // 2])
@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_the_synthetic_caches_have_vllms_own_strides(layout, mla, kernel_block):
    cls = kv_interface.MLAAttentionSpec if mla else kv_interface.FullAttentionSpec
    spec = cls(block_size=BLOCK, num_kv_heads=1 if mla else 2, head_size=24 if mla else 8, dtype=torch.float16)
    want = kv_interface.compute_layout_strides(spec, BLOCKS, LAYERS, layout, kernel_block)
    layers, _, _ = cache(layout.name, torch.float16, mla=mla, kernel_block=kernel_block)
    shape = (LAYERS, *kv_interface.compute_layer_kv_cache_shape_bytes(spec, BLOCKS, kernel_block))
    assert layout.name in ORDERS and strides(shape, ORDERS[layout.name]) == want
    as_bytes = layers[0].view(torch.uint8)
    assert tuple(as_bytes.shape) == shape[1:] and as_bytes.stride() == want[1:]


def reference(layers, layout: KVLayout, block_ids, ratio: int = 1) -> torch.Tensor:
    """Canonical bytes [layers, kv, tokens, heads, row], block by block, token by token."""
    out = []
    for layer in layers:
        raw = layer.view(torch.uint8)  # [B, H, N, C bytes]
        rows = [raw[b * ratio + r, :, n] for b in block_ids for r in range(ratio) for n in range(raw.shape[2])]
        tokens = torch.stack(rows)  # [T, H, C]
        out.append(tokens.unflatten(2, (layout.kv_factor, -1)).permute(2, 0, 1, 3))
    return torch.stack(out).contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_gather_and_scatter_match_a_per_block_loop_on_every_layout_and_dtype(layout, dtype):
    layers, kv, raw = cache(layout.name, dtype)
    copier = IndexCopier(layers, kv, BLOCK, BLOCKS)
    staging = copier.staging(3 * BLOCK)
    copier.gather([7, 2, 5], staging)
    assert torch.equal(staging, reference(layers, kv, [7, 2, 5]))
    before = raw.clone()
    expected = [layer.view(torch.uint8).clone() for layer in layers]
    for e in expected:
        e[[1, 9, 3]] = e[[7, 2, 5]].clone()
    copier.scatter([1, 9, 3], staging)
    assert all(torch.equal(layer.view(torch.uint8), e) for layer, e in zip(layers, expected, strict=True))
    assert (raw != before).any()  # something moved, through the views into the one buffer


@pytest.mark.parametrize(
    "layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLNHC, KVCacheLayout.BHLNC], ids=lambda x: x.name
)
def test_mla_latents_and_a_layer_at_a_time(layout):
    layers, kv, _ = cache(layout.name, torch.bfloat16, mla=True)
    copier = IndexCopier(layers, kv, BLOCK, BLOCKS)
    staging = copier.staging(BLOCK)
    copier.gather([4], staging)
    assert torch.equal(staging, reference(layers, kv, [4]))
    assert staging.view(LAYERS, BLOCK, -1).shape[-1] == kv.token_row_bytes
    others = [layers[0][0].clone(), layers[2][0].clone()]
    copier.scatter([0], staging, layers=[1])
    assert torch.equal(layers[1][0], layers[1][4])
    assert torch.equal(layers[0][0], others[0]) and torch.equal(layers[2][0], others[1])


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC], ids=lambda x: x.name)
def test_engine_blocks_split_into_kernel_blocks(layout):
    layers, kv, _ = cache(layout.name, torch.float16, kernel_block=BLOCK // 2)
    assert layers[0].shape[0] == 2 * BLOCKS
    copier = IndexCopier(layers, kv, BLOCK, BLOCKS)
    staging = copier.staging(2 * BLOCK)
    copier.gather([3, 8], staging)
    assert torch.equal(staging, reference(layers, kv, [3, 8], ratio=2))


@pytest.mark.parametrize(
    ("dtype", "head", "unit"),
    [(torch.float16, 8, torch.int64), (torch.float16, 2, torch.int32), (torch.bfloat16, 1, torch.int16),
     (torch.float8_e4m3fn, 3, torch.uint8), (torch.float8_e4m3fn, 12, torch.int32)],
)  # fmt: skip
def test_rows_move_as_the_widest_integers_they_divide_into(dtype, head, unit):
    kv = KVLayout(LAYERS, 2, head, dtype=str(dtype).removeprefix("torch."))
    layers, _ = paged_layers("BLNHC", layers=LAYERS, blocks=BLOCKS, heads=2, tokens=BLOCK, content=2 * head,
                             dtype=dtype, seed=5)  # fmt: skip
    copier = IndexCopier(layers, kv, BLOCK, BLOCKS)
    assert copier.unit == unit
    staging = copier.staging(2 * BLOCK, chunks=2)
    copier.gather_batch([3, 0, 11, 6], staging, 2)
    for c, ids in enumerate(([3, 0], [11, 6])):
        assert torch.equal(staging[c], reference(layers, kv, ids))
    expected = [layer.view(torch.uint8).clone() for layer in layers]
    for e in expected:
        e[[5, 9]] = e[[11, 6]].clone()
    copier.scatter([5, 9], staging[1].contiguous())
    assert all(torch.equal(layer.view(torch.uint8), e) for layer, e in zip(layers, expected, strict=True))


def test_a_cache_at_an_odd_offset_moves_as_bytes():
    kv = KVLayout(LAYERS, 2, 16, dtype="uint8")
    shape = (BLOCKS, 2, BLOCK, 2 * 16)  # [B, H, N, K|V]
    n = math.prod(shape)
    buf = torch.randint(0, 255, (1 + LAYERS * n,), dtype=torch.uint8)
    layers = [buf[1 + i * n : 1 + (i + 1) * n].view(shape) for i in range(LAYERS)]  # odd byte offsets
    copier = IndexCopier(layers, kv, BLOCK, BLOCKS)
    assert copier.unit == torch.uint8
    staging = copier.staging(2 * BLOCK)
    copier.gather([7, 1], staging)
    assert torch.equal(staging, reference(layers, kv, [7, 1]))


def test_a_batch_of_chunks_is_each_chunk_gathered_on_its_own():
    layers, kv, _ = cache("LBNHC", torch.bfloat16)
    copier = IndexCopier(layers, kv, BLOCK, BLOCKS)
    blocks = [6, 1, 11, 0, 3, 8]  # three chunks of two blocks
    batch = copier.staging(2 * BLOCK, chunks=3)
    copier.gather_batch(blocks, batch, 3)
    for c in range(3):
        one = copier.staging(2 * BLOCK)
        copier.gather(blocks[2 * c : 2 * c + 2], one)
        assert torch.equal(batch[c], one)


def test_the_index_path_and_the_cpu_engine_path_agree():
    """The CPU engines' copy path (proven against real vLLM engines) and the index path
    make the same canonical bytes from the same cache."""
    layers, kv, _ = cache("LBNHC", torch.bfloat16)
    staging = IndexCopier(layers, kv, BLOCK, BLOCKS).staging(2 * BLOCK)
    IndexCopier(layers, kv, BLOCK, BLOCKS).gather([9, 4], staging)
    out = torch.empty(kv.tensor_shape(2 * BLOCK), dtype=torch.bfloat16)
    CopyEngine(layers, kv, BLOCK, BLOCKS).gather([9, 4], out)
    assert torch.equal(staging.flatten(), out.view(torch.uint8).flatten())


def test_wrong_staging_or_layout_is_refused():
    layers, kv, _ = cache("LBHNC", torch.bfloat16)
    copier = IndexCopier(layers, kv, BLOCK, BLOCKS)
    with pytest.raises(LayoutError, match="staging"):
        copier.gather([1, 2], copier.staging(BLOCK))  # room for one block
    with pytest.raises(LayoutError, match="staging"):
        copier.scatter([1], copier.staging(BLOCK).float())
    with pytest.raises(LayoutError, match="whole chunks"):
        copier.gather_batch([1, 2, 3], copier.staging(BLOCK, chunks=2), 2)
    with pytest.raises(LayoutError, match="heads"):
        IndexCopier(layers, KVLayout(LAYERS, 4, 8, dtype="bfloat16"), BLOCK, BLOCKS)
    with pytest.raises(LayoutError, match="kernel blocks"):
        IndexCopier(layers, kv, BLOCK, BLOCKS - 1)


@pytest.mark.parametrize("stage_bytes", [layerload.LOAD_STAGE_BYTES, 1], ids=["one-stage", "stage-per-item"])
@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("order", ["LBNHC", "BHLNC"])
def test_layer_loads_equal_scatters_with_token_slices_of_chunks(order, mla, stage_bytes, monkeypatch):
    """CopyEngine.load_layers (the layer-by-layer loads), with the token slices the
    connector passes for partial chunks, lands what scatter does, chunk by chunk; also
    when the device buffer holds one item at a time (a load larger than it)."""
    monkeypatch.setattr(layerload, "LOAD_STAGE_BYTES", stage_bytes)
    (layers, kv, raw), (same, _, same_raw) = (cache(order, torch.bfloat16, mla=mla, kernel_block=BLOCK // 2)
                                              for _ in range(2))  # fmt: skip
    chunk = torch.randn(kv.tensor_shape(3 * BLOCK)).to(torch.bfloat16)
    other = torch.randn(kv.tensor_shape(BLOCK)).to(torch.bfloat16)
    third = torch.randn(kv.tensor_shape(2 * BLOCK)).to(torch.bfloat16)
    items = [([4, 9], chunk.narrow(kv.token_axis, BLOCK, 2 * BLOCK)), ([1], other), ([11, 0], third)]
    CopyEngine(layers, kv, BLOCK, BLOCKS).load_layers(items).finish()
    reference = CopyEngine(same, kv, BLOCK, BLOCKS)
    for ids, src in items:
        reference.scatter(ids, src.contiguous())
    assert torch.equal(raw, same_raw) and not torch.equal(raw, cache(order, torch.bfloat16, mla=mla)[2])


def test_a_lazy_layer_load_issues_layers_ahead_of_the_one_waited_for():
    """On a GPU the layers are issued LOAD_AHEAD ahead of the forward pass's wait, the rest
    by finish; done() only once every layer is issued (the order, without a device)."""
    issued: list[int] = []
    load = LayerLoad(lambda i: issued.append(i), 12, [], lazy=True)
    assert issued == list(range(layerload.LOAD_AHEAD)) and not load.done()
    load.wait(0)
    assert issued == list(range(layerload.LOAD_AHEAD + 1))
    load.wait(5)
    assert issued == list(range(5 + layerload.LOAD_AHEAD + 1)) and not load.done()
    load.finish()
    assert issued == list(range(12)) and load.done()
    eager: list[int] = []
    assert LayerLoad(lambda i: eager.append(i), 3, [], lazy=False).done() and eager == [0, 1, 2]


@pytest.mark.parametrize("stage_bytes", [layerload.LOAD_STAGE_BYTES, 3 * 1024])
def test_layer_loads_in_growing_groups_of_layers_land_every_item(stage_bytes, monkeypatch):
    """Eight layers go as groups of 1, 1, 2 and 4 (as far as the device buffer holds
    them), each item's layers of a group copied as one run, and land what scatter does:
    runs of items of three shapes, the first two token slices of chunks."""
    monkeypatch.setattr(layerload, "LOAD_STAGE_BYTES", stage_bytes)
    kv = KVLayout(8, 2, 8, dtype="float16")
    made = [paged_layers("LBHNC", layers=8, blocks=BLOCKS, heads=2, tokens=BLOCK, content=16,
                         dtype=torch.float16, seed=2) for _ in range(2)]  # fmt: skip
    (layers, raw), (same, same_raw) = made
    chunks = [torch.randn(kv.tensor_shape(2 * BLOCK)).half() for _ in range(4)]
    longer = torch.randn(kv.tensor_shape(3 * BLOCK)).half()
    items = [([6], chunks[0].narrow(kv.token_axis, BLOCK, BLOCK)), ([8], longer.narrow(kv.token_axis, BLOCK, BLOCK))]
    items += [(ids, c) for ids, c in zip(([2, 3], [10, 0], [5, 7]), chunks[1:], strict=True)]
    engine = CopyEngine(layers, kv, BLOCK, BLOCKS)
    load = engine.load_layers(items)
    plan = load._keep[0]
    want = {0: 1, 1: 2, 2: 4, 4: 8} if stage_bytes > 8 * 1024 else {i: i + 1 for i in range(8)}
    assert plan.groups == want
    # half a chunk's rows: one copy with the rows between; a third: a copy per layer and K/V
    assert [shape[-1] for shape in plan.shapes] == [True, False, True, True, True]
    load.finish()
    reference = CopyEngine(same, kv, BLOCK, BLOCKS)
    for ids, src in items:
        reference.scatter(ids, src.contiguous())
    assert torch.equal(raw, same_raw)


def test_a_load_or_a_copy_refuses_blocks_and_dtypes_that_would_land_wrong():
    """An index kernel wraps a negative block id onto the last block, one index_put_ lands
    either of two writes to one block, and bytes of another dtype are not this cache's KV:
    each is an error before anything moves (the connector then recomputes)."""
    layers, kv, raw = cache("LBNHC", torch.float16)
    engine = CopyEngine(layers, kv, BLOCK, BLOCKS)
    one = torch.randn(kv.tensor_shape(BLOCK)).half()
    before = raw.clone()
    for items, match in (
        ([([2], one), ([2], one)], "twice"),
        ([([-1], one)], "block ids"),
        ([([BLOCKS], one)], "block ids"),
        ([([3], one.float())], "float32"),
        ([([3], one.bfloat16())], "bfloat16"),
    ):
        with pytest.raises(LayoutError, match=match):
            engine.load_layers(items)
    with pytest.raises(LayoutError, match="block ids"):
        engine.scatter([-1], one)
    with pytest.raises(LayoutError, match="block ids"):
        engine.gather([BLOCKS], torch.empty_like(one))
    assert torch.equal(raw, before)


def test_host_tensors_of_any_strides_land_as_scatter_lands_them():
    """A source whose values are not unit-stride, or whose layer and K/V strides are not
    whole rows, lands what a scatter of its contiguous copy lands."""
    layout = KVLayout(LAYERS, 2, 8, dtype="float16")
    wide = torch.randn(KVLayout(LAYERS, 2, 16, dtype="float16").tensor_shape(2 * BLOCK)).half()
    flat = torch.randn(2 * layout.chunk_bytes(2 * BLOCK)).half()
    t, hd = 2 * BLOCK, 2 * 8
    odd = flat.as_strided((LAYERS, 2, t, 2, 8), (2 * t * hd + 1, t * hd + 1, hd, 8, 1))
    for src in (wide[..., ::2], odd):
        (layers, _, raw), (same, _, same_raw) = (cache("LBHNC", torch.float16) for _ in range(2))
        CopyEngine(layers, layout, BLOCK, BLOCKS).load_layers([([1, 2], src)]).finish()
        CopyEngine(same, layout, BLOCK, BLOCKS).scatter([1, 2], src.contiguous())
        assert torch.equal(raw, same_raw)


def test_a_layer_load_waits_only_for_its_own_layers_and_lets_go_when_finished():
    load = LayerLoad(lambda i: None, 4, [object()], lazy=True)
    for bad in (-1, 4):
        with pytest.raises(IndexError):
            load.wait(bad)
    load.finish()
    assert load.done() and load._issue is None and load._keep == []
