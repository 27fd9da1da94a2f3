"""``lmtier keys`` against a vLLM engine on CPU: that engine's namespace holds its engine
identity (block size, instruction set), which it logs at start. Given that string as
logged, ``lmtier keys --engine`` prints the engine's own digest; without it, a note says
why the digest differs and where to read the identity. The connector here is vLLM's
real one, made from a CPU engine's configuration (no engine started)."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from lmtier.cli import main
from lmtier.connectors.vllm import LMTierConnector
from lmtier.testing.tinymodel import build

BLOCK = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build(tmp_path_factory.mktemp("model")))


def cpu_engine_config(model: str, disk: str) -> VllmConfig:
    """A CPU engine's configuration with lmtier and the automatic chunk size."""
    transfer = KVTransferConfig(
        kv_connector="LMTierConnector",
        kv_connector_module_path="lmtier.connectors.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"tiers": [f"file://{disk}?size=64MiB"]},
    )
    cache = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=False)
    cache.num_gpu_blocks = 64
    return VllmConfig(
        model_config=ModelConfig(model=model, dtype="bfloat16", max_model_len=2048),
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )


@pytest.fixture(scope="module")
def engine_start(model, tmp_path_factory):
    """The connector of a CPU engine, and its start-up log line."""
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    cache = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    config = cpu_engine_config(model, str(tmp_path_factory.mktemp("disk")))
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    keep, logger = Keep(), logging.getLogger("lmtier")
    logger.addHandler(keep)
    level = logger.level
    logger.setLevel(logging.INFO)  # setLevel: its children's cached levels are cleared too
    try:
        connector = LMTierConnector(config, KVConnectorRole.SCHEDULER, cache)
    finally:
        logger.removeHandler(keep)
        logger.setLevel(level)
    (line,) = [x for x in lines if "engine identity" in x]
    return connector, line


def keys(capsys, model: str, tmp_path, *args: str) -> tuple[dict, str]:
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(list(range(1000))))
    argv = ["keys", "--config", f"{model}/config.json", "--tokens-file", str(prompt), "--json", *args]
    assert main(argv) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def test_keys_with_the_identity_as_logged_prints_the_engines_digest(engine_start, model, tmp_path, capsys):
    connector, line = engine_start
    logged = re.search(r"engine identity ('[^']+')", line).group(1)  # quotes and all, as a user copies it
    assert logged.strip("'") == connector.namespaces[0].engine
    assert logged.startswith("'vllm-cpu/block=64/isa=")
    out, err = keys(capsys, model, tmp_path, "--engine", logged)  # no --block-size: the identity says 64
    assert out["namespace_digest"] == connector.namespaces[0].digest.hex()
    assert f"namespace {out['namespace_digest']} " in line  # the digest the engine logged
    assert out["namespace"]["chunk_tokens"] == connector.chunk_tokens
    assert "note" not in err


def test_keys_without_the_identity_says_why_its_digest_differs(engine_start, model, tmp_path, capsys):
    connector, _ = engine_start
    out, err = keys(capsys, model, tmp_path, "--block-size", str(BLOCK))
    assert out["namespace_digest"] != connector.namespaces[0].digest.hex()
    (note,) = [x for x in err.splitlines() if "note" in x]
    assert "no --engine" in note and "engine identity 'vllm-cpu/block=N/isa=...'" in note and "--engine" in note


def test_an_identity_of_another_block_size_is_refused(engine_start, model, tmp_path, capsys):
    connector, _ = engine_start
    prompt = tmp_path / "prompt.json"
    prompt.write_text("[1, 2, 3]")
    argv = ["keys", "--config", f"{model}/config.json", "--tokens-file", str(prompt)]
    assert main([*argv, "--engine", connector.namespaces[0].engine, "--block-size", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "blocks of 64 tokens, not --block-size 16" in err
