"""The object-storage tier where users reach it without an engine: behind ``lmtier serve``,
in the embedded API, in ``lmtier stats`` (the server's counters, and the bucket listed),
``lmtier keys`` (which chunks of a prompt the bucket holds) and ``lmtier size``."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

import lmtier
from lmtier.kv.chunk import release_all
from lmtier.testing.cache_server import ServerProcess
from lmtier.tiers.base import open_tier

from conftest import eventually, make_prompt


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmtier", *args], capture_output=True, text=True, timeout=120)


def test_a_cache_server_keeps_its_chunks_in_the_bucket_across_a_restart(s3_server, tmp_path):
    bucket = s3_server.url("serve", size="256MiB", relist=0)
    tiers = ["--tier", "cpu://?size=64MiB", "--tier", bucket]
    server = ServerProcess(tmp_path / "one", *tiers)
    prompts = [make_prompt(4, seed=s) for s in range(3)]
    try:
        client = open_tier(f"grpc://{server.address}")
        for p in prompts:
            client.put(p.chunks())
        client.close()

        def s3() -> dict:
            return json.loads(cli("stats", "--server", f"grpc://{server.address}", "--json").stdout)["tiers"][1]

        assert eventually(lambda: s3()["chunks"] == 12)  # the server writes its lower tiers behind
        assert s3()["name"] == "s3" and s3()["counters"]["requests_put"] >= 12
    finally:
        server.stop()
    listed = json.loads(cli("stats", "--bucket", bucket, "--json").stdout)
    assert listed["chunks"] == 12 and listed["complete"] and listed["other_objects"] == 0
    for bad in (bucket.replace("s3://lmtier", "s3://key:hush-hush@lmtier"), bucket.replace("/serve?", "/a//b?"),
                bucket.replace("endpoint=http://", "endpoint=http://key:hush-hush@")):  # fmt: skip
        refused = cli("stats", "--bucket", bad)
        assert refused.returncode != 0 and "hush-hush" not in refused.stdout + refused.stderr
    again = ServerProcess(tmp_path / "two", *tiers)  # memory empty: what it serves comes from the bucket
    try:
        client = open_tier(f"grpc://{again.address}")
        for p in prompts:
            got = client.get(p.keys)
            assert [c.tobytes() for c in got] == [p.chunk_bytes(i) for i in range(4)]
            release_all(got)
        client.close()
    finally:
        again.stop()


def test_the_embedded_api_over_a_bucket(s3_server):
    url = s3_server.url("embedded", size="64MiB", relist=0)
    layout = lmtier.KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16")
    tokens = list(range(700))
    kv = np.random.default_rng(1).integers(0, 256, (2, 2, 700, 2, 64), dtype=np.uint8)
    kv = kv.view(np.float16)
    store = lmtier.open_store([url], model="m", layout=layout, chunk_tokens=128)
    try:
        assert store.put(tokens, kv) == 640
        store.flush()
    finally:
        store.close()
    again = lmtier.open_store(["cpu://?size=16MiB", url], model="m", layout=layout, chunk_tokens=128)
    try:
        assert again.lookup(tokens) == 640
        out = np.zeros((2, 2, 640, 2, 32), dtype=np.float16)
        assert again.get_into(tokens[:640], out) == 640
        assert out.tobytes() == kv[:, :, :640].tobytes()
    finally:
        again.close()


def test_keys_says_which_chunks_of_a_prompt_the_bucket_holds(s3_server, tmp_path):
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(list(range(40))))
    argv = ["keys", "--model", "qwen2.5-7b", "--chunk-tokens", "8", "--tokens-file", str(prompt), "--json"]
    keys = [bytes.fromhex(k["key"]) for k in json.loads(cli(*argv).stdout)["keys"]]
    assert len(keys) == 5
    url = s3_server.url("keys", relist=0)
    tier = open_tier(url)
    try:
        chunks = make_prompt(2).chunks()
        tier.put([type(c)(k, c.layout, c.data, namespace=c.namespace) for k, c in zip(keys, chunks, strict=False)])
    finally:
        tier.close()
    out = json.loads(cli(*argv, "--bucket", url).stdout)
    assert [k["in_bucket"] for k in out["keys"]] == [True, True, False, False, False]
    text = cli(*argv[:-1], "--bucket", url).stdout
    assert text.count("  in the bucket") == 2 and text.count("not in the bucket") == 3


def test_stored_evicted_and_deleted_chunks_are_told_as_events(s3_server):
    """What routers hear of an object store: its stores, what it deleted to stay within its
    size, and deletes (the labels, STORAGE and REMOTE, come from the vLLM side)."""
    from lmtier.kv import codec
    from lmtier.store.tiered import TieredStore

    a, b = make_prompt(4, seed=1), make_prompt(4, seed=2)
    frame = codec.encoded_size(a.chunks()[0])
    tier = open_tier(s3_server.url("events", size=str(6 * frame), relist=0))
    with TieredStore([tier]) as store:
        events = store.watch()
        store.put(a.chunks())
        store.put(b.chunks())  # room for six: two of a's go, tail first
        assert store.flush()
        store.delete(b.keys[3:])
        records = [(r.kind, list(r.keys)) for r in events.drain()]
    assert records[0] == ("stored", a.keys) and records[-1] == ("removed", b.keys[3:])
    removed = [k for kind, keys in records[1:-1] if kind == "removed" for k in keys]
    assert sorted(removed) == sorted(a.keys[2:])  # a's tail, deleted to make room
    assert ("stored", b.keys) in records
