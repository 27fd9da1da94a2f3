"""Prefill/decode disaggregation inside vLLM's real Scheduler over a real Redis (no model
runs): the roles, the producer's hold and hand-off, the consumer's wait for it.

The engines themselves, side by side behind the reference proxy, are in
tests/test_vllm_pd_engines.py."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from test_vllm_scheduler import BLOCK, CHUNK, LAYERS, NUM_BLOCKS, config_for, kv_cache_config, scheduler_for, tokens
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from lmtier.config import StoreConfig
from lmtier.connectors.vllm import LMTierConnector
from lmtier.connectors.vllm.pd import Handoff, role_of
from lmtier.errors import ConfigError


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from lmtier.testing.tinymodel import build

    return str(build(tmp_path_factory.mktemp("model")))


@pytest.fixture
def redis(redis_server):
    redis_server.call("FLUSHALL")
    return redis_server


def engine(model: str, role: str, tiers: list[str], **extra):
    config = config_for(model, tiers, **extra)
    config.kv_transfer_config = KVTransferConfig(**{**_transfer(config), "kv_role": role})
    return scheduler_for(config, kv_cache_config()), config


def _transfer(config) -> dict:
    t = config.kv_transfer_config
    return {
        "kv_connector": t.kv_connector,
        "kv_connector_module_path": t.kv_connector_module_path,
        "kv_load_failure_policy": t.kv_load_failure_policy,
        "kv_connector_extra_config": t.kv_connector_extra_config,
    }


def producer(model, redis, **extra):
    return engine(model, "kv_producer", ["cpu://?size=64MiB", redis.url], **extra)


def consumer(model, redis, **extra):
    return engine(model, "kv_consumer", [redis.url], **extra)


def submit(scheduler, prompt, req_id="r", params=None, max_tokens=1):
    sampling = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": params} if params else None)
    request = Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=sampling, pooling_params=None)
    scheduler.add_request(request)
    return request


def worker_for(config) -> LMTierConnector:
    worker = LMTierConnector(config, KVConnectorRole.WORKER, kv_cache_config())
    caches = {name: torch.randn(NUM_BLOCKS, 2, BLOCK, 128).to(torch.bfloat16) for name in LAYERS}
    worker.register_kv_caches(caches)
    return worker


def slowed(worker: LMTierConnector, monkeypatch) -> LMTierConnector:
    """Fault injection: the worker's writes to every tier take 0.3 s (the shared tier is far away)."""
    put_all = worker.store.put_all

    def slow(chunks):
        time.sleep(0.3)
        return put_all(chunks)

    monkeypatch.setattr(worker.store, "put_all", slow)
    return worker


def prefill(scheduler, worker, prompt, req_id="r", params=None):
    """One producer request through the scheduler and a worker, as the engine runs it
    with max_tokens=1: returns its scheduler output and what request_finished returned."""
    submit(scheduler, prompt, req_id, params)
    out = scheduler.schedule()
    worker.bind_connector_metadata(out.kv_connector_metadata)
    worker.wait_for_save()
    finished = scheduler.update_from_output(
        out, ModelRunnerOutput(req_ids=[req_id], req_id_to_index={req_id: 0}, sampled_token_ids=[[7]])
    )
    (outputs,) = finished.values()
    (output,) = outputs.outputs
    return out, output.kv_transfer_params


FORWARDED = {"do_remote_decode": True}


