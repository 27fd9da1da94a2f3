"""Engine adapters, importable as ``lmtier.connectors.*``.

    vllm/     the vLLM v1 KV connector (``kv_connector_module_path: lmtier.connectors.vllm``)
    sglang/   SGLang's HiCache storage backend (``lmtier.connectors.sglang.LMTierStorage``)
    announce  the one line each adapter logs at start, here because both say it alike

Each adapter is a thin layer over the engine-neutral core (``lmtier.store``,
``lmtier.kv.keys``, ``lmtier.engine.transfer``): it translates the engine's calls and block
tables, and holds no caching policy of its own.
"""

from __future__ import annotations

import logging

from lmtier.kv.keys import Namespace
from lmtier.tiers.base import redact_url


def announce(engine: str, tiers: tuple[str, ...], namespaces: list[Namespace], model_id: str) -> None:
    """One line at start saying what an adapter chose (tiers with their secrets replaced,
    chunk size, the model id in the keys, the namespace digest of each tensor-parallel
    rank), so that two instances that do not share hits can be compared by reading their
    logs, and a router can ask a cache server's ``Match`` (``lmtier match``) with them.

    Engines configure their own loggers, not lmtier's, so an INFO line would vanish: unless
    the application configured logging itself, the ``lmtier`` logger gets a handler of its
    own (stderr, INFO) the first time."""
    root = logging.getLogger("lmtier")
    if not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
    first = namespaces[0]
    identity = f"; engine identity {first.engine!r} (lmtier keys / match --engine)" if first.engine else ""
    logging.getLogger(f"lmtier.{engine}").info(
        "lmtier: %s connector: tiers %s; chunks of %d tokens (%s keys); model id %r; namespace %s "
        "(by tp rank, of %d)%s",
        engine,
        ", ".join(redact_url(t) for t in tiers),
        first.chunk_tokens,
        first.hash,
        model_id,
        " ".join(ns.digest.hex() for ns in namespaces),
        first.tp_size,
        identity,
    )
