"""lmtier inside real vLLM engines (the CPU build), in separate processes.

Instance A serves prompts and stores their KV; instance B, a new process over the same
disk directory (or the same Redis, or the same cache server), serves them again: its scheduler
must report the expected hits and its
greedy tokens and logprobs must equal a run without lmtier. The same in vLLM's default
multiprocess mode and with tensor parallelism 2, and after chunk files were damaged.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from lmtier.enginerun import run_engine
from lmtier.redisproc import RedisServer
from lmtier.server.process import ServerProcess
from lmtier.tiers.base import open_tier
from lmtier.tinymodel import build

CHUNK, BLOCK = 128, 64


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(5, 500, n)]


SHARED = ids(1024, 1)
# One prompt per generate call: requests batched together change the shapes the kernels
# see, and with them the last bits of the logprobs; alone, runs are bit-for-bit repeatable.
SCENARIO = [
    {"name": "doc0", "prompts": [SHARED + ids(300, 2)]},
    {"name": "doc1", "prompts": [ids(700, 3)]},
    {"name": "diverge", "prompts": [SHARED + ids(300, 4)]},
    {"name": "chat", "chat": {"first": ids(600, 5), "questions": [ids(200, 6), ids(200, 7)]}},
]
DOCS = ("doc0", "doc1")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build(tmp_path_factory.mktemp("model")))


def engine(
    tmp: Path, model: str, name: str, disk: Path | None, phases=SCENARIO, shared: str | None = None, **spec
) -> dict:
    """One engine run; lmtier's tiers: host memory, then the disk directory or ``shared``."""
    lmtier = None
    if disk is not None or shared is not None:
        lmtier = {"tiers": ["cpu://?size=256MiB", shared or f"file://{disk}?size=1GiB"], "chunk_tokens": CHUNK}
    spec = {"model": model, "lmtier": lmtier, "block_size": BLOCK, "phases": phases, **spec}
    return run_engine(spec, tmp, name, timeout=600)


def expected_hit(prompt_len: int, stored_tokens: int) -> int:
    """Full chunks stored, never the whole prompt (whole blocks before the last token)."""
    return min(stored_tokens // CHUNK * CHUNK, (prompt_len - 1) // BLOCK * BLOCK)


def same_output(a: dict, b: dict) -> bool:
    return a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]


def assert_same_outputs(run: dict, base: dict) -> None:
    for phase, outs in base["results"].items():
        got = run["results"][phase]
        assert [o["tokens"] for o in got] == [o["tokens"] for o in outs], phase
        assert [o["logprobs"] for o in got] == [o["logprobs"] for o in outs], phase


