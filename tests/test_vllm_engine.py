"""lmtier inside real vLLM engines (the CPU build), in separate processes.

Instance A serves prompts and stores their KV; instance B, a new process over the same
disk directory (or the same Redis, or the same cache server), serves them again: its
scheduler must report the expected hits. The same in vLLM's default multiprocess mode and
with tensor parallelism 2, and after chunk files were damaged.

What the answers are compared with. vLLM's CPU attention gives a prefix that comes from a
cache other low bits than one it computes itself (how many depends on the CPU's
instruction set), so a run without any cache is no bit-for-bit reference for a hit. The
reference is vLLM's own prefix cache in the same engine configuration (lmtier's connector
configured, every request opting out of it): an lmtier hit must equal vLLM's own hit of
the same prompt at the same number of cached tokens bit for bit (same KV bytes in, same
computation; the prompts are chosen so that both hit the same number of tokens), and a
run without any cache by greedy tokens, logprobs within ``LOGPROB_TOLERANCE`` (up to a near
tie, where the low bits may pick either token: ``lmtier.testing.engine.compare_answers``). A
chunk whose layers are shifted, stored with valid checksums, must fail that comparison.
"""

from __future__ import annotations

import itertools
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from lmtier.buffers import ALIGN
from lmtier.kv import codec
from lmtier.kv.chunk import Chunk
from lmtier.kv.layout import KVLayout
from lmtier.testing.cache_server import ServerProcess
from lmtier.testing.engine import compare_answers, prefill_problems, run_engine
from lmtier.testing.redis_server import RedisServer
from lmtier.testing.s3_server import S3Server
from lmtier.testing.tinymodel import build
from lmtier.tiers.base import open_tier

from conftest import disk_frames, flip_byte
from test_imports import guarded, loaded, none_loaded

# every test here starts vLLM engines: `make check` leaves them out; the first one that asks
# for a module's engines waits for three runs of them (a minute or two each on a busy machine)
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

CHUNK, BLOCK = 128, 64
OFF = {"lmtier": {"load": False, "save": False}}


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(5, 500, n)]


SHARED = ids(1024, 1)
# One prompt per generate call: requests batched together change the shapes the kernels
# see, and with them the last bits of the logprobs; alone, runs are bit-for-bit repeatable.
# Lengths are chosen so that lmtier (whole chunks of 128 tokens) and vLLM's prefix cache
# (whole blocks of 64) hit the same number of tokens in every request.
SCENARIO = [
    {"name": "doc0", "prompts": [SHARED + ids(300, 2)]},
    {"name": "doc1", "prompts": [ids(700, 3)]},
    {"name": "diverge", "prompts": [SHARED + ids(300, 4)]},
    {"name": "chat", "chat": {"first": ids(520, 5), "questions": [ids(250, 6), ids(250, 7)]}},
]
DOCS = ("doc0", "doc1")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build(tmp_path_factory.mktemp("model")))


def engine(
    tmp: Path,
    model: str,
    name: str,
    disk: Path | None,
    phases=SCENARIO,
    shared: str | None = None,
    env: dict | None = None,
    **spec,
) -> dict:
    """One engine run; lmtier's tiers: host memory, then the disk directory or ``shared``."""
    lmtier = spec.pop("lmtier", None)
    if disk is not None or shared is not None:
        lmtier = {"tiers": ["cpu://?size=256MiB", shared or f"file://{disk}?size=1GiB"], "chunk_tokens": CHUNK}
    spec = {"model": model, "lmtier": lmtier, "block_size": BLOCK, "phases": phases, **spec}
    return run_engine(spec, tmp, name, timeout=600, env=env)


def reference(tmp: Path, model: str, phases=SCENARIO, **spec) -> dict[str, dict]:
    """vLLM's own prefix cache, in the lmtier runs' engine configuration, over ``phases``
    three times: ``first`` (an instance with an empty cache: what A does), ``hit`` (the
    same prompts again, from vLLM's prefix cache: what B's lmtier hits must equal) and
    ``full`` (without reading the prefix cache: the answers of a run without any cache)."""
    passes = {"first": {}, "hit": {}, "full": {"read_prefix_cache": False}}
    run = engine(
        tmp,
        model,
        "reference",
        None,
        phases=[
            {**p, **extra, "name": f"{p['name']}:{tag}", "request": OFF}
            for tag, extra in passes.items()
            for p in phases
        ],
        lmtier={"tiers": ["cpu://?size=64MiB"], "chunk_tokens": CHUNK},
        prefix_caching=True,
        **spec,
    )
    return {tag: {p["name"]: run["results"][f"{p['name']}:{tag}"] for p in phases} for tag in passes}


