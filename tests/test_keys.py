"""Keys: deterministic across processes, chained over prefixes, namespaced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from lmtier.cli import main
from lmtier.errors import LayoutError
from lmtier.kv.keys import Namespace, as_token_array, chunk_keys
from lmtier.kv.layout import KVLayout, preset

LAYOUT = preset("llama-3-8b")
NS = Namespace(model="meta-llama/Meta-Llama-3-8B", layout=LAYOUT, chunk_tokens=256)
TOKENS = list(range(1000, 1000 + 256 * 4 + 100))


def test_one_key_per_full_chunk_and_the_tail_gets_none():
    keys = NS.keys(TOKENS)
    assert len(keys) == 4
    assert all(len(k) == 16 for k in keys)
    assert len(set(keys)) == 4
    assert NS.keys(TOKENS[:255]) == []


def test_lists_numpy_and_torch_give_the_same_keys():
    expected = NS.keys(TOKENS)
    assert NS.keys(np.array(TOKENS, dtype=np.int64)) == expected
    assert NS.keys(np.array(TOKENS, dtype=np.uint32)) == expected
    assert NS.keys(torch.tensor(TOKENS)) == expected
    assert NS.keys(torch.tensor(TOKENS, dtype=torch.int32)) == expected


def test_a_key_covers_its_whole_prefix():
    other = list(TOKENS)
    other[300] += 1  # differs inside chunk 1
    a, b = NS.keys(TOKENS), NS.keys(other)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def test_keys_agree_across_processes_with_different_hash_seeds(tmp_path):
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(TOKENS))
    script = (
        "import json, sys; from lmtier.kv.keys import Namespace; from lmtier.kv.layout import preset;"
        "ns = Namespace(model='meta-llama/Meta-Llama-3-8B', layout=preset('llama-3-8b'), chunk_tokens=256);"
        "print(json.dumps([k.hex() for k in ns.keys(json.load(open(sys.argv[1])))]))"
    )
    outputs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run(
            [sys.executable, "-c", script, str(prompt)], env=env, capture_output=True, text=True, check=True
        )
        outputs.append(json.loads(run.stdout))
    assert outputs[0] == outputs[1] == [k.hex() for k in NS.keys(TOKENS)]


@pytest.mark.parametrize(
    "change",
    [
        {"model": "meta-llama/Meta-Llama-3-8B-Instruct"},
        {"revision": "abc123"},
        {"layout": LAYOUT.with_dtype("fp16")},
        {"layout": LAYOUT.with_dtype("fp8")},
        {"layout": replace(LAYOUT, num_layers=31)},
        {"layout": replace(LAYOUT, num_kv_heads=4)},
        {"layout": replace(LAYOUT, head_dim=64)},
        {"layout": KVLayout(32, 1, 128, mla=True)},
        {"tp_rank": 1, "tp_size": 2},
        {"tp_size": 2},
        {"pp_rank": 1, "pp_size": 2},
        {"salt": "tenant-a"},
        {"hash": "sha256"},
        {"format_version": 2},
    ],
)
def test_changing_any_namespace_field_changes_every_key(change):
    other = replace(NS, **change)
    assert other.digest != NS.digest
    assert not set(other.keys(TOKENS)) & set(NS.keys(TOKENS))


def test_chunk_size_changes_every_key():
    other = replace(NS, chunk_tokens=128)
    assert not set(other.keys(TOKENS)) & set(NS.keys(TOKENS))


def test_sha256_keys_are_32_bytes():
    keys = chunk_keys(TOKENS, replace(NS, hash="sha256"))
    assert [len(k) for k in keys] == [32] * 4


def test_namespace_ignores_the_attention_head_count_which_does_not_change_bytes():
    assert replace(NS, layout=replace(LAYOUT, num_attention_heads=None)).digest == NS.digest


@pytest.mark.parametrize("bad", [[[1, 2], [3, 4]], [1.5, 2.0], [-1, 5], [2**31], ["a"]])
def test_bad_token_ids_are_refused_clearly(bad):
    with pytest.raises(LayoutError):
        as_token_array(bad)


def test_keys_cli_prints_the_namespace_and_one_key_per_chunk(tmp_path, capsys):
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(TOKENS))
    assert main(["keys", "--model", "llama-3-8b", "--tokens-file", str(prompt), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ns = replace(NS, model="llama-3-8b")
    assert out["namespace_digest"] == ns.digest.hex()
    assert [k["key"] for k in out["keys"]] == [k.hex() for k in ns.keys(TOKENS)]
    assert out["keys"][1]["tokens"] == [256, 512]
    assert main(["keys", "--model", "llama-3-8b", "--tokens-file", str(prompt), "--salt", "t1"]) == 0
    text = capsys.readouterr().out
    assert "100-token tail is not cached" in text
    assert ns.keys(TOKENS)[0].hex() not in text  # another salt, other keys


def test_keys_cli_picks_the_chunk_size_an_engine_connector_would(tmp_path, capsys):
    """With --block-size, chunk_tokens=auto: llama-3-8b (128 KiB per token) on vLLM's GPU
    block of 16 tokens is one block per chunk, as the vLLM connector chooses."""
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(TOKENS))
    args = ["keys", "--model", "llama-3-8b", "--tokens-file", str(prompt), "--json"]
    assert main([*args, "--block-size", "16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["namespace"]["chunk_tokens"] == 16
    assert out["keys"][1]["tokens"] == [16, 32]
    assert main([*args, "--block-size", "16", "--chunk-tokens", "64"]) == 0  # explicit wins
    assert json.loads(capsys.readouterr().out)["namespace"]["chunk_tokens"] == 64


def test_keys_cli_rejects_a_file_that_is_not_a_token_list(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"tokens": 1}')
    assert main(["keys", "--model", "llama-3-8b", "--tokens-file", str(bad)]) == 2
    assert "JSON list" in capsys.readouterr().err