@pytest.fixture(scope="module")
def single_process(model, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("single")
    disk = tmp / "disk"
    return {
        "base": engine(tmp, model, "base", None),
        "a": engine(tmp, model, "a", disk),
        "b": engine(tmp, model, "b", disk),
        "disk": disk,
        "tmp": tmp,
    }


def test_a_second_instance_hits_what_the_first_stored_and_answers_identically(single_process):
    base, a, b = single_process["base"], single_process["a"], single_process["b"]
    assert_same_outputs(a, base)
    assert_same_outputs(b, base)
    # A computed each prompt and its answer: every full chunk of it is on disk.
    for phase in DOCS:
        (out,), (a_out,) = b["results"][phase], a["results"][phase]
        assert out["cached"] == expected_hit(out["prompt_len"], out["prompt_len"] + len(a_out["tokens"]) - 1)
        assert a_out["cached"] == 0


def test_a_prompt_sharing_a_prefix_hits_exactly_the_shared_full_chunks(single_process):
    a = single_process["a"]
    (out,) = a["results"]["diverge"]
    assert out["cached"] == len(SHARED) == 1024  # 8 chunks, then the prompts diverge


def test_every_chat_round_hits_all_full_chunks_of_the_rounds_before_it(single_process):
    for instance in ("a", "b"):
        rounds = single_process[instance]["results"]["chat"]
        for previous, current in itertools.pairwise(rounds):
            before = previous["prompt_len"] + len(previous["tokens"]) - 1  # the last answer token was never fed
            assert current["cached"] >= expected_hit(current["prompt_len"], before), instance
    b_rounds = single_process["b"]["results"]["chat"]
    assert b_rounds[0]["cached"] > 0  # a new instance hits the first round too


def test_damaged_chunk_files_are_recomputed_and_the_answers_do_not_change(single_process, model):
    disk, tmp = single_process["disk"], single_process["tmp"]
    files = sorted(disk.glob("chunks/*/*.lmt"))
    assert len(files) > 10
    for path in files[::3]:  # damage every third chunk: header, payload and truncation alike
        data = bytearray(path.read_bytes())
        kind = hash(path.name) % 3
        if kind == 0:
            data[len(data) // 2] ^= 0x01
        elif kind == 1:
            data[50] ^= 0x80
        else:
            data = data[: len(data) // 3]
        path.write_bytes(bytes(data))
    c = engine(tmp, model, "c", disk)
    assert_same_outputs(c, single_process["base"])
    assert c["stats"]["tiers"][1]["corrupt"] > 0
    assert "the engine recomputes them" in c["log"]


def assert_same_tokens_close_logprobs(run: dict, base: dict) -> None:
    """In multiprocess mode vLLM itself computes decode steps differently with and without a
    KV connector configured (the last bits of the logprobs move, the tokens do not): runs
    with lmtier are compared bit for bit with each other, and with the run without lmtier
    for tokens and logprobs to 1e-2."""
    for phase, outs in base["results"].items():
        for got, want in zip(run["results"][phase], outs, strict=True):
            assert got["tokens"] == want["tokens"], phase
            assert np.allclose(got["logprobs"], want["logprobs"], atol=1e-2), phase


def test_the_default_multiprocess_mode(model, tmp_path):
    phases = SCENARIO[:2]
    base = engine(tmp_path, model, "base", None, phases=phases, multiprocess=True)
    disk = tmp_path / "disk"
    a = engine(tmp_path, model, "a", disk, phases=phases, multiprocess=True)
    b = engine(tmp_path, model, "b", disk, phases=phases, multiprocess=True)
    assert_same_outputs(b, a)  # loaded KV answers exactly as computed KV does
    assert_same_tokens_close_logprobs(b, base)
    assert all(b["results"][phase][0]["cached"] > 0 for phase in DOCS)


def test_two_instances_share_through_redis_alone(model, single_process, tmp_path):
    server = RedisServer(tmp_path)
    try:
        a = engine(tmp_path, model, "a", None, shared=server.url)
        assert int(server.call("DBSIZE")) > 0
        b = engine(tmp_path, model, "b", None, shared=server.url)
    finally:
        server.stop()
    base = single_process["base"]
    assert_same_outputs(a, base)
    assert_same_outputs(b, base)
    for phase in DOCS:
        (out,), (a_out,) = b["results"][phase], a["results"][phase]
        assert out["cached"] == expected_hit(out["prompt_len"], out["prompt_len"] + len(a_out["tokens"]) - 1)
    for r, a_r in zip(b["results"]["chat"], a["results"]["chat"], strict=True):  # A stored every round
        assert r["cached"] == expected_hit(r["prompt_len"], a_r["prompt_len"] + len(a_r["tokens"]) - 1)
    assert not (tmp_path / "disk").exists()


def test_two_instances_share_through_the_cache_server_alone(model, single_process, tmp_path):
    server = ServerProcess(tmp_path, "--tier", "cpu://?size=256MiB&slot=256KiB", "--token", "fleet-secret=fleet")
    url = f"grpc://{server.address}?token=fleet-secret"
    try:
        a = engine(tmp_path, model, "a", None, shared=url)
        watcher = open_tier(url)
        assert watcher.stats()["chunks"] > 0
        watcher.close()
        b = engine(tmp_path, model, "b", None, shared=url)
    finally:
        server.stop()
    base = single_process["base"]
    assert_same_outputs(a, base)
    assert_same_outputs(b, base)
    for phase in DOCS:
        (out,), (a_out,) = b["results"][phase], a["results"][phase]
        assert out["cached"] == expected_hit(out["prompt_len"], out["prompt_len"] + len(a_out["tokens"]) - 1)
    remote = b["stats"]["tiers"][1]
    assert remote["errors"] == 0 and remote["shm"] is not None  # same host: bytes through shared memory


def test_tensor_parallel_ranks_store_and_load_their_own_slices(model, tmp_path):
    phases = SCENARIO[:2]
    base = engine(tmp_path, model, "base", None, phases=phases, tp=2)
    disk = tmp_path / "disk"
    a = engine(tmp_path, model, "a", disk, phases=phases, tp=2)
    b = engine(tmp_path, model, "b", disk, phases=phases, tp=2)
    assert_same_outputs(b, a)
    assert_same_tokens_close_logprobs(b, base)
    assert all(b["results"][phase][0]["cached"] > 0 for phase in DOCS)
    names = {p.name for p in disk.glob("chunks/*/*.lmt")}
    assert len(names) % 2 == 0  # one file per chunk per rank
