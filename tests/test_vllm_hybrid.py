"""Hybrid models: a KV cache with a full-attention and a sliding-window group (vLLM's
hybrid KV cache manager, which lmtier's SupportsHMA turns on).

Under vLLM's real Scheduler with such a cache (no model run): each group is a chain of
chunks under its own namespace; a hit needs every full-attention chunk and only the
sliding-window chunks under the window of the token after it; a sliding window's chunk is
stored only while its blocks hold it; a worker loads each group's blocks and never
vLLM's null block. In real engines (the CPU build): a tiny Llama whose odd layers slide,
instance B (a new process) answering from instance A's disk tier exactly as vLLM's own
prefix cache does, and by greedy tokens as a run without any cache does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_vllm_engine import ids, mismatches, reference
from test_vllm_scheduler import config_for, scheduler_for, tokens
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.request import Request

from lmtier.connectors.vllm import LMTierConnector
from lmtier.connectors.vllm.groups import groups_of
from lmtier.errors import ConfigError
from lmtier.kv.chunk import Chunk
from lmtier.testing.engine import prefill_problems, run_engine
from lmtier.testing.tinymodel import build

BLOCK, CHUNK, NUM_BLOCKS, WINDOW = 64, 128, 256, 128
FULL = [f"model.layers.{i}.self_attn.attn" for i in (0, 2)]
SLIDING = [f"model.layers.{i}.self_attn.attn" for i in (1, 3)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build(tmp_path_factory.mktemp("hybrid"), sliding_window=WINDOW))


@pytest.fixture
def vllm_config(model) -> VllmConfig:
    return config_for(model, ["cpu://?size=64MiB"])


def kv_cache_config(window: int = WINDOW) -> KVCacheConfig:
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    sliding = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=window
    )
    groups = [KVCacheGroupSpec(FULL, full), KVCacheGroupSpec(SLIDING, sliding)]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def make_scheduler(vllm_config, window: int = WINDOW) -> Scheduler:
    return scheduler_for(vllm_config, kv_cache_config(window))


@pytest.fixture
def scheduler(vllm_config) -> Scheduler:
    return make_scheduler(vllm_config)


def schedule(scheduler: Scheduler, prompt: list[int], req_id: str = "r"):
    sampling = SamplingParams(max_tokens=4)
    request = Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=sampling, pooling_params=None)
    scheduler.add_request(request)
    out = scheduler.schedule()
    return request, out, out.kv_connector_metadata


def store(connector: LMTierConnector, prompt: list[int], lane: int, chunks: range) -> dict[int, np.ndarray]:
    """Put chunks of ``prompt`` into one lane's chain, as a worker would; their bytes."""
    ns = connector.lane_namespaces[lane][0]
    layout = connector.lanes[lane].layout
    keys = ns.keys(prompt)
    data = {
        c: np.random.default_rng(100 * lane + c).integers(0, 256, layout.byte_shape(CHUNK), np.uint8) for c in chunks
    }
    connector.store.put([Chunk(keys[c], layout, data[c], namespace=ns.digest) for c in chunks])
    return data


def test_a_hybrid_cache_is_one_chain_per_group_under_its_own_namespace(scheduler):
    connector = scheduler.connector
    assert supports_hma(connector)
    lanes = connector.lanes
    assert [(lane.index, lane.window, lane.layout.num_layers) for lane in lanes] == [(0, 0, 2), (1, WINDOW, 2)]
    full, sliding = (ns[0] for ns in connector.lane_namespaces)
    assert full.fields()["group"] == "full:0,2" and sliding.fields()["group"] == f"sliding={WINDOW}:1,3"
    assert full.digest != sliding.digest
    # a model with one group keeps the keys it had: no group in its namespace
    single = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=kv_cache_config().kv_cache_groups[:1])
    assert groups_of(single, lanes[0].layout) == []