def scheduled(scheduler, req_id: str, seconds: float = 10.0):
    """The first scheduler output that schedules ``req_id`` (a waiting hand-off is looked
    up again every RECHECK_S)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        out = scheduler.schedule()
        if req_id in out.num_scheduled_tokens:
            return out
        time.sleep(0.005)
    raise AssertionError(f"{req_id} was never scheduled")


# -- roles -----------------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
@pytest.mark.parametrize("tiers", [("cpu://?size=1GiB",), ("cpu://?size=1GiB", "file:///tmp/x?size=1GiB")])
def test_a_role_whose_tiers_the_other_side_cannot_read_is_an_error_at_start(role, tiers):
    with pytest.raises(ConfigError, match="needs a tier the other side reads"):
        role_of(role, StoreConfig(tiers=tiers))
    assert role_of("kv_both", StoreConfig(tiers=tiers)).loads  # a colocated cache: fine


def test_an_unknown_role_is_an_error():
    with pytest.raises(ConfigError, match="kv_role must be one of"):
        role_of("kv_prefill", StoreConfig(tiers=("redis://127.0.0.1:1",)))


def test_a_producer_never_looks_up_and_saves_every_full_chunk(model, redis):
    scheduler, config = producer(model, redis)
    prompt = tokens(450)
    worker = worker_for(config)
    prefill(scheduler, worker, prompt, "a")  # stored: in its own memory and in Redis
    submit(scheduler, prompt, "b")  # the same prompt again
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["b"] == 450  # computed whole: a producer does not look
    meta = out.kv_connector_metadata
    assert meta.loads == [] and [len(s.keys[0]) for s in meta.saves] == [3]
    assert meta.hold == ["b"]  # its prompt completes in this step, nothing forwarded: held


def test_a_consumer_loads_and_never_saves_unless_told(model, redis):
    pscheduler, pconfig = producer(model, redis)
    prompt = tokens(450, seed=3)
    prefill(pscheduler, worker_for(pconfig), prompt)
    scheduler, _ = consumer(model, redis)
    submit(scheduler, prompt, max_tokens=4)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["r"] == 450 - 384  # the three chunks are loaded, the tail computed
    assert out.kv_connector_metadata.saves == []
    other = tokens(450, seed=4)  # a prompt no producer saw: computed, and not stored
    submit(scheduler, other, "s", max_tokens=4)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["s"] == 450 and out.kv_connector_metadata.saves == []
    keeper, _ = consumer(model, redis, save_decoded=True)
    submit(keeper, other, "k", max_tokens=4)
    assert [len(s.keys[0]) for s in keeper.schedule().kv_connector_metadata.saves] == [3]


# -- the producer's answer ------------------------------------------------------------------
def test_a_producers_step_holds_its_output_until_the_chunks_are_in_redis(model, redis, monkeypatch):
    """No parameters forwarded: wait_for_save returns only once a second store (another
    instance) can read every chunk, with the writes to Redis slowed by 0.3 s."""
    scheduler, config = producer(model, redis)
    worker = slowed(worker_for(config), monkeypatch)
    prompt = tokens(700, seed=5)
    decode, _ = consumer(model, redis)
    ns = decode.connector.namespaces[0]
    out, params = prefill(scheduler, worker, prompt)
    assert out.kv_connector_metadata.hold == ["r"]
    assert decode.connector.store.lookup(ns.keys(prompt)[:5]) == 5  # readable when the step ended
    handoff = Handoff.of(params)
    assert handoff is not None and handoff.tokens == 640 and handoff.chunk_tokens == CHUNK
    assert handoff.key == ns.keys(prompt)[4].hex() and handoff.namespace == ns.digest.hex()


def test_a_colocated_instance_named_as_prefill_by_its_decoder_holds_as_a_producer(model, redis, monkeypatch):
    """llm-d's P2P mode: the prefill instance (``kv_both``) gets ``remote_decoder``, answers,
    and only then is the decode instance asked. The answer waits for every tier (the
    writes to Redis slowed by 0.3 s), and names the hand-off; a plain request does not."""
    scheduler, config = engine(model, "kv_both", ["cpu://?size=64MiB", redis.url])
    worker = slowed(worker_for(config), monkeypatch)
    prompt = tokens(700, seed=15)
    decode, _ = consumer(model, redis)
    ns = decode.connector.namespaces[0]
    out, params = prefill(scheduler, worker, prompt, params={"remote_decoder": {"kv_request_id": "x-1"}})
    assert out.kv_connector_metadata.hold == ["r"]
    assert all(plan.hand_off for plan in out.kv_connector_metadata.saves)
    assert decode.connector.store.lookup(ns.keys(prompt)[:5]) == 5  # readable when the step ended
    assert Handoff.of(params).tokens == 640
    out, params = prefill(scheduler, worker, tokens(700, seed=16), "plain")
    assert out.kv_connector_metadata.hold == [] and params is None  # a colocated request: no hold, no hand-off
    assert not any(plan.hand_off for plan in out.kv_connector_metadata.saves)
    alone, config = engine(model, "kv_both", ["cpu://?size=64MiB"])  # no tier another instance reads
    out, params = prefill(alone, worker_for(config), prompt, "mine", params={"remote_decoder": {"kv_request_id": "x"}})
    assert out.kv_connector_metadata.hold == [] and params is None  # nothing to wait for, nothing to hand off


def test_a_forwarding_router_gets_the_answer_at_once_and_the_decoder_waits_for_the_chunks(model, redis, monkeypatch):
    scheduler, config = producer(model, redis)
    worker = worker_for(config)
    gate, put_all = threading.Event(), worker.store.put_all

    def held(chunks):  # fault injection: the writes land only when the test says so
        assert gate.wait(30)
        return put_all(chunks)

    monkeypatch.setattr(worker.store, "put_all", held)
    prompt = tokens(600, seed=6)
    out, params = prefill(scheduler, worker, prompt, params={"do_remote_decode": True, "remote_engine_id": None})
    assert out.kv_connector_metadata.hold == []  # answered at once
    assert Handoff.of(params).tokens == 512
    decode, _ = consumer(model, redis, handoff_timeout=30)
    submit(decode, prompt, params=params, max_tokens=4)
    for _ in range(3):  # "ask again": nothing scheduled while the chunks are on their way
        assert decode.schedule().num_scheduled_tokens == {}
    gate.set()
    worker.flush()
    out = scheduled(decode, "r")
    assert out.num_scheduled_tokens["r"] == 600 - 512  # then every chunk loads
    assert len(out.kv_connector_metadata.loads[0].keys[0]) == 4


def test_past_the_deadline_the_decoder_loads_what_is_there_and_recomputes_the_rest(model, redis, monkeypatch):
    scheduler, config = producer(model, redis)
    worker = worker_for(config)
    monkeypatch.setattr(worker.store, "put_all", lambda chunks: False)  # fault injection: never lands
    prompt = tokens(600, seed=7)
    _, params = prefill(scheduler, worker, prompt, params={"do_remote_decode": True})
    decode, _ = consumer(model, redis, handoff_timeout=0.2)
    submit(decode, prompt, params=params, max_tokens=4)
    assert decode.schedule().num_scheduled_tokens == {}
    time.sleep(0.25)
    out = scheduled(decode, "r", 1.0)
    assert out.num_scheduled_tokens["r"] == 600 and out.kv_connector_metadata.loads == []


@pytest.mark.parametrize(
    "change",
    [
        {"namespace": "00" * 16},  # another model or layout
        {"key": "11" * 16},  # another prompt
        {"chunk_tokens": 2 * CHUNK},
        {"v": 99},
        {"tokens": "many"},
        {"tokens": 10**6},  # longer than this prompt
    ],
)
def test_a_handoff_of_another_prompt_or_model_costs_no_wait_and_loads_nothing_wrong(model, redis, change):
    scheduler, config = producer(model, redis)
    prompt = tokens(600, seed=8)
    _, params = prefill(scheduler, worker_for(config), prompt, params={"do_remote_decode": True})
    params = {"lmtier": {**params["lmtier"], **change}}
    other = tokens(600, seed=9)  # the decoder's prompt is another one: nothing of it is stored
    decode, _ = consumer(model, redis, handoff_timeout=30)
    submit(decode, other, params=params, max_tokens=4)
    out = decode.schedule()
    assert out.num_scheduled_tokens["r"] == 600 and out.kv_connector_metadata.loads == []


def test_handoff_keys_are_not_mistaken_for_a_typo_in_the_switches(model, redis):
    """A decoder given a hand-off still stores nothing as a consumer, and as kv_both it
    treats the hand-off's keys as known (not as a malformed opt-out)."""
    scheduler, config = producer(model, redis)
    prompt = tokens(600, seed=10)
    worker = worker_for(config)
    _, params = prefill(scheduler, worker, prompt, params={"do_remote_decode": True})
    worker.flush()  # (else it would rightly wait for them)
    both, _ = engine(model, "kv_both", [redis.url])
    longer = prompt + tokens(300, seed=11)  # a next turn: the hand-off's prefix, and more
    submit(both, longer, params=params, max_tokens=4)
    out = both.schedule()
    assert out.num_scheduled_tokens["r"] == 900 - 512
    assert [len(s.keys[0]) for s in out.kv_connector_metadata.saves] == [3]  # chunks 4..6 are new


