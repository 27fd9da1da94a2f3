"""``LMTierStorage``: lmtier as the L3 storage backend of SGLang's hierarchical cache.

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "lmtier",
            "module_path": "lmtier.connectors.sglang", "class_name": "LMTierStorage",
            "interface_v1": 1,
            "tiers": ["file:///var/lib/lmtier?size=100GiB", "redis://cache:6379"]}'

``"interface_v1": 1`` matters: without it SGLang calls the legacy ``batch_get`` /
``batch_set`` with a flat copy of every page (one more copy each way); with it SGLang calls
``batch_get_v1`` / ``batch_set_v1``, and lmtier copies straight between its tiers and
SGLang's host pool. Both work.

Extra-config keys of lmtier's own (all optional): ``tiers``, ``hash``, ``salt`` (tenant:
stores with different salts never share), ``write_queue``, ``write_mode``, ``save_policy``
(not ``min_tokens``, refused: SGLang's storage calls carry pages, not prompts),
``metrics_port`` (Prometheus ``/metrics``, TP rank r on ``port + r``),
``load_deadline`` (seconds a batch_get may take; the rest is recomputed), ``config`` (a
config file), ``model_id`` (the model's name in the namespace; default: SGLang's model
name). Unset keys come from ``LMTIER_*`` environment variables, then lmtier's defaults.
SGLang's own keys (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``)
are ignored; any other key is an error at start.

What is stored: each SGLang page as one lmtier chunk of ``page_size`` tokens in the
canonical layout (``[layers, K/V, tokens, kv_heads, head_dim]``, MLA ``[layers, tokens,
latent]``), so a page written from one host layout (layer-first, page-first,
page-first-direct, page-head) reads back into any other. Keys: SGLang addresses pages by
its own chained page hashes and never hands a backend token ids, so a page's key is
``H(namespace || SGLang's page hash)`` (``lmtier.kv.keys.named_keys``), where the namespace
holds the model, the layout, the page size, the tensor-parallel rank and size (MHA: each
rank stores its slice of the KV heads; MLA: one latent replicated on every rank, so rank 0
writes and every rank reads), the pipeline stage and the salt.

SGLang and vLLM instances of the same model do not share chunks: the bytes would be the
same canonical chunks, but vLLM's keys hash token ids, and SGLang gives a backend only its
page hashes (sha256 over its own token encoding and namespace seed), from which no token
key can be computed. Two SGLang instances of the same model, page size and parallel
layout share everything, through any tier.

Failures are misses: a missing, damaged (checksum) or mislaid (wrong layout) chunk, a dead
tier or a bad argument make the call report ``False`` / ``None`` / a shorter hit, logged
and counted, and SGLang recomputes. Nothing raises into SGLang's cache controller once the
backend is attached; a configuration it cannot serve (an unknown key, the
``page_unified`` host layout, which is not addressable page by page) is refused at attach
with a clear error.

    storage   LMTierStorage: what HiCache calls (v1 and legacy), the store, the counters
    pages     how each host layout's pages map onto the canonical chunk
"""

from lmtier._moved import forward
from lmtier.connectors.sglang.storage import LMTierStorage

__all__ = ["LMTierStorage"]

__getattr__ = forward(__name__)  # names of the previous release, found where they live now (CHANGELOG.md)
