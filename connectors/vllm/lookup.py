"""The scheduler half's lookups (vLLM's engine-core process): how much of a prompt lmtier
can load, and a decode instance's wait for a producer's hand-off.

- ``get_num_new_matched_tokens`` looks up the prompt's chunk keys *for every
  tensor-parallel rank* (each rank stores its slice of the KV heads under its own
  namespace) and counts the chunks all ranks have: what the workers can actually load.
  Only full chunks; a whole-prompt hit leaves the last token to the engine. A decode
  instance given a producer's hand-off (``connectors/vllm/pd.py``) answers "ask again"
  until the chunks it names are readable or its deadline has passed.
- ``_Request`` is one request's scheduler-side state, made at its first lookup (with its
  own switches from ``kv_transfer_params``) and read by the plans and the release
  (``connectors/vllm/scheduler.py``).

    _Request                       one request's state, until it finishes
    Lookups                        the lookups, mixed into the connector (via SchedulerSide)
    HANDOFF_LOOKS_PER_STEP         hand-off lookups per scheduler step at most
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from lmtier import metrics
from lmtier.connectors.vllm.pd import (
    HANDOFF_KEYS,
    LOCAL_SCHEMES,
    RECHECK_S,
    Handoff,
    forwarded,
    named_decoder,
    remote_source,
)
from lmtier.connectors.vllm.stats import hit_sources
from lmtier.kv.keys import chunk_keys

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("lmtier.vllm")
ENGINE = "vllm"  # the engine label of lmtier_engine_tokens_total
WINDOW_TRIES = 8  # shorter prefixes tried when a sliding-window lane lacks a hit's window
# waiting hand-offs looked up per scheduler step at most (each is a lookup in the shared
# tier: a crowd of them must not make every step wait on the network)
HANDOFF_LOOKS_PER_STEP = 8


@dataclass
class _Request:
    """Scheduler-side state of one request (dropped when it finishes)."""

    request: Any
    hit_chunks: int = 0  # leading chunks every rank holds (at the last lookup)
    sources: list[tuple[str, int]] = field(default_factory=list)  # (tier scheme, chunks): rank 0's hit
    local_tokens: int = 0  # the engine's own prefix-cache hit
    external_tokens: int = 0  # tokens planned to load
    load_pending: bool = False
    block_ids: list[int] = field(default_factory=list)  # a model with one lane (hybrid: the cache manager's)
    saved: list[int] = field(default_factory=list)  # per lane: leading chunks known stored (hit or saved)
    plans: int = 0  # save plans sent (the workers copy its blocks after the step)
    copied: int = 0  # ... and reported copied by the workers (each worker's report counts)
    keys: list[list[list[bytes]]] = field(default_factory=list)  # [lane][rank][chunk], grown as tokens grow
    sighted: int = 0  # chunks its first lookup found, for the workers' save policy (reuse)
    load: bool = True  # per request: kv_transfer_params {"lmtier": {"load": false}}
    save: bool = True  # ... {"lmtier": {"save": false}}
    counted: bool = False  # its prompt counted in the metrics (at its first answered lookup)
    hold: bool = False  # a producer's, no parameters forwarded: its last prompt step waits for its writes
    handoff: Handoff | None = None  # a decode instance's: what a producer stored, to wait for
    wait_until: float = 0.0  # ... until then (monotonic)
    next_look: float = 0.0  # ... looked up again from then
    namespaces: list = field(default_factory=list)  # [lane][rank]: the instance's, or salted (cache_salt)
    source: str = ""  # a peer a router named as the holder of its prefix (remote_kv_source): host:port
    forwarded: bool = False  # its router forwards this instance's parameters to a decode instance
    hands_off: bool = False  # a producer's, or one naming its decode instance: written to every tier


_SWITCHES = ("load", "save")


def _request_options(request: Any) -> dict[str, bool]:
    """A request's own switches, from its ``kv_transfer_params``:
    ``{"lmtier": {"load": false, "save": false}}`` (both default to true).

    A request is never refused for them, but a typo must not store a private document:
    when the ``lmtier`` entry is not a map, has keys other than these two (and a producer's
    hand-off, ``connectors/vllm/pd.py``), or switches that are not booleans, the request's
    KV is not saved (the safe side), with a warning."""
    params = getattr(request, "kv_transfer_params", None) or {}
    mine = params.get("lmtier") if isinstance(params, dict) else None
    if mine is None:
        return {}
    if not isinstance(mine, dict):
        log.warning("lmtier: kv_transfer_params['lmtier'] is %r, not a map: this request's KV is not saved", mine)
        return {"save": False}
    options = {k: mine[k] for k in _SWITCHES if isinstance(mine.get(k), bool)}
    wrong = sorted(
        str(k) for k in mine if k not in HANDOFF_KEYS and (k not in _SWITCHES or not isinstance(mine[k], bool))
    )
    if wrong:
        log.warning(
            "lmtier: kv_transfer_params['lmtier'] has unknown keys or values that are not booleans (%s; known: "
            "'load', 'save', and a hand-off's): this request's KV is not saved",
            ", ".join(wrong),
        )
        options["save"] = False
    return options


class Lookups:
    """Mixed into ``LMTierConnector`` (through ``SchedulerSide``); its state is made in the
    connector's ``__init__``. Reads ``chunk_tokens``, ``block_size``, ``lanes``,
    ``lane_namespaces``, ``store``, ``kv_role``, ``config``, ``_request_log`` and vLLM's
    ``_kv_cache_manager`` (hybrid models); keeps ``_requests`` (request id -> ``_Request``) and, per step,
    ``_napped`` and ``_handoff_looks`` (reset by ``build_connector_meta``)."""

    def _keys_for(self, state: _Request, num_tokens: int, lane: int = 0) -> list[list[bytes]]:
        """Keys of every full chunk of the request's first ``num_tokens`` tokens in one
        lane, per rank."""
        chunks = num_tokens // self.chunk_tokens
        if not state.keys or len(state.keys[0][0]) < chunks:
            tokens = np.asarray(state.request.all_token_ids[: chunks * self.chunk_tokens], dtype=np.int64)
            state.keys = [[chunk_keys(tokens, ns) for ns in lane_ns] for lane_ns in state.namespaces]
        return [k[:chunks] for k in state.keys[lane]]

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._requests.get(request.request_id)
        if state is None:
            try:
                state = self._new_request(request)
            except Exception:  # never break the scheduler: the request is served as if lmtier were off
                log.exception("lmtier: %s: its kv_transfer_params could not be read", request.request_id)
                state = _Request(request, load=False, save=False, saved=[0] * len(self.lanes))
                state.namespaces = self.lane_namespaces
            self._requests[request.request_id] = state
        prompt_len = len(request.prompt_token_ids or [])
        # Whole blocks only, and never the whole prompt: the engine computes the last token.
        limit = (prompt_len - 1) // self.block_size * self.block_size
        if state.handoff is not None and not self._handoff_ready(state, prompt_len, limit):
            return None, False  # vLLM asks again next step; other requests go on meanwhile
        loadable = 0
        try:
            state.hit_chunks, state.sources = 0, []
            if state.load and prompt_len >= self.chunk_tokens:
                loadable = self._lookup(state, prompt_len, limit)
        except Exception:  # never break the scheduler: a lookup that fails is a miss
            log.exception("lmtier lookup failed for %s", request.request_id)
            state.hit_chunks, loadable = 0, 0
        state.local_tokens = num_computed_tokens
        state.external_tokens = max(0, loadable - num_computed_tokens)
        for i, lane in enumerate(self.lanes):  # what the store holds is not saved again
            known = state.hit_chunks if not lane.window else loadable // self.chunk_tokens
            state.saved[i] = max(state.saved[i], known)
        if not state.counted:  # the scheduler may ask again for a request it could not place
            state.counted = True
            if self._request_log is not None:  # every prompt: a short one counts in the hit ratio too
                keys = self._keys_for(state, prompt_len)[0] if prompt_len >= self.chunk_tokens else []
                self._request_log.write(prompt_len, keys)
            state.save = state.save and self.store.policy.stores(prompt_len)  # min_tokens
            if self.store.policy.sketch is not None:  # reuse: a prefix found is a reuse sighted
                state.sighted = state.hit_chunks
            metrics.ENGINE_TOKENS.labels(ENGINE, "requested").inc(prompt_len)
            metrics.ENGINE_TOKENS.labels(ENGINE, "hit").inc(max(loadable, num_computed_tokens))
        return state.external_tokens, False

    def _new_request(self, request: Request) -> _Request:
        """A request's state at its first lookup: its switches, its role's part, and a
        decode instance's hand-off to wait for."""
        params = getattr(request, "kv_transfer_params", None)
        state = _Request(request, **_request_options(request))
        state.saved = [0] * len(self.lanes)
        # vLLM's cache_salt keeps a user's prefix cache to requests with the same salt: so
        # does lmtier, with the salt in the request's namespaces
        salt = getattr(request, "cache_salt", None)
        state.namespaces = self.lane_namespaces
        if salt:
            state.namespaces = [
                [replace(ns, salt=f"{ns.salt}/cache_salt={salt}") for ns in lane] for lane in self.lane_namespaces
            ]
        state.load = state.load and self.kv_role.loads
        state.save = state.save and self.kv_role.saves
        state.forwarded = forwarded(params)
        # a request naming its decode instance hands off as a producer's does, where another
        # instance can read this one's tiers at all (else holding its answer gains nothing)
        named = self.kv_role.shares and named_decoder(params)
        state.hands_off = state.save and (self.kv_role.producer or named)
        state.hold = state.hands_off and not state.forwarded
        if state.load:
            state.source = remote_source(params)
            state.handoff = self._handoff_of(state, Handoff.of(params))
            if state.handoff is not None:
                state.wait_until = state.handoff.wait_until(self.config.handoff_timeout)
        return state

    def _handoff_of(self, state: _Request, handoff: Handoff | None) -> Handoff | None:
        """A hand-off this instance can wait for: of its own model and layout (rank 0's
        namespace) and of this prompt (the key of its last chunk), else None."""
        if handoff is None or handoff.tokens < self.chunk_tokens:
            return None
        rid = state.request.request_id
        mine = state.namespaces[0][0].digest.hex()
        if handoff.namespace != mine or handoff.chunk_tokens != self.chunk_tokens:
            log.warning(
                "lmtier: %s: a hand-off of another model or layout (namespace %s, %d-token chunks; this instance's: "
                "%s, %d): ignored",
                rid, handoff.namespace, handoff.chunk_tokens, mine, self.chunk_tokens,
            )  # fmt: skip
            self._count_handoff("ignored")
            return None
        chunks = handoff.tokens // self.chunk_tokens
        fits = handoff.tokens <= len(state.request.all_token_ids)
        keys = self._keys_for(state, chunks * self.chunk_tokens)[0] if fits else []
        if len(keys) < chunks or keys[chunks - 1].hex() != handoff.key:
            log.warning("lmtier: %s: a hand-off of another prompt: ignored", rid)
            self._count_handoff("ignored")
            return None
        return handoff

    def _count_handoff(self, result: str) -> None:
        """On lmtier's metrics port and, through the scheduler's stats, on vLLM's ``/metrics``."""
        metrics.HANDOFFS.labels(result).inc()
        self._interval.handoff(result)

    def _handoff_ready(self, state: _Request, prompt_len: int, limit: int) -> bool:
        """Whether a decode instance stops waiting for its hand-off: every chunk it names is
        readable on every rank, or the deadline has passed (then it loads what is there)."""
        handoff = state.handoff
        assert handoff is not None
        now = time.monotonic()
        if now >= state.wait_until:
            log.warning(
                "lmtier: %s: the hand-off's chunks were not all readable by its deadline; the engine recomputes "
                "what is missing",
                state.request.request_id,
            )
            state.handoff = None
            self._count_handoff("late")
            return True
        if now < state.next_look or self._handoff_looks >= HANDOFF_LOOKS_PER_STEP:
            if not self._napped:  # a scheduler with nothing else to do spins: once a step, yield the core
                self._napped = True
                time.sleep(RECHECK_S / 10)
            return False
        state.next_look = now + RECHECK_S
        self._handoff_looks += 1
        wanted = min(handoff.tokens, prompt_len) // self.chunk_tokens
        try:
            self._lookup(state, prompt_len, limit)
        except Exception:
            log.exception("lmtier lookup failed for %s", state.request.request_id)
            return False
        if state.hit_chunks < wanted:
            shared = [t for t in self.store.tiers if t.scheme not in LOCAL_SCHEMES]
            if shared and not any(self.store.answering(t) for t in shared):
                log.warning(
                    "lmtier: %s: the shared tier does not answer; the engine recomputes the hand-off's chunks",
                    state.request.request_id,
                )
                state.handoff = None
                self._count_handoff("down")
                return True
            return False
        state.handoff = None
        self._count_handoff("ready")
        return True

    def _lookup(self, state: _Request, prompt_len: int, limit: int) -> int:
        """Tokens a load can restore: the leading chunks every full-attention lane holds on
        every rank (``state.hit_chunks``), cut to ``limit``; with sliding-window lanes, the
        longest such prefix whose window (the chunks its next token attends to) each
        sliding-window lane holds too."""
        if len(self.lanes) > 1 and getattr(self, "_kv_cache_manager", None) is None:
            return 0  # a hybrid model's blocks come from the cache manager, which vLLM binds
        full = [i for i, lane in enumerate(self.lanes) if not lane.window] or [0]
        keys = [self._keys_for(state, prompt_len, i) for i in range(len(self.lanes))]
        if state.source and not all(self.store.direct(k, state.source) for lane in keys for k in lane):
            state.source = ""  # not a member: ignored (said once, by the peers tier)
        state.sources = [(t.scheme, n) for t, n in self.store.lookup_tiers(keys[full[0]][0])]
        runs = [sum(n for _, n in state.sources)]
        runs += [self.store.lookup(k) for i in full for k in keys[i][(1 if i == full[0] else 0) :]]
        state.hit_chunks = min(runs)
        tokens = min(state.hit_chunks * self.chunk_tokens, limit)
        for _ in range(WINDOW_TRIES):
            if tokens <= 0 or self._windows_held(keys, tokens):
                return max(0, tokens)
            tokens = (-(-tokens // self.chunk_tokens) - 1) * self.chunk_tokens  # the chunk boundary before
        return 0

    def _windows_held(self, keys: list[list[list[bytes]]], tokens: int) -> bool:
        """Whether every sliding-window lane holds, on every rank, the chunks under the
        window of the token after ``tokens``."""
        last = -(-tokens // self.chunk_tokens)
        for i, lane in enumerate(self.lanes):
            if lane.window:
                first = lane.first_needed(tokens, self.block_size) // self.chunk_tokens
                if any(self.store.lookup(k[first:last]) < last - first for k in keys[i]):
                    return False
        return True

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """The tokens lmtier supplies, by the tier that holds them (host, disk, or a shared
        tier: unspecified), for vLLM's ``prompt_tokens_cached_by_source``."""
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return hit_sources(state.sources, self.chunk_tokens, state.local_tokens, num_external_tokens)
