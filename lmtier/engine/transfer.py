"""``CopyEngine``: KV between an engine's paged cache and canonical chunk buffers.

The only code that knows engine layouts. It reads them from the tensors: each layer is a
logical ``[blocks, kv_heads, block_tokens, content]`` view (vLLM's per-layer view; the
physical order behind it may be any, torch indexes through the strides), where
``content`` is ``K | V`` side by side (``2 x head_dim``) or one MLA latent. The engine's
allocator may cut each of its blocks into several kernel blocks; the ratio is read from
the tensor's block count. Nothing is assumed that the tensors do not confirm: a
mismatch with the expected ``KVLayout`` is an error at registration, not wrong KV later.

    gather(block_ids, out, after=None)     blocks of every layer -> out [layers, kv, tokens, heads, dim]
    gather_many([block_ids], [out], after=None)   several chunks: on CUDA one gather, one wait
    scatter(block_ids, src, layers=None)   the reverse, for all or some layers
    mark() -> event | None                 (CUDA) the compute stream's point a save must wait for
    load_layers([(block_ids, src)]) -> LayerLoad   scatters issued layer by layer (below)

Block ids are the engine's (manager) block ids, in token order; ``block_ids`` must cover
whole blocks, so a chunk is a whole number of blocks (``chunk_tokens`` a multiple of the
block size). On CUDA the blocks are gathered on the device (``IndexCopier``: one
``index_select`` per layer into a contiguous staging buffer) and leave it in one copy to
pinned host memory; loads are the reverse (one copy to the device, one ``index_copy_`` per
layer). Saves and loads each have their own copy stream. A save's stream first waits on
the event ``mark()`` recorded where the engine wrote the KV (on the compute stream, from
the thread that runs the forward pass: a save thread's own current stream is not the
compute stream); the thread that asked waits for its copy, the forward pass never does.
On CPU the copies run in numpy over the same views, with each head's ``head_dim`` values
as one opaque element (``V{bytes}``): the copy is a transpose of 64 - 256 byte pieces,
and numpy moves those as whole items, about twice as fast as torch's element-wise
strided copy. Layers whose content is not
contiguous in memory take the torch path on CPU too.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from lmtier.engine.devicecopy import IndexCopier
from lmtier.engine.layerload import LayerLoad, LoadPlan
from lmtier.errors import LayoutError
from lmtier.kv.layout import KVLayout


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
        self._streams: dict[str, tuple[Any, Any]] = {}  # "save" / "load" -> (stream, event), CUDA
        self._index: IndexCopier | None = None
        if self.device.type == "cuda" and all(t.stride(3) == 1 for t in self.layers):
            self._index = IndexCopier(layers, layout, block_size, num_blocks)
        self._staging: dict[str, torch.Tensor] = {}  # per stream: one device buffer, grown as needed
        self._host_index: IndexCopier | None = None  # a CPU engine's, for load_layers only
        # CPU: each layer as numpy items of one head's values; [kv, blocks, N, H] (MLA: [blocks, N])
        self._items: list[np.ndarray] | None = None
        if self.device.type == "cpu" and all(t.stride(3) == 1 for t in self.layers):
            self._items = [self._item_view(t) for t in self.layers]

    def _item_view(self, layer: torch.Tensor) -> np.ndarray:
        raw = layer.view(torch.uint8).numpy()  # [B, H, N, content bytes], any strides
        if self.layout.mla:
            return raw.view(np.dtype(f"V{raw.shape[3]}"))[:, 0, :, 0]  # [B, N]
        items = raw.view(np.dtype(f"V{raw.shape[3] // 2}"))  # [B, H, N, 2]: K and V of a head
        return items.transpose(3, 0, 2, 1)  # [kv, B, N, H]

    def _chunk_items(self, chunk: torch.Tensor | np.ndarray) -> np.ndarray:
        """Canonical KV on the CPU as items: [layers, kv, blocks, N, H] (MLA: [layers, blocks, N])."""
        n = self.layers[0].shape[2]
        if isinstance(chunk, torch.Tensor):
            raw = chunk.view(torch.uint8).numpy()
            items = raw.view(np.dtype(f"V{raw.shape[-1]}"))[..., 0]  # [L, kv, T, H] (MLA: [L, T])
        else:  # a chunk's bytes, [L, kv, T, row bytes]
            items = chunk.view(np.dtype(f"V{self.layout.head_dim * self.layout.itemsize}"))
            if self.layout.mla:
                items = items[:, 0, :, 0]
        t = 1 if self.layout.mla else 2
        split = items.reshape(*items.shape[:t], items.shape[t] // n, n, *items.shape[t + 1 :])
        if split.size and not np.may_share_memory(split, items):  # reshape copied: a write to it would go nowhere
            raise LayoutError(f"KV of shape {items.shape} cannot be viewed in blocks of {n} tokens")
        return split

    def _item_views(self, i: int, chunk: np.ndarray, first: int, count: int, where: int):
        """Matching item views of layer ``i``: ``count`` kernel blocks from ``first`` in the
        engine, the same blocks from position ``where`` in the chunk (see ``_views``)."""
        if self.layout.mla:
            return self._items[i][first : first + count], chunk[i, where : where + count]
        return self._items[i][:, first : first + count], chunk[i, :, where : where + count]

    def _check_shape(self, what: str, kv: torch.Tensor | np.ndarray, tokens: int) -> None:
        if isinstance(kv, np.ndarray):
            if self._items is None:
                raise LayoutError("KV as bytes is for CPU engines; pass a tensor")
            expected = self.layout.byte_shape(tokens)
            if kv.dtype != np.uint8 or kv.shape != expected:
                raise LayoutError(f"{what} {kv.dtype} {kv.shape}, expected uint8 {expected}")
        elif tuple(kv.shape) != self.layout.tensor_shape(tokens) or kv.dtype != self.layers[0].dtype:
            want = f"{self.layers[0].dtype} {self.layout.tensor_shape(tokens)}"
            raise LayoutError(f"{what} {kv.dtype} {tuple(kv.shape)}, expected {want}")

    def _check_blocks(self, block_ids: Sequence[int], distinct: bool = False) -> None:
        """Block ids within the cache (an index kernel would wrap a negative one onto
        another block), and with ``distinct``, none twice (one ``index_put_`` writes them
        all: which of two writes to one block lands is not defined)."""
        blocks = len(self.layers[0]) // self.ratio
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= blocks):
            raise LayoutError(f"block ids must be in 0..{blocks - 1}; got {min(block_ids)}..{max(block_ids)}")
        if distinct and len(set(block_ids)) != len(block_ids):
            raise LayoutError("a load names a block twice")

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
    def gather(self, block_ids: Sequence[int], out: torch.Tensor | np.ndarray, after: Any = None) -> None:
        """Copy the KV of ``block_ids`` (every layer) into ``out``, a CPU tensor in the
        canonical layout for ``len(block_ids) x block_size`` tokens, or (on a CPU engine)
        its bytes ``[layers, kv, tokens, row bytes]`` as a numpy array. ``after`` (CUDA):
        the event of ``mark()``, required when another thread than the forward pass's asks
        (without it the calling thread's current stream is waited on, not the compute one)."""
        self._check_shape("gather into", out, len(block_ids) * self.block_size)
        self._check_blocks(block_ids)
        if self._index is not None:
            with self._on_copy_stream("save", after):
                staging = self._stage("save", len(block_ids) * self.block_size)
                self._index.gather(block_ids, staging)
                out.view(torch.uint8).view(staging.shape).copy_(staging, non_blocking=True)  # one DMA
            self.synchronize("save")
            return
        runs = self._kernel_runs(block_ids)
        if self._items is not None and _inner_contiguous(out):
            chunk = self._chunk_items(out)
            for i in range(len(self._items)):
                for first, count, where in runs:
                    engine, part = self._item_views(i, chunk, first, count, where)
                    part[...] = engine
            return
        with self._on_copy_stream("save"):
            for i, layer in enumerate(self.layers):
                for first, count, where in runs:
                    src, dst = self._views(layer, out[i], first, count, where)
                    dst.copy_(src, non_blocking=True)
        self.synchronize("save")

    def gather_many(self, block_ids: Sequence[Sequence[int]], outs: Sequence[torch.Tensor], after: Any = None) -> None:
        """``gather`` of several chunks (one block list and one host tensor each, all of one
        size). On CUDA: one ``index_select`` per layer for all of them, one copy out per
        chunk, one wait at the end."""
        if self._index is None or len(outs) < 2:
            for ids, out in zip(block_ids, outs, strict=True):
                self.gather(ids, out, after)
            return
        tokens = len(block_ids[0]) * self.block_size
        for ids, out in zip(block_ids, outs, strict=True):
            if len(ids) * self.block_size != tokens:
                raise LayoutError("gather_many takes chunks of one size")
            self._check_shape("gather into", out, tokens)
            self._check_blocks(ids)
        with self._on_copy_stream("save", after):
            staging = self._stage("save", tokens, len(outs))
            self._index.gather_batch([b for ids in block_ids for b in ids], staging, len(outs))
            for out, part in zip(outs, staging, strict=True):
                out.view(torch.uint8).view(part.shape).copy_(part, non_blocking=True)
        self.synchronize("save")

    def scatter(
        self,
        block_ids: Sequence[int],
        src: torch.Tensor | np.ndarray,
        layers: Sequence[int] | None = None,
        *,
        before_layer: Callable[[int], None] | None = None,
    ) -> None:
        """Copy canonical KV ``src`` (for ``len(block_ids) x block_size`` tokens; a tensor,
        or on a CPU engine its bytes as in ``gather``) into the engine's blocks, for all
        layers or the given ones (layer-by-layer loading). ``before_layer(i)`` is called
        before layer ``i`` is copied (a ``Chunk.layer_check`` verifies it there)."""
        self._check_shape("scatter from", src, len(block_ids) * self.block_size)
        self._check_blocks(block_ids, distinct=True)
        which = layers if layers is not None else range(len(self.layers))
        if self._index is not None:
            with self._on_copy_stream("load"):
                staging = self._stage("load", len(block_ids) * self.block_size)
                staging.copy_(src.view(torch.uint8).reshape(staging.shape), non_blocking=True)  # one DMA
                kernel = self._index.kernel_index(block_ids)  # once, not once per layer
                for i in which:
                    if before_layer is not None:
                        before_layer(i)
                    self._index.scatter(kernel, staging, layers=[i])
            self.synchronize("load")
            return
        runs = self._kernel_runs(block_ids)
        if self._items is not None and _inner_contiguous(src):
            chunk = self._chunk_items(src)
            for i in which:
                if before_layer is not None:
                    before_layer(i)
                for first, count, where in runs:
                    engine, part = self._item_views(i, chunk, first, count, where)
                    engine[...] = part
            return
        with self._on_copy_stream("load"):
            for i in which:
                if before_layer is not None:
                    before_layer(i)
                for first, count, where in runs:
                    engine_view, chunk_view = self._views(self.layers[i], src[i], first, count, where)
                    engine_view.copy_(chunk_view, non_blocking=True)
        self.synchronize("load")

    def load_layers(self, items: Sequence[tuple[Sequence[int], torch.Tensor]]) -> LayerLoad:
        """Copy each item's canonical KV (a host tensor for ``len(block_ids)`` blocks; a
        token slice of a chunk is fine) into its blocks, layer by layer: every item's layer
        0, then every item's layer 1, and so on (``lmtier.engine.layerload.LoadPlan`` says how). On CUDA the
        copies go on the load stream, with an event after each layer, and are issued
        ``LOAD_AHEAD`` layers ahead of the one the forward pass waits for
        (``LayerLoad.wait(i)`` issues up to ``i + LOAD_AHEAD``, then makes the current,
        compute, stream wait for layer ``i``): the host's work of issuing them runs beside
        the forward pass instead of before it. The host tensors must stay as they are until
        ``LayerLoad.finish()``. Elsewhere the copies are done when this returns."""
        if self._index is None and self._host_index is None:  # a CPU engine with layer_loads
            self._host_index = IndexCopier(self.layers, self.layout, self.block_size, len(self.layers[0]) // self.ratio)
        index = self._index or self._host_index
        assert index is not None
        for block_ids, src in items:
            self._check_shape("load from", src, len(block_ids) * self.block_size)
        self._check_blocks([b for ids, _ in items for b in ids], distinct=True)
        with self._on_copy_stream("load"):
            plan = LoadPlan(index, self.layout, self.block_size, items)
        stream = self._streams["load"][0] if self.device.type == "cuda" else None
        return LayerLoad(lambda i: plan.issue(i, stream), len(self.layers), [plan], lazy=stream is not None,
                         device=self.device)  # fmt: skip

    # -- CUDA plumbing ----------------------------------------------------------------------
    def mark(self) -> Any:
        """(CUDA) An event recorded now on the calling thread's current stream: call it from
        the thread that ran the forward pass, and hand it to ``gather(after=)`` on another.
        None on CPU."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _stage(self, role: str, tokens: int, chunks: int = 1) -> torch.Tensor:
        """The role's device staging buffer, for ``chunks`` chunks of ``tokens`` tokens
        (reused; one per role, so a save and a load never share one)."""
        assert self._index is not None
        shape = self._index.staging_shape(tokens, chunks)
        size = math.prod(shape)
        have = self._staging.get(role)
        if have is None or have.numel() < size:
            self._staging.pop(role, None)  # the old one goes first: peak is the new size alone
            have = self._staging[role] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return have[:size].view(shape)

    def _on_copy_stream(self, role: str, after: Any = None):
        if self.device.type != "cuda":
            return _NullContext()
        if role not in self._streams:  # made lazily: no CUDA state before it is needed
            self._streams[role] = (torch.cuda.Stream(device=self.device), torch.cuda.Event())
        stream = self._streams[role][0]
        if after is not None:
            stream.wait_event(after)  # the KV the forward pass wrote, before this copy reads it
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)

    def synchronize(self, role: str | None = None) -> None:
        """Wait until the copies issued so far (by ``role``, or all) are complete (no-op on CPU)."""
        for name, (stream, event) in list(self._streams.items()):
            if role is None or name == role:
                event.record(stream)
                event.synchronize()


class HostBuffers:
    """Host buffers, one chunk each, for KV on its way from the engine to the store:
    reused (fresh memory costs page faults, and pinning costs a system call, on the
    critical path), pinned for a GPU engine, and bounded: at most ``max_bytes`` (at least
    two buffers); ``acquire`` returns None beyond that, never blocks."""

    def __init__(self, layout: KVLayout, chunk_tokens: int, pinned: bool, max_bytes: int) -> None:
        self.shape = layout.tensor_shape(chunk_tokens)
        self.dtype = getattr(torch, layout.dtype)
        self.pinned = pinned
        self.limit = max(2, max_bytes // layout.chunk_bytes(chunk_tokens))
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._lock = threading.Lock()

    def acquire(self) -> torch.Tensor | None:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._made >= self.limit:
                return None
            self._made += 1
        return torch.empty(self.shape, dtype=self.dtype, pin_memory=self.pinned)

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)

    @property
    def made(self) -> int:
        return self._made


def _inner_contiguous(kv: torch.Tensor | np.ndarray) -> bool:
    if isinstance(kv, np.ndarray):
        return kv.strides[-1] == kv.itemsize
    return kv.stride(-1) == 1


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