def test_a_crowd_of_waiting_handoffs_costs_a_step_a_bounded_number_of_lookups(model, redis, monkeypatch):
    """Each waiting hand-off is a lookup in the shared tier; however many wait, a step
    makes at most HANDOFF_LOOKS_PER_STEP of them (and none for one looked at in the last
    RECHECK_S), so that a crowd cannot make every step wait on the network."""
    from lmtier.connectors.vllm.lookup import HANDOFF_LOOKS_PER_STEP

    scheduler, config = producer(model, redis)
    worker = worker_for(config)
    monkeypatch.setattr(worker.store, "put_all", lambda chunks: False)  # fault injection: nothing lands
    prompts = [tokens(300, seed=50 + i) for i in range(3 * HANDOFF_LOOKS_PER_STEP)]
    handoffs = [prefill(scheduler, worker, p, f"p{i}", params=FORWARDED)[1] for i, p in enumerate(prompts)]
    decode, _ = consumer(model, redis, handoff_timeout=30)
    looks, lookup = [], decode.connector.store.lookup_tiers
    monkeypatch.setattr(decode.connector.store, "lookup_tiers", lambda keys: looks.append(1) or lookup(keys))
    for i, (p, params) in enumerate(zip(prompts, handoffs, strict=True)):
        submit(decode, p, f"d{i}", params=params, max_tokens=4)
    counts = []
    for _ in range(4):
        looks.clear()
        assert decode.schedule().num_scheduled_tokens == {}
        counts.append(len(looks))
    assert counts[0] == HANDOFF_LOOKS_PER_STEP and max(counts) == HANDOFF_LOOKS_PER_STEP
    assert all(decode.connector._requests[f"d{i}"].handoff is not None for i in range(len(prompts)))


