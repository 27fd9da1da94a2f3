"""Prefill/decode disaggregation through lmtier's shared tiers: the roles, and the
hand-off a router forwards from the prefill instance to the decode instance.

    role_of(kv_role, config) -> Role        what an instance does; a role its tiers cannot
                                            serve is a ConfigError at start
    Handoff.of(params) -> Handoff | None    the hand-off in a request's kv_transfer_params
    handoff_params(...) -> dict             what a producer's request_finished returns
    forwarded(params) -> bool               whether the router forwards parameters
    named_decoder(params) -> bool           whether it names the decode instance (remote_decoder)

Roles (vLLM's ``kv_role``):

- ``kv_producer`` (the prefill instance) stores every full chunk of each prompt, never
  looks up or loads, and writes every tier before a save counts as done (the shared tier
  included, not only its own memory).
- ``kv_consumer`` (the decode instance) looks up and loads, never stores (``save_decoded``
  lets it store what it computes: a prompt no producer saw, a multi-turn chat's replies).
- ``kv_both``: both, as a colocated engine caches.

A producer or consumer whose tiers are all its own (``cpu://``, ``file://``) could never
meet the other side: that is an error at start.

An answer means the KV is readable, both ways routers work:

- No parameters forwarded (llm-d's shared-storage mode, simple proxies): the producer's
  step that completes a prompt holds its output until that prompt's chunks are written to
  every tier (at most ``handoff_timeout`` seconds), so that a decode instance asked next
  finds them by the prompt alone.
- Parameters forwarded (a request to the producer that carries ``do_remote_decode: true``,
  as vLLM's proxies, Dynamo and llm-d's NIXL modes send): the producer answers at once and
  its ``request_finished`` returns ``{"lmtier": {...}}`` (``handoff_params``), which the
  router passes verbatim to the decode instance. There the lookup answers "ask again next
  step" until the chunks named are readable or the deadline passes, then loads what is
  there; the engine recomputes the rest.

The hand-off only ever decides how long a decode instance waits: the keys it loads come
from its own prompt, so a hand-off of another prompt or model can cost a wait, never KV
of another prompt. One of another model or layout (its namespace differs) or another
prompt (its last key differs) is ignored with a warning.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from lmtier.config.schema import StoreConfig
from lmtier.errors import ConfigError
from lmtier.tiers.base import TierURL

log = logging.getLogger("lmtier.vllm")

ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOCAL_SCHEMES = ("cpu", "file")  # tiers only their own process (or host directory lock) reads
VERSION = 1
# The keys of a hand-off inside kv_transfer_params["lmtier"] (beside the switches "load", "save").
HANDOFF_KEYS = ("v", "namespace", "key", "tokens", "chunk_tokens", "deadline")
RECHECK_S = 0.01  # a waiting hand-off is looked up again at most this often


@dataclass(frozen=True)
class Role:
    name: str
    loads: bool
    saves: bool
    producer: bool  # writes every tier before a save counts, answers only once readable
    shares: bool = True  # has a tier another instance reads (a kv_both's request naming its decoder holds)


def role_of(kv_role: str | None, config: StoreConfig) -> Role:
    role = kv_role or "kv_both"
    if role not in ROLES:
        raise ConfigError(f"lmtier: kv_role must be one of {ROLES}, got {role!r}")
    schemes = [TierURL.parse(url).scheme for url in config.tiers]
    if role != "kv_both" and all(s in LOCAL_SCHEMES for s in schemes):
        raise ConfigError(
            f"lmtier: kv_role {role} needs a tier the other side reads too (redis://, redis+cluster://, "
            f"grpc://, ...), but every tier is this instance's own: {', '.join(schemes)}"
        )
    if role == "kv_producer":
        return Role(role, loads=False, saves=True, producer=True)
    if role == "kv_consumer":
        return Role(role, loads=True, saves=config.save_decoded, producer=False)
    # a peers tier is read-only: what this instance writes, others read from its sidecar (grpc://)
    shares = any(s not in (*LOCAL_SCHEMES, "peers") for s in schemes)
    return Role(role, loads=True, saves=True, producer=False, shares=shares)


def forwarded(params: Any) -> bool:
    """Whether a producer's request comes from a router that forwards parameters to the
    decode instance (it asks for a remote decode, as vLLM's proxies and Dynamo do)."""
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def named_decoder(params: Any) -> bool:
    """Whether a request names the instance that will decode it (``remote_decoder``, as
    llm-d's P2P mode sends its prefill instance): that instance pulls next, so this one,
    even a ``kv_both``, hands off as a producer does (its answer waits for its writes)."""
    return isinstance(params, dict) and isinstance(params.get("remote_decoder"), dict)


def handoff_params(namespace: bytes, key: bytes, tokens: int, chunk_tokens: int, timeout: float) -> dict[str, Any]:
    """A producer's hand-off: what it stored (the namespace of rank 0, the key of its last
    chunk there, the tokens covered, the chunk size) and until when (wall-clock seconds
    since the epoch) a decode instance should wait for it."""
    return {
        "lmtier": {
            "v": VERSION,
            "namespace": namespace.hex(),
            "key": key.hex(),
            "tokens": tokens,
            "chunk_tokens": chunk_tokens,
            "deadline": round(time.time() + timeout, 3),
        }
    }


def source_params(address: str, request_id: str) -> dict[str, Any]:
    """vLLM's ``remote_kv_source``: where the decode instance (or any instance a router
    sends the prompt to) may pull the chunks from, this instance's own sidecar (the
    ``advertise`` address of its ``peers://`` tier). An instance without one stores them in
    a shared tier, and the consumer finds them by the prompt alone."""
    host, _, port = address.rpartition(":")
    return {
        "remote_kv_source": {"remote_host": host.strip("[]"), "remote_port": int(port), "kv_request_id": request_id}
    }


_HOST = re.compile(r"[A-Za-z0-9.\-:]{1,253}")


def remote_source(params: Any) -> str:
    """The peer a router named as the holder of a request's prefix (vLLM's
    ``kv_transfer_params.remote_kv_source``, or ``remote_prefiller`` where a decode instance
    pulls from its prefill instance: ``remote_host``, ``remote_port``), as
    ``host:port``; "" when none is named or it cannot be read (a warning). Whether it may be
    read from is the peers tier's to decide: members only."""
    source = None
    if isinstance(params, dict):  # a peer's (remote_kv_source) or a prefill instance's (remote_prefiller)
        source = params.get("remote_kv_source") or params.get("remote_prefiller")
    if source is None:
        return ""
    host = source.get("remote_host") if isinstance(source, dict) else None
    port = source.get("remote_port") if isinstance(source, dict) else None
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if not (isinstance(host, str) and _HOST.fullmatch(host) and _is_int(port) and 0 < port < 65536):
        log.warning("lmtier: a remote_kv_source that cannot be read (remote_host and remote_port): ignored")
        return ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class Handoff:
    namespace: str
    key: str
    tokens: int
    chunk_tokens: int
    deadline: float  # wall clock

    @classmethod
    def of(cls, params: Any) -> Handoff | None:
        """The hand-off in a request's ``kv_transfer_params``, or None (none there, or one
        this version cannot read: a warning)."""
        mine = params.get("lmtier") if isinstance(params, dict) else None
        if not isinstance(mine, dict) or "key" not in mine:
            return None
        try:
            if mine.get("v") != VERSION:
                raise ValueError(f"version {mine.get('v')!r}, not {VERSION}")
            tokens, chunk_tokens, deadline = mine["tokens"], mine["chunk_tokens"], mine["deadline"]
            if not all(_is_int(x) for x in (tokens, chunk_tokens)) or not _is_number(deadline):
                raise ValueError("tokens and chunk_tokens must be integers, deadline a number")
            if not (0 <= tokens < 2**53 and 0 < chunk_tokens < 2**31) or math.isnan(deadline):
                raise ValueError("tokens, chunk_tokens or deadline out of range")
            return cls(str(mine["namespace"]), str(mine["key"]), tokens, chunk_tokens, float(deadline))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            log.warning("lmtier: a hand-off in kv_transfer_params that cannot be read (%s): ignored", exc)
            return None

    def wait_until(self, timeout: float) -> float:
        """The monotonic time a decode instance waits until: the hand-off's deadline, and
        never longer than its own ``timeout`` from now (clocks of two hosts differ)."""
        left = min(self.deadline - time.time(), timeout)
        return time.monotonic() + max(0.0, left)
