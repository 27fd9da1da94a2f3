"""Synthetic paged KV caches laid out as vLLM lays them out, on any device, without vLLM
(the GPU machine that runs ``make gpu-check`` has no vLLM; CPU CI checks these strides
against vLLM's own ``compute_layout_strides``).

vLLM (0.32, ``vllm.v1.kv_cache_layout.KVCacheLayout``) views every attention layer as a
logical ``[B, H, N, C]`` (kernel blocks, KV heads, tokens per kernel block, content bytes:
``K | V`` side by side, or an MLA latent) over one allocation of logical shape
``[L, B, H, N, C]`` whose memory follows one of six axis orders; the last three hold every
layer of a block together (the cross-layer layouts).

    ORDERS                          name -> physical order of the logical axes L, B, H, N, C
    paged_layers(order, ...)        (per-layer views in ``dtype``, the raw byte buffer)
"""

from __future__ import annotations

import torch

ORDERS: dict[str, tuple[int, int, int, int, int]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def strides(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Byte strides, in logical axis order, of a dense buffer stored in ``order``."""
    out = [0] * len(shape)
    step = 1
    for axis in reversed(order):
        out[axis] = step
        step *= shape[axis]
    return tuple(out)


def paged_layers(
    order: str,
    *,
    layers: int,
    blocks: int,
    heads: int,
    tokens: int,
    content: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``layers`` views ``[blocks, heads, tokens, content]`` in ``dtype`` (``content`` in
    elements) over one random buffer in ``order``. Floating bytes are kept small (no NaN
    or infinity patterns), so that equal bytes compare equal as values too."""
    row = content * dtype.itemsize
    shape = (layers, blocks, heads, tokens, row)
    size = layers * blocks * heads * tokens * row
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
    if dtype.is_floating_point and dtype.itemsize > 1:
        raw &= 0x3F
    raw = raw.to(device)
    full = torch.as_strided(raw, shape, strides(shape, ORDERS[order]))
    return [full[i].view(dtype) for i in range(layers)], raw