# -- what outside review found ----------------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [
        {"tokens": float("inf")},  # JSON 1e999: once an OverflowError that ended the engine core
        {"chunk_tokens": float("inf")},
        {"tokens": 512.0},
        {"tokens": True},
        {"deadline": "soon"},
        {"deadline": float("nan")},
        {"tokens": 2**80},
    ],
)
def test_a_handoff_with_numbers_out_of_any_range_is_ignored(bad):
    good = {"v": 1, "namespace": "ab", "key": "cd", "tokens": 512, "chunk_tokens": 128, "deadline": 1.0}
    assert Handoff.of({"lmtier": good}) is not None
    assert Handoff.of({"lmtier": {**good, **bad}}) is None


def test_a_request_whose_handoff_cannot_be_read_is_served_and_the_scheduler_goes_on(model, redis):
    decode, _ = consumer(model, redis)
    junk = {"lmtier": {"v": 1, "namespace": "x", "key": "x", "tokens": float("inf"), "chunk_tokens": 1, "deadline": 0}}
    submit(decode, tokens(300, seed=60), params=junk, max_tokens=4)
    assert decode.schedule().num_scheduled_tokens["r"] == 300


@pytest.mark.parametrize("value", ["nan", "inf", float("nan"), -1])
@pytest.mark.parametrize("name", ["handoff_timeout", "load_deadline"])
def test_seconds_that_bound_nothing_are_refused_at_start(name, value):
    with pytest.raises(ConfigError, match=f"{name} must be a number of seconds"):
        StoreConfig(**{name: float(value)})


def test_a_decoder_stops_waiting_at_once_when_its_shared_tier_does_not_answer(model, redis, monkeypatch):
    """The producer answered with a hand-off, then the shared tier went away: the decode
    instance recomputes at once instead of waiting out its deadline."""
    from lmtier.testing.redis_server import free_port

    scheduler, config = producer(model, redis)
    _, params = prefill(scheduler, worker_for(config), tokens(600, seed=61), params=FORWARDED)
    dead = f"redis://127.0.0.1:{free_port()}"  # nothing listens there
    decode, _ = engine(model, "kv_consumer", [dead], handoff_timeout=30)
    submit(decode, tokens(600, seed=61), params=params, max_tokens=4)
    start = time.monotonic()
    out = scheduled(decode, "r", 5.0)
    assert out.num_scheduled_tokens["r"] == 600 and time.monotonic() - start < 5


def test_a_role_its_tiers_cannot_serve_is_told_as_the_engines_last_line(tmp_path):
    """In an engine process (one that inherited the first process's note), a role refused
    at start is written to the note that the first process repeats as its last line."""
    import subprocess
    import sys

    from lmtier.connectors.vllm.settings import NOTE_ENV

    note = tmp_path / "note"
    code = (
        "from lmtier.connectors.vllm.settings import settings\n"
        "try:\n    settings({'tiers': ['cpu://?size=1MiB']}, 'kv_consumer')\n"
        "except Exception as e:\n    print(type(e).__name__)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, NOTE_ENV: str(note)}, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.stdout.strip() == "ConfigError"
    assert note.read_text().startswith("ConfigError: lmtier: kv_role kv_consumer needs a tier the other side reads")


def test_the_reference_proxy_keeps_the_clients_switches_and_refuses_bad_requests_cleanly():
    import socket

    from lmtier.demo.pd_proxy import PDProxy, decode_body, prefill_body

    body = {"prompt": [1, 2], "max_tokens": 9, "kv_transfer_params": {"lmtier": {"load": False}}}
    hand = {"lmtier": {"v": 1, "key": "k"}}
    assert decode_body(body, hand)["kv_transfer_params"]["lmtier"] == {"v": 1, "key": "k", "load": False}
    assert prefill_body({**body, "kv_transfer_params": [1]}, forward=True)["kv_transfer_params"]["do_remote_decode"]
    with PDProxy("http://127.0.0.1:9", "http://127.0.0.1:9", forward=True) as proxy:
        port = int(proxy.url.rsplit(":", 1)[1])
        for length in ("abc", "-1"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode())
                status = s.recv(200).split(b"\r\n")[0]
                assert status.startswith(b"HTTP/1.1 400 "), status