def test_a_miss_saves_every_group_and_a_hit_loads_the_full_chunks_and_the_window(scheduler):
    prompt = tokens(450)
    _, out, meta = schedule(scheduler, prompt)
    assert meta.fence_all  # sliding windows let blocks go at every step: copies end first
    assert sorted((s.lane, len(s.keys[0])) for s in meta.saves) == [(0, 3), (1, 3)]
    full_save, sliding_save = sorted(meta.saves, key=lambda s: s.lane)
    assert full_save.keys[0] != sliding_save.keys[0]
    blocks = scheduler.kv_cache_manager.get_block_ids("r")
    assert full_save.block_ids == list(blocks[0][:6]) and sliding_save.block_ids == list(blocks[1][:6])

    hit = tokens(450, seed=1)
    connector = scheduler.connector
    store(connector, hit, 0, range(3))
    store(connector, hit, 1, range(3))
    request, out, meta = schedule(scheduler, hit, req_id="hit")
    assert request.num_computed_tokens - out.num_scheduled_tokens["hit"] == 384
    full_load, sliding_load = sorted(meta.loads, key=lambda p: p.lane)
    hit_blocks = scheduler.kv_cache_manager.get_block_ids("hit")
    assert len(full_load.keys[0]) == 3 and full_load.block_ids == list(hit_blocks[0][:6])
    assert (full_load.first_block, full_load.num_blocks) == (0, 6)
    # the next token (384) attends to [257, 384): blocks 4 and 5 of the window, chunk 2 only
    null = scheduler.kv_cache_manager.block_pool.null_block.block_id
    assert list(hit_blocks[1][:4]) == [null] * 4
    assert sliding_load.keys[0] == connector.lane_namespaces[1][0].keys(hit)[2:3]
    assert sliding_load.block_ids == list(hit_blocks[1][4:6])
    assert (sliding_load.first_block, sliding_load.num_blocks) == (0, 2)
    assert null not in sliding_load.block_ids


def test_a_hit_is_cut_to_the_prefix_whose_window_a_sliding_group_holds(scheduler):
    prompt = tokens(450, seed=2)
    connector = scheduler.connector
    store(connector, prompt, 0, range(3))
    store(connector, prompt, 1, range(2))  # the window of 384 (chunk 2) is missing; of 256, chunk 1 is held
    request, out, meta = schedule(scheduler, prompt)
    assert request.num_computed_tokens - out.num_scheduled_tokens["r"] == 256
    assert sorted((p.lane, len(p.keys[0])) for p in meta.loads) == [(0, 2), (1, 1)]
    # what is missing from the sliding chain is saved once computed; the full chain has it all
    assert sorted((s.lane, len(s.keys[0])) for s in meta.saves) == [(1, 1)]
    assert connector.store.lookup(connector.lane_namespaces[0][0].keys(prompt)) == 3


def test_no_sliding_window_chunk_is_left_without_its_window_for_a_hit(scheduler):
    """Without the window's chunks the hit is nothing, even when the full chain holds all."""
    prompt = tokens(450, seed=3)
    store(scheduler.connector, prompt, 0, range(3))
    request, out, meta = schedule(scheduler, prompt)
    assert request.num_computed_tokens - out.num_scheduled_tokens["r"] == 0
    assert meta.loads == []


def test_a_sliding_window_chunk_whose_blocks_were_let_go_is_not_saved(vllm_config):
    """A prompt computed 100 tokens a step with a window of 32: a chunk completed in a step
    that starts at least 95 tokens into it has lost its first block already (vLLM keeps
    the blocks of the last 31 tokens computed; the null block stands in), so the sliding
    group saves chunks 1, 2 and 4 (0 completes in the step from 100, 3 in the one from 500);
    the full group saves all five."""
    from vllm.v1.outputs import ModelRunnerOutput

    scheduler = make_scheduler(vllm_config, window=32)
    scheduler.max_num_scheduled_tokens = 100
    prompt = tokens(640, seed=4)
    request, out, meta = schedule(scheduler, prompt)
    steps = [meta]
    while request.num_computed_tokens < len(prompt):
        scheduler.update_from_output(
            out, ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[]])
        )
        out = scheduler.schedule()
        steps.append(out.kv_connector_metadata)
    null = scheduler.kv_cache_manager.block_pool.null_block.block_id
    saved = {0: [], 1: []}
    for m in steps:
        for s in m.saves:
            saved[s.lane] += s.keys[0]
            assert null not in s.block_ids
    full_keys = scheduler.connector.lane_namespaces[0][0].keys(prompt)
    sliding_keys = scheduler.connector.lane_namespaces[1][0].keys(prompt)
    assert saved[0] == full_keys  # all five chunks
    assert saved[1] == [sliding_keys[c] for c in (1, 2, 4)]


def worker_for(vllm_config) -> tuple[LMTierConnector, dict[str, torch.Tensor]]:
    worker = LMTierConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config())
    caches = {name: torch.randn(NUM_BLOCKS, 2, BLOCK, 128).to(torch.bfloat16) for name in FULL + SLIDING}
    worker.register_kv_caches(caches)
    return worker, caches


