"""The scheduler half of ``LMTierConnector`` (vLLM's engine-core process): what to load,
what to save, when a request's blocks go back. The lookups that decide how much a
request can load are ``connectors/vllm/lookup.py``.

- ``build_connector_meta`` turns allocations into plain plans (``connectors/vllm/plans.py``):
  which keys to load into which blocks, which newly computed full chunks to save from
  which blocks.
- ``request_finished`` keeps the blocks of a request whose copies are still in flight,
  and returns a producer's hand-off for the router to forward.
- ``update_connector_output`` counts the copies the workers report done, and takes in
  their KV events for routers; ``reset_cache`` moves the instance to a fresh epoch.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole

from lmtier._moved import forward
from lmtier.connectors import announce
from lmtier.connectors.vllm.events import LMTierKVEvents
from lmtier.connectors.vllm.lookup import Lookups, _Request
from lmtier.connectors.vllm.pd import handoff_params, source_params
from lmtier.connectors.vllm.plans import LMTierMetadata, LMTierWorkerMeta, LoadPlan, SavePlan

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class SchedulerSide(Lookups):
    """Mixed into ``LMTierConnector``; its state is made in the connector's ``__init__``.
    Besides what ``Lookups`` reads and keeps: ``blocks_per_chunk``, ``windowed``,
    ``_workers`` (worker processes, each reporting its copies), ``_released`` (requests
    finished without holding their blocks, for the next step), ``_book`` (KV events, or
    None), ``_relay`` (the other instances' shared-tier events, or None), ``namespaces``
    and ``_model_id`` (for ``reset_cache``)."""

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        copies = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(copies, LMTierWorkerMeta):
            for req_id, n in copies.copied.items():
                state = self._requests.get(req_id)
                if state is not None:  # (a finished request's blocks wait for get_finished)
                    state.copied += n
        events = getattr(connector_output, "kv_cache_events", None)
        if self._book is not None and isinstance(events, LMTierKVEvents):
            self._book.absorb(events)

    def take_events(self):  # type: ignore[override]
        if self._book is None:
            return ()
        events = self._book.take()
        if self._relay is not None:  # this instance's shared-tier events out, the others' in
            self._relay.publish(events)
            events = [*events, *self._relay.take()]
        return events

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        state.external_tokens = num_external_tokens
        state.load_pending = num_external_tokens > 0

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = LMTierMetadata(fence_all=self.windowed, released=self._released)
        self._released = []
        self._napped = False
        self._handoff_looks = 0
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            if state.sighted:
                meta.seen.append(self._keys_for(state, state.sighted * self.chunk_tokens))
                state.sighted = 0
            self._plan(state, new.req_id, new.num_computed_tokens, scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # back from preemption: a fresh block list
                state.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                state.block_ids.extend(new_blocks[0])
            self._plan(state, req_id, cached.num_computed_tokens[i], scheduled.get(req_id, 0), meta)
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            state = self._requests.get(req_id)
            if state is not None and state.plans:
                meta.fence.append(req_id)
        return meta

    def _blocks(self, state: _Request, lane: int) -> list[int]:
        """The request's blocks in a lane's group, as they are now. A hybrid model's come
        from the cache manager: a sliding window's old blocks are let go (vLLM's null block
        stands in for them), which no list kept from the scheduler's output would show."""
        if len(self.lanes) == 1:
            return state.block_ids
        manager = getattr(self, "_kv_cache_manager", None)
        if manager is None:
            return []
        return list(manager.get_block_ids(state.request.request_id)[self.lanes[lane].index])

    def _plan(self, state: _Request, req_id: str, computed: int, scheduled: int, meta: LMTierMetadata) -> None:
        per, size = self.blocks_per_chunk, self.chunk_tokens
        load = state.load_pending
        state.load_pending = False
        done = min(computed + scheduled, len(state.request.all_token_ids)) // size
        if state.hold and computed + scheduled >= len(state.request.prompt_token_ids or ()):
            meta.hold.append(req_id)  # the prompt is complete after this step: its writes land first
            state.hold = False
        for i, lane in enumerate(self.lanes):
            blocks = self._blocks(state, i)
            if load:
                end = state.local_tokens + state.external_tokens
                start = max(state.local_tokens, lane.first_needed(end, self.block_size))  # block-aligned
                if lane.window:  # never a block vLLM did not give this window (its null block)
                    while start < end and blocks[start // self.block_size] == self._null_block():
                        start += self.block_size
                first_chunk, last_chunk = start // size, -(-end // size)
                if start < end:
                    keys = self._keys_for(state, last_chunk * size, i)
                    self._remember(state, keys, first_chunk, i)  # a load promotes them into the memory tier
                    meta.loads.append(
                        LoadPlan(
                            req_id,
                            [k[first_chunk:last_chunk] for k in keys],
                            blocks[first_chunk * per : last_chunk * per],
                            first_block=(start - first_chunk * size) // self.block_size,
                            num_blocks=(end - first_chunk * size) // self.block_size,
                            lane=i,
                            source=state.source,
                        )
                    )
            # Save every chunk that is complete after this step and not known to be stored
            # (a sliding window's: those whose blocks it still holds).
            first = state.saved[i]
            if not state.save or done <= first or len(blocks) < done * per:
                continue
            keys = self._keys_for(state, done * size, i)
            null = self._null_block()
            chunks = [c for c in range(first, done) if null not in blocks[c * per : (c + 1) * per]]
            state.saved[i] = done
            if not chunks:
                continue
            self._remember(state, keys, first, i)
            meta.saves.append(
                SavePlan(
                    req_id,
                    [[k[c] for c in chunks] for k in keys],
                    [b for c in chunks for b in blocks[c * per : (c + 1) * per]],
                    lane=i,
                    digests=[ns.digest for ns in state.namespaces[i]],
                    hand_off=state.hands_off,
                )
            )
            state.plans += 1

    def _null_block(self) -> int:
        """The id of vLLM's null block (what a sliding window's let-go blocks become)."""
        manager = getattr(self, "_kv_cache_manager", None)
        return manager.block_pool.null_block.block_id if manager is not None else 0

    def _remember(self, state: _Request, keys: list[list[bytes]], first: int, lane: int = 0) -> None:
        """Keep the tokens behind chunks about to land in a tier, for their events."""
        if self._book is not None:
            tokens = state.request.all_token_ids[: len(keys[0]) * self.chunk_tokens]
            self._book.remember(keys[0], tokens, first, group=self.lanes[lane].index if len(self.lanes) > 1 else 0)

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, as after a weight update:
        this instance never again loads a chunk stored before. Its namespaces move to a
        fresh epoch (a random salt), so a chunk computed with the old weights is a miss,
        never a hit; what the tiers hold stays for the instances that still use it, and
        the memory tier lets the old chunks go as new ones come. The new digests are
        logged (for ``lmtier match``); routers get vLLM's own ``AllBlocksCleared``. A
        request already in the engine saves nothing more (its KV may predate the reset)."""
        if self.role != KVConnectorRole.SCHEDULER:
            return None
        epoch = secrets.token_hex(8)
        salt = f"{self.config.salt}/reset={epoch}"
        self.lane_namespaces = [[replace(ns, salt=salt) for ns in lane] for lane in self.lane_namespaces]
        self.namespaces = self.lane_namespaces[0]
        for state in self._requests.values():
            # Requests already here (vLLM's reset fails while any runs) computed their KV,
            # or part of it, before the reset: none of it is saved under the new epoch.
            state.save = False
        if self._book is not None:
            self._book.clear()
        announce("vllm", self.config.tiers, self.namespaces, f"{self._model_id} (after a cache reset)")
        return True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        params = self._handoff_params(state)
        if not state.plans:
            return False, params
        if state.copied >= state.plans * self._workers:
            # Every worker has reported every copy of its blocks done (a request that
            # finishes a step or more after its last save): they go back now, so that an
            # idle engine holds no block (vLLM's prefix-cache reset needs them all free).
            self._released.append(request.request_id)
            return False, params
        # Copies in flight: the blocks stay until the workers report them done
        # (get_finished), which every worker does for every request it had a save plan for.
        return True, params

    def _handoff_params(self, state: _Request) -> dict[str, Any] | None:
        """A producer's hand-off for the router to forward: the chunks of the prompt it
        stored (``connectors/vllm/pd.py``) and, where it has a sidecar peers read from, that
        sidecar as vLLM's ``remote_kv_source``; None for any other request. A ``kv_both``
        instance hands off a request whose router asks for a remote decode or names the
        decode instance."""
        chunks = state.saved[0] if state.saved else 0
        producing = state.hands_off or state.forwarded  # kv_both: when a router asks for a remote decode
        if not (producing and state.save and chunks and state.keys and len(state.keys[0][0]) >= chunks):
            return None
        namespace = state.namespaces[0][0].digest
        key = state.keys[0][0][chunks - 1]
        timeout = self.config.handoff_timeout
        params = handoff_params(namespace, key, chunks * self.chunk_tokens, self.chunk_tokens, timeout)
        advertised = self.store.advertised()  # its own sidecar, where peers read: named for the router
        if advertised:
            params.update(source_params(advertised, state.request.request_id))
        return params

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` of a hybrid model (``SupportsHMA``): every group's blocks
        stay until the copies reading them are done."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])


__getattr__ = forward(__name__)  # names of the previous release, found where they live now (CHANGELOG.md)