def expected_hit(prompt_len: int, stored_tokens: int) -> int:
    """Full chunks stored, never the whole prompt (whole blocks before the last token)."""
    return min(stored_tokens // CHUNK * CHUNK, (prompt_len - 1) // BLOCK * BLOCK)


def mismatches(run: dict, hits: dict, full: dict) -> list[str]:
    """Where ``run``'s answers depart from vLLM's own prefix-cache hits (bit for bit, at the
    same number of cached tokens) or from full prefills; empty when they agree everywhere."""
    out = []
    for phase, want in hits.items():
        got = run["results"][phase]
        problems, exact = compare_answers(got, want, full[phase])
        if exact < len(got):
            problems.append(f"cached tokens {[o['cached'] for o in got]}, vLLM's {[o['cached'] for o in want]}")
        out += [f"{phase}: {p}" for p in problems]
    return out


def assert_answers(run: dict, hits: dict, full: dict) -> None:
    problems = mismatches(run, hits, full)
    assert not problems, "\n".join(problems)


def shift_layers(src: Path, dst: Path) -> int:
    """A copy of a disk directory whose chunks hold their layers shifted by one, stored
    with valid checksums: wrong KV that only the engine's answers can reveal."""
    shutil.copytree(src, dst)
    frames = disk_frames(dst)
    for path, offset, length in frames.values():
        with open(path, "r+b") as f:
            f.seek(offset)
            chunk = codec.decode(f.read(length))
            # [layers, 2, tokens, row bytes]: layer l gets layer l-1's keys and values
            shifted = np.roll(np.array(chunk.data), 1, axis=0)
            # as the disk tier writes it: the payload on a page (the header padded)
            frame = codec.encode(Chunk(chunk.key, chunk.layout, shifted, namespace=chunk.namespace), ALIGN)
            assert len(frame) == length
            f.seek(offset)
            f.write(frame)
    return len(frames)


@pytest.fixture(scope="module")
def single_process(model, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("single")
    disk = tmp / "disk"
    runs = {
        "reference": reference(tmp, model),
        # under tests/test_imports.py's guard: lmtier's own imports of gRPC, protobuf and
        # Redis fail, and each engine reports which of lmtier's network modules it loaded
        "a": engine(tmp, model, "a", disk, env=guarded(tmp, "lmtier")),
        "b": engine(tmp, model, "b", disk, env=guarded(tmp, "lmtier")),
        "disk": disk,
        "tmp": tmp,
    }
    shutil.copytree(disk, tmp / "pristine")  # A's and B's chunks, for tests after one that damages ``disk``
    return {**runs, "pristine": tmp / "pristine"}


def test_a_second_instance_hits_what_the_first_stored_and_answers_identically(single_process):
    ref, a, b = single_process["reference"], single_process["a"], single_process["b"]
    assert_answers(a, ref["first"], ref["full"])
    assert_answers(b, ref["hit"], ref["full"])
    # A computed each prompt and its answer: every full chunk of it is on disk.
    for phase in DOCS:
        (out,), (a_out,) = b["results"][phase], a["results"][phase]
        assert out["cached"] == expected_hit(out["prompt_len"], out["prompt_len"] + len(a_out["tokens"]) - 1)
        assert a_out["cached"] == 0


def test_instances_on_memory_and_disk_load_none_of_lmtiers_grpc_protobuf_or_redis_code(single_process):
    # engines A and B (which shared above), and the processes they started
    assert none_loaded(single_process["tmp"], 2), loaded(single_process["tmp"])


def test_each_instance_says_in_one_line_what_it_chose(single_process):
    """Tiers, chunk size, model id and namespace, in vLLM's own log: two instances that
    share hits print the same line."""
    said = {k: re.findall(r"lmtier: vllm connector: (.*)", single_process[k]["log"]) for k in ("a", "b")}
    assert said["a"] and set(said["a"]) == set(said["b"])
    line = said["a"][0]
    assert "chunks of 128 tokens" in line and re.search(r"namespace [0-9a-f]{32}", line)
    assert f"file://{single_process['disk']}?size=1GiB" in line


def test_wrong_kv_with_valid_checksums_fails_the_comparison(single_process, model):
    """The mutation check: the comparison above catches KV that verifies but is wrong."""
    tmp = single_process["tmp"]
    assert shift_layers(single_process["disk"], tmp / "shifted") > 10
    shifted = engine(tmp, model, "shifted", tmp / "shifted")
    b, ref = single_process["b"], single_process["reference"]
    problems = mismatches(shifted, ref["hit"], ref["full"])
    for phase in (*DOCS, "diverge"):  # prompts fixed in advance: the same hits as B's, wrong answers
        assert shifted["results"][phase][0]["cached"] == b["results"][phase][0]["cached"] > 0
        wrong = f"{phase}: answer 0: differs from vLLM's own prefix-cache hit"
        assert any(p.startswith(wrong) for p in problems), problems


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
    frames = sorted(disk_frames(disk).values())
    assert len(frames) > 10
    for i, (path, offset, length) in enumerate(frames[::3]):  # every third chunk: header, payload, torn
        if i % 3 == 0:
            flip_byte(path, offset + length // 2)
        elif i % 3 == 1:
            flip_byte(path, offset + 50, 0x80)
        else:
            with open(path, "r+b") as f:  # its last two thirds never written
                f.seek(offset + length // 3)
                f.write(bytes(length - length // 3))
    c = engine(tmp, model, "c", disk)
    ref = single_process["reference"]
    assert c["stats"]["tiers"][1]["corrupt"] > 0
    assert "the engine recomputes them" in c["log"]
    # A damaged chunk is found when the worker reads it, after the scheduler counted it as
    # cached: vLLM recomputes from there, so the hit a request reports says nothing of what
    # was loaded, and full prefills are the reference (greedy tokens, logprobs' tolerance).
    for phase, outs in c["results"].items():
        assert prefill_problems(outs, ref["full"][phase]) == [], phase
    assert sum(o["cached"] for outs in c["results"].values() for o in outs) > 0  # the intact chunks still load


def two_instances(tmp: Path, model: str, ref: dict | None = None, **spec) -> Path:
    """A and B over one fresh directory, in the engine configuration ``spec``, against
    ``ref`` (by default vLLM's own answers in that configuration); returns the directory."""
    phases = SCENARIO[:2]
    if ref is None:
        ref = reference(tmp, model, phases=phases, **spec)
    ref = {tag: {p["name"]: runs[p["name"]] for p in phases} for tag, runs in ref.items()}
    disk = tmp / "disk"
    a = engine(tmp, model, "a", disk, phases=phases, **spec)
    b = engine(tmp, model, "b", disk, phases=phases, **spec)
    assert_answers(a, ref["first"], ref["full"])
    assert_answers(b, ref["hit"], ref["full"])
    assert all(b["results"][phase][0]["cached"] > 0 for phase in DOCS)
    return disk


def test_the_default_multiprocess_mode(model, single_process, tmp_path):
    """The engine core in a process of its own (vLLM's default) runs the same forward pass
    as the single-process engines: its answers are checked against their reference."""
    two_instances(tmp_path, model, ref=single_process["reference"], multiprocess=True)


def assert_b_hit_what_a_stored(a, b, ref) -> None:
    """A answered as vLLM's first pass, B as vLLM's own prefix-cache hit, and B's documents
    hit everything A stored of them (whole chunks of the prompt and A's answer)."""
    assert_answers(a, ref["first"], ref["full"])
    assert_answers(b, ref["hit"], ref["full"])
    for phase in DOCS:
        (out,), (a_out,) = b["results"][phase], a["results"][phase]
        assert out["cached"] == expected_hit(out["prompt_len"], out["prompt_len"] + len(a_out["tokens"]) - 1)


def test_layer_by_layer_loads_answer_as_vllms_own_prefix_hits(model, single_process, tmp_path):
    """layer_loads (the GPU path's layer-by-layer copies; a CPU engine lands every layer
    before the forward pass, each chunk verified whole first), in a real engine: a new
    instance over A's disk answers bit for bit as vLLM's own prefix-cache hits."""
    disk = tmp_path / "disk"
    shutil.copytree(single_process["pristine"], disk)
    lmtier = {"tiers": ["cpu://?size=256MiB", f"file://{disk}?size=1GiB"], "chunk_tokens": CHUNK, "layer_loads": True}
    b = engine(tmp_path, model, "b_layers", None, lmtier=lmtier)
    assert_b_hit_what_a_stored(single_process["a"], b, single_process["reference"])


def test_two_instances_share_through_redis_alone(model, single_process, tmp_path):
    server = RedisServer(tmp_path)
    try:
        a = engine(tmp_path, model, "a", None, shared=server.url)
        assert int(server.call("DBSIZE")) > 0
        b = engine(tmp_path, model, "b", None, shared=server.url)
    finally:
        server.stop()
    assert_b_hit_what_a_stored(a, b, single_process["reference"])
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
    assert_b_hit_what_a_stored(a, b, single_process["reference"])
    remote = b["stats"]["tiers"][1]
    # same host, one tenant: B read the server's memory through its published directory
    assert remote["errors"] == 0 and remote["directory_reads"] > 0


def test_two_instances_share_through_an_object_store_alone(model, single_process, tmp_path):
    server = S3Server.start(tmp_path / "s3")
    url = server.url("fleet", size="1GiB")
    try:
        a = engine(tmp_path, model, "a", None, shared=url)
        b = engine(tmp_path, model, "b", None, shared=url)
    finally:
        server.stop()
    assert_b_hit_what_a_stored(a, b, single_process["reference"])
    remote = b["stats"]["tiers"][1]
    assert remote["tier"] == "s3" and remote["errors"] == 0 and remote["bytes_loaded"] > 0
    assert remote["chunks"] > 0 and remote["used_bytes"] <= remote["capacity_bytes"]


def test_tensor_parallel_ranks_open_a_fresh_directory_and_share_their_own_slices(model, tmp_path):
    """Both ranks of a TP=2 engine open one new directory at the same moment."""
    disk = two_instances(tmp_path, model, tp=2)
    n = len(disk_frames(disk))
    assert n > 0 and n % 2 == 0  # each chunk once per rank


def test_one_damaged_layer_of_one_chunk_is_recomputed_alone(model, single_process, tmp_path):
    """The cache server's memory reaches a same-host engine through shared memory and is
    verified in the engine: a flipped byte in one layer of one chunk fails that chunk
    alone (its two blocks are reported; vLLM recomputes from there), the chunks after it
    still load, and the answer is unchanged."""
    shm = tmp_path / "shm"
    shm.mkdir()
    server = ServerProcess(
        tmp_path, "--tier", "cpu://?size=64MiB&slot=256KiB", "--shm-dir", str(shm), "--token", "s=fleet"
    )
    url = f"grpc://{server.address}?token=s&shm_dir={shm}"
    phases = [p for p in SCENARIO if p["name"] == "doc1"]  # 700 tokens: five full chunks, in slots 0-4
    try:
        engine(tmp_path, model, "a", None, phases=phases, shared=url)
        (slab,) = [p for p in shm.iterdir() if p.stat().st_size == 64 << 20]  # the server's memory
        layer_bytes = KVLayout(4, 2, 64, "bfloat16").chunk_bytes(CHUNK) // 4
        with open(slab, "r+b") as f:  # layer 1 of the chunk in slot 2
            f.seek(2 * (256 << 10) + layer_bytes + 5)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x10]))
        b = engine(tmp_path, model, "b", None, phases=phases, shared=url)
    finally:
        server.stop()
    assert re.findall(r"lmtier: (\d+) of (\d+) blocks of \S+ not loaded", b["log"]) == [("2", "10")]
    assert prefill_problems(b["results"]["doc1"], single_process["reference"]["full"]["doc1"]) == []