def test_a_worker_saves_and_loads_each_group_in_its_own_blocks(vllm_config, scheduler):
    prompt = tokens(450, seed=5)
    _, _, meta = schedule(scheduler, prompt)
    worker, caches = worker_for(vllm_config)
    worker.bind_connector_metadata(meta)
    worker.wait_for_save()
    worker.flush()
    saved = {name: caches[name].clone() for name in caches}
    blocks = scheduler.kv_cache_manager.get_block_ids("r")

    # a new request with the same prompt: the full group from chunks 0-2, the window from chunk 2
    request, out, hit = schedule(scheduler, prompt + [7] * 10, req_id="again")
    assert request.num_computed_tokens - out.num_scheduled_tokens["again"] == 384
    for tensor in caches.values():
        tensor.zero_()
    worker.bind_connector_metadata(hit)
    worker.start_load_kv(None)
    assert worker.get_block_ids_with_load_errors() == set()
    new = scheduler.kv_cache_manager.get_block_ids("again")
    null = scheduler.kv_cache_manager.block_pool.null_block.block_id
    for name in FULL:  # every block of the six
        for old, b in zip(blocks[0][:6], new[0][:6], strict=True):
            assert torch.equal(caches[name][b], saved[name][old])
    for name in SLIDING:  # the window's two blocks; the null block never written
        for old, b in zip(blocks[1][4:6], new[1][4:6], strict=True):
            assert torch.equal(caches[name][b], saved[name][old])
        assert not caches[name][null].any()


def test_the_step_after_a_sliding_window_save_waits_for_its_copies(vllm_config, scheduler):
    import threading

    _, _, meta = schedule(scheduler, tokens(300, seed=6))
    worker, _ = worker_for(vllm_config)
    gate, gather = threading.Event(), worker._engines[1].gather_many

    def held(*args, **kwargs):
        assert gate.wait(30)
        gather(*args, **kwargs)

    worker._engines[1].gather_many = held
    worker.bind_connector_metadata(meta)
    worker.wait_for_save()
    done = threading.Event()
    threading.Thread(target=lambda: (worker.handle_preemptions(meta), done.set()), daemon=True).start()
    assert not done.wait(0.5)  # the next step would overwrite what a let-go block still holds
    gate.set()
    assert done.wait(30)


def test_a_group_lmtier_cannot_hold_is_refused_with_the_reason(vllm_config):
    from vllm.v1.kv_cache_interface import MambaSpec

    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 4),), dtypes=(torch.float32,))
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(FULL, full), KVCacheGroupSpec(SLIDING, mamba)],
    )
    with pytest.raises(ConfigError, match="MambaSpec"):
        LMTierConnector(vllm_config, KVConnectorRole.SCHEDULER, config)


# -- real engines ---------------------------------------------------------------------------
SHARED = ids(1024, 11)
SCENARIO = [
    {"name": "doc0", "prompts": [SHARED + ids(300, 12)]},
    {"name": "doc1", "prompts": [ids(700, 13)]},
    {"name": "diverge", "prompts": [SHARED + ids(300, 14)]},
    {"name": "chat", "chat": {"first": ids(520, 15), "questions": [ids(250, 16), ids(250, 17)]}},
]


@pytest.mark.engine
def test_a_hybrid_model_in_real_engines_answers_as_vllms_own_prefix_cache(tmp_path, model):
    disk = tmp_path / "disk"
    tiers = {"tiers": ["cpu://?size=256MiB", f"file://{disk}?size=1GiB"], "chunk_tokens": CHUNK}
    spec = {"model": model, "block_size": BLOCK, "lmtier": tiers, "phases": SCENARIO}
    a = run_engine(spec, tmp_path, "a", timeout=600)
    assert "Turning off hybrid kv cache manager" not in a["log"]  # lmtier supports it: two groups
    b = run_engine(spec, tmp_path, "b", timeout=600)
    ref = reference(tmp_path, model, phases=SCENARIO)
    # B, a new process, hits every full chunk A stored (prompt and answer) from the disk,
    # exactly as many tokens as vLLM's own prefix cache hits: the answers are equal bit for bit
    assert [o["cached"] for o in b["results"]["doc0"]] == [1280]
    assert [o["cached"] for o in b["results"]["doc1"]] == [640]
    same_lineage = {k: v for k, v in ref["hit"].items() if k != "diverge"}
    assert mismatches(b, same_lineage, ref["full"]) == []
    # The prompt that diverges after the shared document: A's memory tier serves the
    # document to it, where vLLM's own hybrid prefix cache hits nothing the first time a
    # prefix is shared (vLLM 0.32 on CPU; the second time it does). So A computed its tail
    # on a cached prefix and the reference on a computed one, whose KV differ in the low
    # bits (see test_vllm_engine): B's hit of it and A's answers compare by greedy tokens.
    assert [o["cached"] for o in a["results"]["diverge"]] == [1024]
    assert [o["cached"] for o in b["results"]["diverge"]] == [1280]
    for run in (a, b):
        for phase, full in ref["full"].items():
            assert prefill_problems(run["results"][phase], full) == [], phase
