"""What ``lmtier stats`` and ``lmtier inspect`` report, against a real cache server and a
real disk tier: no figure that means nothing (the sum of a server's tiers' bytes), no
label the data cannot support (the attention kind of a stored chunk)."""

from __future__ import annotations

import json

from lmtier.cli import main
from lmtier.kv.chunk import release_all
from lmtier.kv.layout import from_hf_config
from lmtier.testing.cache_server import ServerProcess
from lmtier.tiers.base import open_tier
from lmtier.units import format_bytes

from conftest import eventually, make_namespace, make_prompt


def test_lmtier_stats_headline_says_what_each_tier_holds_not_their_sum(tmp_path, capsys):
    """4 chunks, each in memory and on disk: the server holds 4 chunks, not the bytes of 8.
    The headline names each tier's chunks, bytes and capacity; nothing adds them up."""
    server = ServerProcess(
        tmp_path, "--tier", "cpu://?size=16MiB&slot=64KiB", "--tier", f"file://{tmp_path / 'disk'}?size=64MiB"
    )
    client = open_tier(f"grpc://{server.address}?shm=off")
    try:
        client.put(make_prompt(4, seed=9).chunks())

        def stats() -> dict:
            assert main(["stats", "--server", f"grpc://{server.address}", "--json"]) == 0
            return json.loads(capsys.readouterr().out)

        assert eventually(lambda: stats()["tiers"][1]["chunks"] == 4)  # the disk is written in the background
        out = stats()
        memory, disk = out["tiers"]
        assert memory["chunks"] == disk["chunks"] == out["chunks"] == 4
        assert "used_bytes" not in out  # the sum of both tiers is held nowhere
        assert main(["stats", "--server", f"grpc://{server.address}"]) == 0
        headline, *per_tier = capsys.readouterr().out.splitlines()
    finally:
        client.close()
        server.stop()
    assert headline.startswith(f"{server.address}: 4 distinct chunks, hit ratio ")
    assert f"; cpu holds 4 chunks, {format_bytes(memory['used_bytes'])} of 16 MiB;" in headline
    assert headline.endswith(f"; disk holds 4 chunks, {format_bytes(disk['used_bytes'])} of 64 MiB")
    assert format_bytes(memory["used_bytes"] + disk["used_bytes"]) not in headline
    assert per_tier[0].split()[:2] == ["cpu", "4"] and per_tier[1].split()[:2] == ["disk", "4"]  # kept


def test_inspect_names_the_attention_kind_only_when_it_knows_it(tmp_path, capsys):
    """A chunk's frame records its KV heads, not the query heads: 2 KV heads of a model with
    16 query heads were listed as MHA. Without the model no kind is named; with its config
    (or preset) its kind is, for a tensor-parallel rank's chunks too (1 KV head: not MQA)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 2,
                                  "head_dim": 32, "hidden_size": 512, "torch_dtype": "float16"}))  # fmt: skip
    layout = from_hf_config(config)
    root = tmp_path / "disk"
    tier = open_tier(f"file://{root}?size=64MiB")
    tier.put(make_prompt(2, seed=7, namespace=make_namespace(layout)).chunks())
    tier.put(make_prompt(2, seed=8, namespace=make_namespace(layout.shard(2), tp_rank=1, tp_size=2)).chunks())
    tier.close()

    assert main(["inspect", str(root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["chunks_list"]
    assert len(rows) == 4 and all(r["attention"] is None for r in rows)
    assert sorted(r["layout"] for r in rows) == [
        "2 layers x 1 KV heads x 32 head dim, float16",
        "2 layers x 1 KV heads x 32 head dim, float16",
        "2 layers x 2 KV heads x 32 head dim, float16",
        "2 layers x 2 KV heads x 32 head dim, float16",
    ]
    assert main(["inspect", str(root)]) == 0
    text = capsys.readouterr().out
    assert "MHA" not in text and "MQA" not in text

    assert main(["inspect", str(root), "--config", str(config), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["chunks_list"]
    assert [r["attention"] for r in rows] == ["GQA"] * 4
    assert main(["inspect", str(root), "--config", str(config)]) == 0
    assert capsys.readouterr().out.count("head dim (GQA), float16") == 4
    assert main(["inspect", str(root), "--model", "llama-3-8b", "--json"]) == 0  # another model: no kind
    assert [r["attention"] for r in json.loads(capsys.readouterr().out)["chunks_list"]] == [None] * 4


def test_lmtier_stats_counts_the_loads_a_same_host_client_read_from_the_published_directory(tmp_path, capsys):
    """A client on the server's host reads chunks straight from the server's memory (the
    published directory: no call per load). Its reads reach the server's counts within a
    moment, the last ones at the latest when it closes: ``lmtier stats`` shows them."""
    (tmp_path / "shm").mkdir()
    server = ServerProcess(tmp_path, "--tier", "cpu://?size=16MiB", "--shm-dir", str(tmp_path / "shm"))
    writer = open_tier(f"grpc://{server.address}?shm=off")
    prompts = [make_prompt(4, seed=s) for s in range(3)]
    for p in prompts:
        writer.put(p.chunks())
    writer.close()
    reader = open_tier(f"grpc://{server.address}?shm_dir={tmp_path / 'shm'}")

    def memory() -> dict:
        assert main(["stats", "--server", f"grpc://{server.address}", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["tiers"][0]["counters"]

    try:
        assert eventually(lambda: reader.contains(prompts[0].keys) == 4 and reader.directory.reader() is not None)
        for p in prompts[:2]:
            got = reader.get(p.keys)
            assert [c.tobytes() for c in got] == [p.chunk_bytes(i) for i in range(4)]
            release_all(got)
        assert reader.stats()["directory_reads"] == 8  # no call carried them
        assert eventually(lambda: memory().get("directory_reads") == 8)  # reported within a moment
        got = reader.get(prompts[2].keys)
        release_all(got)
    finally:
        reader.close()  # the last reads reported as it closes
    try:
        counters = memory()
        assert counters["directory_reads"] == 12 and counters["hits"] >= 12
        assert main(["stats", "--server", f"grpc://{server.address}"]) == 0
        assert "directory_reads 12" in capsys.readouterr().out
    finally:
        server.stop()
