"""Hybrid models in vLLM: the KV cache groups of its hybrid KV cache manager, which of them
lmtier stores, their layouts, and what a hit needs of each.

    groups_of(kv_cache_config, layout) -> list[Group]    one per group; [] for a model with one
    Group.first_needed(tokens, block_size)                what a hit of ``tokens`` must restore

vLLM gives a model whose layers attend differently (full attention beside sliding-window
layers) one group of layers per kind, each with its own block table. lmtier keeps one
chain of chunks per group, under the group's own namespace (its kind and layers are in
the digest), and restores a hit group by group:

- **Full attention** (``FullAttentionSpec``, MLA included) keeps every token's KV: a hit
  of ``L`` tokens loads all of the group's chunks up to ``L``.
- **Sliding window** (``SlidingWindowSpec``) holds only the last ``window`` tokens: the next
  token attends to ``[L - window + 1, L)``, and vLLM allocates no block before that (its
  null block stands in). A hit needs only the chunks under that window, and a chunk is
  stored only while the group's blocks still hold it (a block vLLM has already let go of
  is never read).
- Any other kind (Mamba or linear-attention state, chunked local attention,
  cross-attention) is refused when the engine starts, with a ``ConfigError``: its state
  is not per-token KV that chunks hold. Run such a model with
  ``--disable-hybrid-kv-cache-manager`` or without lmtier.

A model with a single group (any model without sliding-window layers, and every model
when vLLM's hybrid manager is off) keeps the keys it always had: groups are named in the
namespace only when there are several.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from lmtier.errors import ConfigError
from lmtier.kv.layout import KVLayout


@dataclass(frozen=True)
class Group:
    index: int  # vLLM's group index (its block table in the scheduler's block ids)
    layers: tuple[str, ...]  # attention layer names, in layer order
    layout: KVLayout  # the KV of this group's layers (one tensor-parallel rank)
    window: int = 0  # sliding window in tokens; 0: full attention
    name: str = ""  # in the namespace: kind and layer indices

    def first_needed(self, tokens: int, block_size: int) -> int:
        """The first token position whose KV a hit of ``tokens`` tokens must restore in
        this group (block-aligned, as vLLM allocates): 0 for full attention."""
        if not self.window:
            return 0
        skipped = max(0, tokens - self.window + 1)
        return skipped // block_size * block_size


def layer_index(name: str) -> int:
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(numbers[0]) if numbers else 0


def groups_of(kv_cache_config: Any, layout: KVLayout) -> list[Group]:
    """The groups of a hybrid model's cache (``layout``: the model's, one rank's, every
    layer); an empty list for a model with a single group (its chunks hold every layer)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) <= 1:
        return []
    out = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec) and type(spec).__name__ == "SlidingWindowSpec":
            window = int(spec.sliding_window)
        elif isinstance(spec, FullAttentionSpec) and type(spec).__name__ in ("FullAttentionSpec", "MLAAttentionSpec"):
            window = 0
        else:
            raise ConfigError(
                f"lmtier stores attention KV; KV cache group {index} of this model is {type(spec).__name__} "
                "(state that chunks cannot hold): run it with --disable-hybrid-kv-cache-manager, or without lmtier"
            )
        if not getattr(group, "enable_kv_transfer", True):
            raise ConfigError(f"KV cache group {index} takes no part in KV transfer; lmtier cannot restore it")
        if spec.head_size != layout.head_dim or (not layout.mla and spec.num_kv_heads != layout.num_kv_heads):
            raise ConfigError(
                f"KV cache group {index} has {spec.num_kv_heads} KV heads of {spec.head_size}; lmtier's layout for "
                f"this model has {layout.num_kv_heads} of {layout.head_dim} (layers of different shapes)"
            )
        layers = tuple(sorted(group.layer_names, key=layer_index))
        kind = f"sliding={window}" if window else "full"
        name = f"{kind}:{','.join(str(layer_index(n)) for n in layers)}"
        out.append(Group(index, layers, replace(layout, num_layers=len(layers)), window, name))
    return out
