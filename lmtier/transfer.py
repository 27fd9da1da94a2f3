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
    def _kernel_runs(self, block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
        """(first kernel block, count, position in the chunk) for each run of consecutive
        kernel blocks: a run is copied as one strided view, with no index gather."""
        runs: list[tuple[int, int, int]] = []
        for pos, block in enumerate(block_ids):
            first = block * self.ratio  # engine block b = kernel blocks b*ratio .. b*ratio + ratio-1
            where = pos * self.ratio
            if runs and runs[-1][0] + runs[-1][1] == first and runs[-1][2] + runs[-1][1] == where:
                runs[-1] = (runs[-1][0], runs[-1][1] + self.ratio, runs[-1][2])
            else:
                runs.append((first, self.ratio, where))
        return runs

    def _views(self, layer: torch.Tensor, chunk: torch.Tensor, first: int, count: int, where: int):
        """Matching views of ``count`` kernel blocks of ``layer`` and of the chunk's tokens.

        layer[first:first+count]: [count, H, N, C]; as [count, H, N, kv, D] and permuted to
        [kv, count, N, H, D], it lines up with the chunk's [kv, tokens, H, D] (MLA: [tokens,
        latent]) cut into blocks of N tokens.
        """
        blocks = layer[first : first + count]  # [r, H, N, C]
        n = blocks.shape[2]
        if self.layout.mla:
            src = blocks[:, 0]  # [r, N, latent]
            dst = chunk.reshape(-1, n, chunk.shape[-1])[where : where + count]  # [r, N, latent]
            return src, dst
        d = self.layout.head_dim
        src = blocks.unflatten(3, (2, d)).permute(3, 0, 2, 1, 4)  # [kv, r, N, H, D]
        dst = chunk.unflatten(1, (-1, n))[:, where : where + count]  # [kv, r, N, H, D]
        return src, dst

    # -- moving ---------------------------------------------------------------------------
    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy the KV of ``block_ids`` (every layer) into ``out``, a CPU tensor in the
        canonical layout for ``len(block_ids) x block_size`` tokens."""
        tokens = len(block_ids) * self.block_size
        if tuple(out.shape) != self.layout.tensor_shape(tokens):
            raise LayoutError(f"gather into {tuple(out.shape)}, expected {self.layout.tensor_shape(tokens)}")
        runs = self._kernel_runs(block_ids)
        with self._on_copy_stream():
            for i, layer in enumerate(self.layers):
                for first, count, where in runs:
                    src, dst = self._views(layer, out[i], first, count, where)
                    dst.copy_(src, non_blocking=True)
        self.synchronize()

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor, layers: Sequence[int] | None = None) -> None:
        """Copy canonical KV ``src`` (for ``len(block_ids) x block_size`` tokens) into the
        engine's blocks, for all layers or the given ones (layer-by-layer loading)."""
        tokens = len(block_ids) * self.block_size
        if tuple(src.shape) != self.layout.tensor_shape(tokens):
            raise LayoutError(f"scatter from {tuple(src.shape)}, expected {self.layout.tensor_shape(tokens)}")
        runs = self._kernel_runs(block_ids)
        with self._on_copy_stream():
            for i in layers if layers is not None else range(len(self.layers)):
                for first, count, where in runs:
                    engine_view, chunk_view = self._views(self.layers[i], src[i], first, count, where)
                    engine_view.copy_(chunk_view, non_blocking=True)
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
