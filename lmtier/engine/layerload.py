"""Layer-by-layer loads on the device: how ``CopyEngine.load_layers`` moves a step's
chunks into the paged cache one group of layers at a time (``LoadPlan``), and the handle
the forward pass waits on (``LayerLoad``: each attention layer waits for its own layer's
copies, issued a few layers ahead of it)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmtier.engine.devicecopy import IndexCopier
from lmtier.kv.layout import KVLayout


class LoadPlan:
    """A layer-by-layer load as the device sees it. One device buffer (the stage, about
    ``LOAD_STAGE_BYTES`` unless one item's layer is larger) holds, for a group of layers,
    each item's bytes side by side, laid out as in its host tensor: an item's layers
    ``a:b`` are then one run of host memory, so a group costs one copy in per item, and
    one ``index_put_`` per layer for each run of items of one shape. A token slice of a
    chunk (a partial hit) is copied with the other tokens between its rows when they are
    at most as many as its own (one copy of up to twice the bytes beats one per layer and
    K or V: the copies cost the host more than the bus), else a layer and K or V at a time.
    The groups grow 1, 1, 2, 4, ... layers up to what the stage holds, so that the first
    layer lands soon and the host issues few copies. A load whose one layer is larger than
    the stage goes a layer at a time, in groups of items that fit."""

    def __init__(self, index: IndexCopier, layout: KVLayout, block_size: int,
                 items: Sequence[tuple[Sequence[int], torch.Tensor]]) -> None:  # fmt: skip
        self.index, kv, row = index, layout.kv_factor, index.row
        hr = layout.num_kv_heads * row  # bytes of one token's heads
        self.kv, self.hr = kv, hr
        # per item: host bytes [L, kv, T, H, row], its strides on the device (layer, K/V,
        # token) and whether one copy moves a group of its layers (else one per layer and K/V)
        self.hosts: list[torch.Tensor] = []
        shapes: list[tuple[int, int, int, int, bool]] = []  # tokens, dL, dK, dT, one copy
        for _, src in items:
            host = (src if src.stride(-1) == 1 else src.contiguous()).view(torch.uint8)
            host = host.unsqueeze(1).unsqueeze(3) if layout.mla else host
            if host.stride(4) != 1 or (layout.num_kv_heads > 1 and host.stride(3) != row) or host.stride(2) != hr:
                host = host.contiguous()  # not a chunk's tensor nor a token slice of one
            tokens, needed = host.shape[2], kv * host.shape[2] * hr
            whole = (
                host.stride(0) <= 2 * needed
                and host.stride(0) >= (kv - 1) * host.stride(1) + tokens * hr
                and host.stride(0) % row == 0  # the stage's views of it line up as the kernels' units
                and (kv == 1 or host.stride(1) % row == 0)
            )
            strides = (host.stride(0), host.stride(1), hr) if whole else (needed, tokens * hr, hr)
            self.hosts.append(host)
            shapes.append((tokens, *strides, whole))
        self.shapes = shapes
        # item groups (one unless a layer of all items is more than the stage), each as runs
        # of items of one shape: (first item, count, their index for scatter_items)
        self.item_groups: list[list[tuple[int, int, tuple[torch.Tensor, torch.Tensor]]]] = []
        first = 0
        while first < len(items):
            end, used = first + 1, self._region(shapes[first], 1)
            while end < len(items) and used + self._region(shapes[end], 1) <= LOAD_STAGE_BYTES:
                used, end = used + self._region(shapes[end], 1), end + 1
            runs, at = [], first
            while at < end:
                stop = at + 1
                while stop < end and shapes[stop] == shapes[at]:
                    stop += 1
                kernel = index.kernel_index([b for ids, _ in items[at:stop] for b in ids])
                runs.append((at, stop - at, index.item_index(kernel.view(stop - at, -1))))
                at = stop
            self.item_groups.append(runs)
            first = end
        per_layer = max((sum(c * self._region(shapes[f], 1) for f, c, _ in g) for g in self.item_groups),
                        default=0)  # fmt: skip
        layers = layout.num_layers
        span = max(1, LOAD_STAGE_BYTES // max(1, per_layer)) if len(self.item_groups) == 1 else 1
        self.groups: dict[int, int] = {}  # first layer -> end of its group
        a = 0
        while a < layers:
            self.groups[a] = min(layers, a + min(span, max(1, a)))
            a = self.groups[a]
        widest = max((b - a for a, b in self.groups.items()), default=1)
        size = max((sum(c * self._region(shapes[f], widest) for f, c, _ in g) for g in self.item_groups), default=0)
        self.stage = torch.empty(size, dtype=torch.uint8, device=index.device)
        self.events: dict[int, Any] = {}

    def _region(self, shape: tuple[int, int, int, int, bool], width: int) -> int:
        """Stage bytes of an item's ``width`` layers: what one copy moves, rounded up."""
        return -(-self._extent(shape, width) // 256) * 256

    def _extent(self, shape: tuple[int, int, int, int, bool], width: int) -> int:
        tokens, d_layer, d_kv, d_token, _ = shape
        return (width - 1) * d_layer + (self.kv - 1) * d_kv + (tokens - 1) * d_token + self.hr

    def issue(self, layer: int, stream: Any) -> Any:
        """Issue the group starting at ``layer`` (called for every layer in order), and
        return the event after ``layer``'s copies (None off CUDA)."""
        end = self.groups.get(layer)
        if end is not None:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self._issue(layer, end, stream)
        return self.events.pop(layer, None)

    def _issue(self, a: int, b: int, stream: Any) -> None:
        width, stage = b - a, self.stage
        for n, runs in enumerate(self.item_groups):  # the stage is reused: one stream orders it
            scatters, at = [], 0
            for first, count, index in runs:
                shape = self.shapes[first]
                tokens, d_layer, d_kv, d_token, whole = shape
                region = self._region(shape, width)
                for m in range(count):
                    host, place = self.hosts[first + m], at + m * region
                    if whole:  # layers a:b and what lies between their rows, as one run of memory
                        length = self._extent(shape, width)
                        src = host.as_strided((length,), (1,), host.storage_offset() + a * host.stride(0))
                        stage[place : place + length].copy_(src, non_blocking=True)
                        continue
                    for j in range(width):  # each layer's K and V of a token slice is contiguous
                        for k in range(self.kv):
                            to = place + j * d_layer + k * d_kv
                            stage[to : to + tokens * self.hr].copy_(host[a + j, k].reshape(-1), non_blocking=True)
                for j in range(width):
                    values = stage.as_strided((count, self.kv, tokens, self.hr), (region, d_kv, d_token, 1),
                                              stage.storage_offset() + at + j * d_layer)  # fmt: skip
                    scatters.append((j, index, values))
                at += count * region
            last = n == len(self.item_groups) - 1
            for j in range(width):
                for jj, index, values in scatters:
                    if jj == j:
                        self.index.scatter_items(index, a + j, values)
                if last and stream is not None:
                    event = self.events[a + j] = torch.cuda.Event()
                    event.record(stream)


LOAD_AHEAD = 2  # layers of a load issued ahead of the one the forward pass waits for
LOAD_STAGE_BYTES = 128 << 20  # a layer-by-layer load's device buffer: one layer of this many bytes of KV at a time


class LayerLoad:
    """The layers of a ``CopyEngine.load_layers`` call, as they land: on CUDA issued a few
    layers ahead of the forward pass (``issue(i)`` returns the event after layer ``i``'s
    copies); elsewhere every layer is issued, and landed, at once."""

    def __init__(
        self, issue: Callable[[int], Any], layers: int, keep: list[Any], lazy: bool, device: Any = None
    ) -> None:
        self._issue: Callable[[int], Any] | None = issue
        self._device = device
        self._layers = layers
        self._events: list[Any] = []
        self._keep = keep  # staging buffer, index and host tensors, alive until the copies are done
        self._lazy = lazy
        self._issued_to(LOAD_AHEAD - 1 if lazy else layers - 1)

    def _issued_to(self, layer: int) -> None:
        while len(self._events) <= min(layer, self._layers - 1):
            assert self._issue is not None, "a finished load issues nothing more"
            self._events.append(self._issue(len(self._events)))

    def wait(self, layer: int) -> None:
        """Make the current stream wait for ``layer`` (a stream wait: the host goes on),
        issuing the layers up to ``layer + LOAD_AHEAD`` first."""
        if not 0 <= layer < self._layers:
            raise IndexError(f"layer {layer} of a load of {self._layers} layers")
        self._issued_to(layer + max(0, LOAD_AHEAD))
        event = self._events[layer]
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)

    def done(self) -> bool:
        """Every layer issued and landed."""
        if len(self._events) < self._layers:
            return False
        return not self._events or self._events[-1] is None or bool(self._events[-1].query())

    def finish(self) -> None:
        """Issue what is left, wait for the last copy; the host tensors may be reused after it."""
        if self._issue is not None:
            self._issued_to(self._layers - 1)
        if self._events and self._events[-1] is not None:
            self._events[-1].synchronize()
        self._keep, self._issue = [], None  # the plan (device buffer, host tensors) goes with it
