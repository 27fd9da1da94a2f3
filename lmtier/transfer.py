"""``CopyEngine``: KV between an engine's paged cache and canonical chunk buffers.

The only code that knows engine layouts. It reads them from the tensors: each layer is a
logical ``[blocks, kv_heads, block_tokens, content]`` view (vLLM's per-layer view; the
physical order behind it may be any, torch indexes through the strides), where
``content`` is ``K | V`` side by side (``2 x head_dim``) or one MLA latent. The engine's
allocator may cut each of its blocks into several kernel blocks; the ratio is read from
the tensor's block count. Nothing is assumed that the tensors do not confirm: a
mismatch with the expected ``KVLayout`` is an error at registration, not wrong KV later.

    gather(block_ids, out)      blocks of every layer -> out [layers, kv, tokens, heads, dim]
    scatter(block_ids, src, layers=None)   the reverse, for all or some layers

Block ids are the engine's (manager) block ids, in token order; ``block_ids`` must cover
whole blocks, so a chunk is a whole number of blocks (``chunk_tokens`` a multiple of the
block size). On CUDA the copies run on the engine's device with ``non_blocking`` copies
through pinned memory on a dedicated stream that first waits on the compute stream; an
event marks completion (``synchronize``). On CPU the same indexing runs as plain copies,
so tests exercise exactly the indexing used on GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmtier.errors import LayoutError
from lmtier.layout import KVLayout


def check_chunk_size(chunk_tokens: int, block_size: int) -> None:
    if block_size <= 0 or chunk_tokens % block_size:
        raise LayoutError(
            f"chunk_tokens ({chunk_tokens}) must be a multiple of the engine's block size ({block_size}); "
            f"set chunk_tokens to e.g. {max(block_size, (chunk_tokens // block_size or 1) * block_size)}"
        )


class CopyEngine:
    def __init__(self, layers: Sequence[torch.Tensor], layout: KVLayout, block_size: int, num_blocks: int) -> None:
        if len(layers) != layout.num_layers:
            raise LayoutError(f"{len(layers)} KV cache layers, but the layout has {layout.num_layers}")
        first = layers[0]
        if first.dim() != 4:
            raise LayoutError(
                f"expected per-layer [blocks, heads, tokens, content] views, got shape {tuple(first.shape)}"
            )
        kernel_blocks, heads, kernel_tokens, content = first.shape
        if kernel_blocks % num_blocks or kernel_tokens * (kernel_blocks // num_blocks) != block_size:
            raise LayoutError(
                f"layer of {kernel_blocks} blocks x {kernel_tokens} tokens does not match {num_blocks} engine blocks "
                f"of {block_size} tokens"
            )
        expect_content = layout.head_dim * layout.kv_factor
        if heads != layout.num_kv_heads or content != expect_content:
            raise LayoutError(
                f"KV cache layer has {heads} heads x {content} values per token; the layout expects "
                f"{layout.num_kv_heads} x {expect_content} ({'latent' if layout.mla else 'K|V'})"
            )
        for t in layers:
            if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype:
                raise LayoutError("KV cache layers disagree in shape or dtype")
        if str(first.dtype).removeprefix("torch.") != layout.dtype:
            raise LayoutError(f"KV cache dtype {first.dtype} is not the layout's {layout.dtype}")
        self.layers = list(layers)
        self.layout = layout
        self.block_size = block_size
        self.ratio = kernel_blocks // num_blocks  # kernel blocks per engine block
        self.device = first.device
        self._stream: Any = None
        self._event: Any = None

    # -- indexing -----------------------------------------------------------------------
    def _kernel_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        if self.ratio > 1:  # engine block b = kernel blocks b*ratio .. b*ratio + ratio-1
            ids = (ids[:, None] * self.ratio + torch.arange(self.ratio)[None, :]).reshape(-1)
        return ids.to(self.device)

    def _tokens_view(self, layer: torch.Tensor, kernel_ids: torch.Tensor) -> torch.Tensor:
        """[kernel_blocks, heads, tokens, content] -> [tokens, heads, content] (a copy)."""
        picked = layer.index_select(0, kernel_ids)  # [nb, H, N, C]
        return picked.permute(0, 2, 1, 3).reshape(-1, picked.shape[1], picked.shape[3])  # [nb*N, H, C]

    # -- moving ---------------------------------------------------------------------------
    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy the KV of ``block_ids`` (every layer) into ``out``, a CPU tensor in the
        canonical layout for ``len(block_ids) x block_size`` tokens."""
        tokens = len(block_ids) * self.block_size
        if tuple(out.shape) != self.layout.tensor_shape(tokens):
            raise LayoutError(f"gather into {tuple(out.shape)}, expected {self.layout.tensor_shape(tokens)}")
        kernel_ids = self._kernel_blocks(block_ids)
        with self._on_copy_stream():
            for i, layer in enumerate(self.layers):
                rows = self._tokens_view(layer, kernel_ids)  # [T, H, C]
                if self.layout.mla:
                    out[i].copy_(rows[:, 0, :], non_blocking=True)  # [T, latent]
                else:
                    d = self.layout.head_dim
                    out[i, 0].copy_(rows[..., :d], non_blocking=True)  # K: [T, H, D]
                    out[i, 1].copy_(rows[..., d:], non_blocking=True)  # V: [T, H, D]
        self.synchronize()

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor, layers: Sequence[int] | None = None) -> None:
        """Copy canonical KV ``src`` (for ``len(block_ids) x block_size`` tokens) into the
        engine's blocks, for all layers or the given ones (layer-by-layer loading)."""
        tokens = len(block_ids) * self.block_size
        if tuple(src.shape) != self.layout.tensor_shape(tokens):
            raise LayoutError(f"scatter from {tuple(src.shape)}, expected {self.layout.tensor_shape(tokens)}")
        kernel_ids = self._kernel_blocks(block_ids)
        n, k = len(kernel_ids), tokens // len(kernel_ids)
        with self._on_copy_stream():
            for i in layers if layers is not None else range(len(self.layers)):
                layer = self.layers[i]
                if self.layout.mla:
                    rows = src[i].to(self.device, non_blocking=True).unsqueeze(1)  # [T, 1, latent]
                else:
                    rows = torch.cat([src[i, 0], src[i, 1]], dim=-1).to(self.device, non_blocking=True)  # [T, H, 2D]
                # [T, H, C] -> [nb, N, H, C] -> [nb, H, N, C], written block by block
                blocks = rows.reshape(n, k, rows.shape[1], rows.shape[2]).permute(0, 2, 1, 3)
                layer.index_copy_(0, kernel_ids, blocks)
        self.synchronize()

    # -- CUDA plumbing ----------------------------------------------------------------------
    def _on_copy_stream(self):
        if self.device.type != "cuda":
            return _NullContext()
        if self._stream is None:  # made lazily: no CUDA state before it is needed
            self._stream = torch.cuda.Stream(device=self.device)
            self._event = torch.cuda.Event()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # KV written by compute first
        return torch.cuda.stream(self._stream)

    def synchronize(self) -> None:
        """Wait until the copies issued so far are complete (no-op on CPU)."""
        if self._stream is not None:
            self._event.record(self._stream)
            self._event.synchronize()


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
