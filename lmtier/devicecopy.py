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
dtype, fp8 included, moves the same way.

    IndexCopier(layers, layout, block_size, num_blocks)
      .gather(block_ids, staging)      blocks -> staging uint8 [layers, kv, tokens, heads, row]
      .gather_batch(block_ids, staging, chunks)   the same for ``chunks`` chunks at once:
                                       staging [chunks, layers, kv, tokens, heads, row]
      .scatter(block_ids, staging, layers=None)   the reverse of gather, all or some layers
      .scatter_layer(kernel, layer, staging)      one layer's bytes [kv, tokens, heads, row]
      .staging(tokens, chunks=1)       an empty staging buffer on the cache's device

Block ids are the engine's (manager) block ids in token order; each stands for
``ratio`` consecutive kernel blocks, as in ``lmtier.transfer``; ``kernel_index(block_ids)``
makes that index once, for calls that reuse it (``gather`` and ``scatter`` take either).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmtier.errors import LayoutError
from lmtier.layout import KVLayout


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
        self._views = [self._bytes_view(t) for t in layers]

    def _bytes_view(self, layer: torch.Tensor) -> torch.Tensor:
        """A layer as bytes, blocks on dim 1: [kv, B, N, H, row] (MLA: [1, B, N, 1, row])."""
        raw = layer.view(torch.uint8)  # [B, H, N, C bytes], any strides, C contiguous
        return raw.unflatten(3, (self.layout.kv_factor, self.row)).permute(3, 0, 2, 1, 4)

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
            torch.index_select(view, 1, index, out=out.view(kv, len(index), n, h, self.row))

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
            blocks = torch.index_select(view, 1, index)  # [kv, all blocks, N, H, row]
            staging[:, i].copy_(blocks.reshape(self.layout.kv_factor, chunks, per, *blocks.shape[3:]).transpose(0, 1))
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
            self._views[i].index_copy_(1, index, staging[i].view(kv, len(index), n, h, self.row))

    def scatter_layer(self, kernel: torch.Tensor, layer: int, staging: torch.Tensor) -> None:
        """One layer's bytes ``staging`` [kv, tokens, heads, row] (contiguous) into the
        blocks of ``kernel`` (``kernel_index``): one ``index_copy_``, no checks (the
        caller's loop is per layer and per chunk: it made the shapes)."""
        n, h = self.tokens, self.layout.num_kv_heads
        self._views[layer].index_copy_(1, kernel, staging.view(self.layout.kv_factor, len(kernel), n, h, self.row))
