"""What the vLLM connector's two halves tell each other every step.

- Scheduler -> workers (``LMTierMetadata``): which chunks to load into which blocks
  (``LoadPlan``), which newly computed chunks to save from which blocks (``SavePlan``),
  and the requests whose blocks must not be written before their copies are done.
- Workers -> scheduler (``LMTierWorkerMeta``): per request, the save plans whose copies
  no longer read the engine's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class LoadPlan:
    req_id: str
    keys: list[list[bytes]]  # [rank][chunk]: the chunks covering the tokens to load
    block_ids: list[int]  # engine blocks of those chunks, in token order
    first_block: int  # load blocks block_ids[first_block:] (the engine computed the rest)
    num_blocks: int  # ... up to block_ids[:num_blocks]
    lane: int = 0  # which chain of chunks: the model's, or one group's of a hybrid model
    source: str = ""  # host:port of the peer a router named as holding them (remote_kv_source)


@dataclass
class SavePlan:
    req_id: str
    keys: list[list[bytes]]  # [rank][chunk]
    block_ids: list[int]  # engine blocks of those chunks, in token order
    lane: int = 0
    digests: list[bytes] = field(default_factory=list)  # [rank]: the namespace the keys are in
    hand_off: bool = False  # a producer's: written to every tier before it counts as saved


@dataclass
class LMTierMetadata(KVConnectorMetadata):
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)
    # requests preempted with saves: their blocks are free now, so the step waits for
    # their copies before it runs (nothing may write those blocks while they are read)
    fence: list[str] = field(default_factory=list)
    # a hybrid model with sliding-window layers: vLLM lets go of a window's old blocks at
    # every step, so the step waits for every copy still reading blocks
    fence_all: bool = False
    # [request][rank]: chunks a new request's lookup found (save_policy=reuse counts them as
    # sightings in the worker's store, whose memory decides at eviction what is written down)
    seen: list[list[list[bytes]]] = field(default_factory=list)
    # finished requests whose blocks went back at once (every copy of them was reported
    # done before they finished): the workers forget them instead of reporting them
    released: list[str] = field(default_factory=list)
    # a producer's requests whose prompt is complete after this step, their router forwarding
    # no parameters: the step's output waits until their chunks are in every tier
    hold: list[str] = field(default_factory=list)


class LMTierWorkerMeta(KVConnectorWorkerMetadata):
    """Workers -> scheduler, each step: per request, how many of its save plans have
    stopped reading the engine's blocks since the last step (vLLM adds the workers' up)."""

    def __init__(self, copied: dict[str, int] | None = None) -> None:
        self.copied = dict(copied or {})

    def aggregate(self, other: KVConnectorWorkerMetadata) -> LMTierWorkerMeta:
        assert isinstance(other, LMTierWorkerMeta)
        for req_id, n in other.copied.items():
            self.copied[req_id] = self.copied.get(req_id, 0) + n
        return self
