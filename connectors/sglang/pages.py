"""How an SGLang host pool's pages map onto lmtier's canonical chunk: each page is one
chunk of ``page_size`` tokens in the canonical layout (``[layers, K/V, tokens, kv_heads,
head_dim]``, MLA ``[layers, tokens, latent]``), whatever the host layout (layer-first,
page-first, page-first-direct, page-head), so a page written from one reads back into any
other. ``page_unified`` is not addressable page by page and is refused.

    PageShape     one page of a host layout: its block shape and the permutation to canonical
    page_shape    the canonical layout of a pool's pages, and its PageShape
    byte_view     a canonical page as the chunk's byte view, sharing memory when it can
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmtier.errors import LayoutError
from lmtier.kv.layout import KVLayout, canonical_dtype


@dataclass(frozen=True)
class PageShape:
    """How one page of a host pool maps onto the canonical chunk.

    ``block``: the shape of ``get_data_page(i, flat=False)`` (and of a flat page
    reshaped); ``squeeze``: that block with its size-1 page axes removed; ``perm``: the
    permutation that turns the squeezed block into canonical order.
    """

    block: tuple[int, ...]
    squeeze: tuple[int, ...]
    perm: tuple[int, ...]

    def canonical(self, block: torch.Tensor) -> torch.Tensor:
        return block.reshape(self.squeeze).permute(self.perm)


def page_shape(pool: Any) -> tuple[KVLayout, PageShape]:
    """The canonical layout of one rank's pages, and how ``pool``'s layout holds them."""
    layout_name = getattr(pool, "layout", None)
    P, L = int(pool.page_size), int(pool.layer_num)
    dtype = canonical_dtype(pool.dtype)
    if hasattr(pool, "kv_cache_dim"):  # MLA: [layers, tokens, latent]
        C = int(pool.kv_cache_dim)
        shapes = {
            "layer_first": ((L, P, 1, C), (L, P, C), (0, 1, 2)),
            "page_first": ((P, L, 1, C), (P, L, C), (1, 0, 2)),
            "page_first_direct": ((1, L, P, 1, C), (L, P, C), (0, 1, 2)),
        }
        layout = KVLayout(L, 1, C, dtype, mla=True)
    else:  # MHA / GQA: [layers, 2, tokens, heads, head_dim]
        H, D = int(pool.head_num), int(pool.head_dim)
        if int(getattr(pool, "v_head_dim", D)) != D:
            raise LayoutError(f"lmtier stores K and V of one width; this model has K {D} and V {pool.v_head_dim}")
        shapes = {
            "layer_first": ((2, L, P, H, D), (2, L, P, H, D), (1, 0, 2, 3, 4)),
            "page_first": ((2, P, L, H, D), (2, P, L, H, D), (2, 0, 1, 3, 4)),
            "page_first_direct": ((2, 1, L, P, H, D), (2, L, P, H, D), (1, 0, 2, 3, 4)),
            "page_head": ((2, 1, H, P, L, D), (2, H, P, L, D), (3, 0, 2, 1, 4)),
        }
        layout = KVLayout(L, H, D, dtype)
    if layout_name not in shapes:
        raise LayoutError(
            f"lmtier cannot address SGLang's {layout_name!r} host layout page by page; "
            f"use --hicache-mem-layout with one of {', '.join(shapes)}"
        )
    return layout, PageShape(*shapes[layout_name])


def byte_view(canonical: torch.Tensor, layout: KVLayout) -> np.ndarray | None:
    """The canonical tensor as the chunk's 4-d byte view ``[layers, kv, tokens, row]``,
    sharing memory; None when its strides cannot express that (heads not adjacent)."""
    raw = canonical.view(torch.uint8)  # last axis contiguous in every host layout
    if layout.mla:
        raw = raw.unsqueeze(1)
    try:
        raw = raw.view(layout.byte_shape(raw.shape[2]))
    except RuntimeError:
        return None
    return raw.numpy()
