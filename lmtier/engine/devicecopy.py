"""``IndexCopier``: KV between an engine's paged cache and canonical chunks with index
kernels on the cache's own device: one gather of every block of a batch into a contiguous
staging buffer per layer, so that leaving the device is one large copy, and the reverse.

The GPU data path needs it: a strided device-to-host copy per layer and per run of blocks
is staged and serialised by the CUDA runtime, where one ``index_select`` per layer on the
device and one DMA of the staging buffer run at the device's and the bus's speed. The
code is device-neutral (torch's index kernels run on CPU tensors too), so CPU CI proves
the indexing for every layout the engine may hand over.

Layouts: vLLM gives each layer as a logical ``[B, H, N, C]`` view (kernel blocks, KV
heads, tokens per kernel block, content: ``K | V`` side by side, or an MLA latent) over
memory in any of its stride orders (``KVCacheLayout``: LBHNC, LBNHC, LHBNC and the
cross-layer BLHNC, BLNHC, BHLNC, where one allocation holds every layer), with the content
contiguous. Everything is moved as bytes (``view(torch.uint8)`` of the content), so any
dtype, fp8 included, moves the same way; the index kernels see each head's row of bytes as
the widest integers it divides into (a 256-byte row as 32 int64): they run one thread per
element, and a kernel that moves eight bytes per element leaves the forward pass's
kernels eight times the share of the device that one moving bytes would.

    IndexCopier(layers, layout, block_size, num_blocks)
      .gather(block_ids, staging)      blocks -> staging uint8 [layers, kv, tokens, heads, row]
      .gather_batch(block_ids, staging, chunks)   the same for ``chunks`` chunks at once:
                                       staging [chunks, layers, kv, tokens, heads, row]
      .scatter(block_ids, staging, layers=None)   the reverse of gather, all or some layers
      .scatter_layer(kernel, layer, staging)      one layer's bytes [kv, tokens, heads, row]
      .scatter_items(index, layer, staging)       one layer of items of one size, each its own
                                       [kv, tokens, heads, row] at any item stride (item_index)
      .staging(tokens, chunks=1)       an empty staging buffer on the cache's device

Block ids are the engine's (manager) block ids in token order; each stands for
``ratio`` consecutive kernel blocks, as in ``lmtier.engine.transfer``; ``kernel_index(block_ids)``
makes that index once, for calls that reuse it (``gather`` and ``scatter`` take either).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmtier.errors import LayoutError
from lmtier.kv.layout import KVLayout


class IndexCopier:
    def __init__(self, layers: Sequence[torch.Tensor], layout: KVLayout, block_size: int, num_blocks: int) -> None:
        if len(layers) != layout.num_layers:
            raise LayoutError(f"{len(layers)} KV cache layers, but the layout has {layout.num_layers}")
        first = layers[0]
        if first.dim() != 4 or any(tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype for t in layers):
            raise LayoutError("expected per-layer [blocks, heads, tokens, content] views of one shape and dtype")
        kernel_blocks, heads, tokens, content = first.shape
        if kernel_blocks % num_blocks or tokens * (kernel_blocks // num_blocks) != block_size:
            raise LayoutError(f"{kernel_blocks} kernel blocks of {tokens} tokens are not {num_blocks} of {block_size}")
        if heads != layout.num_kv_heads or content != layout.head_dim * layout.kv_factor:
            raise LayoutError(f"layer of {heads} heads x {content} values does not match the layout")
        if any(t.stride(3) != 1 for t in layers):
            raise LayoutError("the content of each token must be contiguous (every vLLM layout has it so)")
        self.layout = layout
        self.ratio = kernel_blocks // num_blocks
        self.tokens = tokens  # per kernel block
        self.device = first.device
        self.row = layout.head_dim * first.element_size()  # bytes of one head's K (or V, or latent)
        self.unit = _widest_unit(layers, self.row)  # what the kernels move: a row is row // size of them
        self._views = [self._bytes_view(t) for t in layers]

    def _bytes_view(self, layer: torch.Tensor) -> torch.Tensor:
        """A layer in units, blocks on dim 1: [kv, B, N, H, row units] (MLA: [1, B, N, 1, ...])."""
        raw = layer.view(torch.uint8).view(self.unit)  # [B, H, N, C units], any strides, C contiguous
        return raw.unflatten(3, (self.layout.kv_factor, -1)).permute(3, 0, 2, 1, 4)

    def _units(self, staging: torch.Tensor, *shape: int) -> torch.Tensor:
        """A uint8 staging buffer (or part) as units, shaped ``shape`` + [row units]."""
        return staging.view(self.unit).view(*shape, self.row // self.unit.itemsize)

    def _index(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The kernel blocks of ``block_ids``, on the device (a tensor: made already)."""
        if isinstance(block_ids, torch.Tensor):
            return block_ids
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        kernel = (ids[:, None] * self.ratio + torch.arange(self.ratio)).flatten()
        return kernel.to(self.device, non_blocking=True)

    def staging_shape(self, tokens: int, chunks: int = 1) -> tuple[int, ...]:
        shape = (self.layout.num_layers, self.layout.kv_factor, tokens, self.layout.num_kv_heads, self.row)
        return (chunks, *shape) if chunks > 1 else shape

    def staging(self, tokens: int, chunks: int = 1) -> torch.Tensor:
        return torch.empty(self.staging_shape(tokens, chunks), dtype=torch.uint8, device=self.device)

    def _check(self, staging: torch.Tensor, kernel_blocks: int, chunks: int) -> None:
        want = self.staging_shape(kernel_blocks * self.tokens // chunks, chunks)
        if staging.dtype != torch.uint8 or tuple(staging.shape) != want or not staging.is_contiguous():
            raise LayoutError(f"staging {staging.dtype} {tuple(staging.shape)}, expected contiguous uint8 {want}")
        if staging.device != self.device:
            raise LayoutError(f"staging on {staging.device}, the cache on {self.device}")

    def gather(self, block_ids: Sequence[int] | torch.Tensor, staging: torch.Tensor) -> None:
        """One ``index_select`` per layer, straight into the staging buffer."""
        index = self._index(block_ids)
        self._check(staging, len(index), 1)
        kv, n, h = self.layout.kv_factor, self.tokens, self.layout.num_kv_heads
        for view, out in zip(self._views, staging, strict=True):
            torch.index_select(view, 1, index, out=self._units(out, kv, len(index), n, h))

    def gather_batch(self, block_ids: Sequence[int], staging: torch.Tensor, chunks: int) -> None:
        """``chunks`` chunks at once (``block_ids`` of all of them, in order): per layer one
        ``index_select`` of every block, then one copy of it into each chunk's place."""
        if chunks == 1:
            return self.gather(block_ids, staging)
        index = self._index(block_ids)
        if len(index) % chunks:
            raise LayoutError(f"{len(block_ids)} blocks are not {chunks} whole chunks")
        self._check(staging, len(index), chunks)
        per = len(index) // chunks * self.tokens
        for i, view in enumerate(self._views):
            blocks = torch.index_select(view, 1, index)  # [kv, all blocks, N, H, row units]
            out = self._units(staging[:, i], chunks, self.layout.kv_factor, per, self.layout.num_kv_heads)
            out.copy_(blocks.reshape(self.layout.kv_factor, chunks, per, *blocks.shape[3:]).transpose(0, 1))
        return None

    def kernel_index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """``block_ids`` as the index tensor ``gather`` and ``scatter`` take instead (made
        once for many calls: each list costs a small copy to the device)."""
        return self._index(block_ids)

    def scatter(
        self, block_ids: Sequence[int] | torch.Tensor, staging: torch.Tensor, layers: Sequence[int] | None = None
    ) -> None:
        """One ``index_copy_`` per layer from the staging buffer into the engine's blocks."""
        index = self._index(block_ids)
        self._check(staging, len(index), 1)
        kv, n, h = self.layout.kv_factor, self.tokens, self.layout.num_kv_heads
        for i in layers if layers is not None else range(len(self._views)):
            self._views[i].index_copy_(1, index, self._units(staging[i], kv, len(index), n, h))

    def scatter_layer(self, kernel: torch.Tensor, layer: int, staging: torch.Tensor) -> None:
        """One layer's bytes ``staging`` [kv, tokens, heads, row] (rows contiguous) into the
        blocks of ``kernel`` (``kernel_index``): one ``index_copy_``, no checks (the
        caller's loop is per layer and per chunk: it made the shapes)."""
        n, h = self.tokens, self.layout.num_kv_heads
        self._views[layer].index_copy_(1, kernel, self._units(staging, self.layout.kv_factor, len(kernel), n, h))

    def item_index(self, kernel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The index ``scatter_items`` takes for items of one size, from their
        ``kernel_index`` viewed as [items, kernel blocks]: made once for every layer."""
        items, blocks = kernel.shape
        shape = (items, self.layout.kv_factor, blocks)
        kv = torch.arange(self.layout.kv_factor, device=self.device).view(1, -1, 1).expand(shape).contiguous()
        return kv, kernel.unsqueeze(1).expand(shape).contiguous()

    def scatter_items(self, index: tuple[torch.Tensor, torch.Tensor], layer: int, staging: torch.Tensor) -> None:
        """Items of one size into their blocks for one layer: ``staging`` [items, bytes of
        one item's layer] (each item's [kv, tokens, heads, row] together, the items at any
        stride: a device buffer that holds each item's layers side by side), ``index`` from
        ``item_index``. One ``index_put_``."""
        items, kv, blocks = index[0].shape
        values = self._units(staging, items, kv, blocks, self.tokens, self.layout.num_kv_heads)
        self._views[layer].index_put_(index, values)


def _widest_unit(layers: Sequence[torch.Tensor], row: int) -> torch.dtype:
    """The widest integer type that every layer's rows can be viewed as (its size divides
    the row, each layer's offset and its strides in bytes); bytes where none can."""
    for unit in (torch.int64, torch.int32, torch.int16):
        if row % unit.itemsize:
            continue
        try:
            for t in layers:
                t.view(torch.uint8).view(unit)
        except RuntimeError:
            continue
        return unit
    return torch.uint8
