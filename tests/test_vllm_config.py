"""A bad setting stops an engine as early as vLLM lets a connector look, in one line that
names the key or URL and what is allowed.

vLLM 0.32 hands a connector its settings before the model loads in one place only: while it
validates its configuration, it asks ``requires_piecewise_for_cudagraph`` (on engines with
full CUDA graphs, its default on GPUs) in the process that parses the command line, before
any engine process starts. Elsewhere (CPU builds, ``--enforce-eager``) the first lmtier code
to run is the connector itself, after the model has loaded; it checks its settings first.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_vllm_scheduler import config_for, kv_cache_config
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from lmtier.connectors.vllm import LMTierConnector
from lmtier.connectors.vllm.settings import NOTE_ENV
from lmtier.errors import ConfigError
from lmtier.testing.tinymodel import build

BAD = [
    ({"tiers": ["bogus://cache"]}, "unknown tier scheme 'bogus'; known: "),
    ({"tiers": ["cpu://?sise=1GiB"]}, "unknown option(s) sise in 'cpu://?sise=1GiB'; known: name, pin, size, slot"),
    ({"tiers": ["cpu://?size=lots"]}, "bad value for 'size' in 'cpu://?size=lots'"),
    ({"tiers": ["cpu://?size=1GiB", "redis://cache:6379?timeout=-1"]}, "bad value for 'timeout'"),
    (
        {"tiers": ["grpc://cache:50051?token=s3cret&shm=sometimes"]},
        "bad value for 'shm' in 'grpc://cache:50051?token=***",
    ),
    ({"tyers": ["cpu://"]}, "unknown kv_connector_extra_config keys ['tyers']"),
    ({"save_policy": "sometimes"}, "save_policy must be one of ('always', 'min_tokens', 'reuse')"),
    ({"chunk_tokens": "many"}, "chunk_tokens"),
]


@pytest.mark.parametrize(("extra", "words"), BAD)
def test_vllms_config_validation_refuses_a_bad_setting_in_one_line(extra, words):
    with pytest.raises(ConfigError) as refused:
        LMTierConnector.requires_piecewise_for_cudagraph(extra)
    message = str(refused.value)
    assert words in message
    assert "\n" not in message
    assert "s3cret" not in message


def test_good_settings_pass_and_say_whether_layer_loads_need_piecewise_graphs():
    tiers = ["cpu://?size=1GiB", "file:///var/lib/lmtier?size=100GiB", "redis://cache:6379", "grpc://cache:50051"]
    assert LMTierConnector.requires_piecewise_for_cudagraph({"tiers": tiers}) is False
    assert LMTierConnector.requires_piecewise_for_cudagraph({"tiers": tiers, "layer_loads": True}) is True


def test_vllm_asks_it_with_the_extra_config_while_validating_its_own_config():
    """The hook above is vLLM's, in the installed version: VllmConfig's own validation
    calls it with the connector's extra config (this CPU build never takes that branch, so
    the call itself is checked where vLLM makes it)."""
    source = inspect.getsource(VllmConfig.__post_init__)
    assert "requires_piecewise_for_cudagraph(" in source
    assert "self.kv_transfer_config.kv_connector_extra_config" in source


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build(tmp_path_factory.mktemp("model")))


@pytest.mark.parametrize(("extra", "words"), BAD[:3])
def test_on_a_cpu_engine_the_connector_checks_its_settings_before_it_opens_anything(model, tmp_path, extra, words):
    config = config_for(model, [f"file://{tmp_path}/disk?size=64MiB"])
    config.kv_transfer_config.kv_connector_extra_config = dict(extra)
    with pytest.raises(ConfigError) as refused:
        LMTierConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    assert str(refused.value).startswith(words.split(";")[0])
    assert not (tmp_path / "disk").exists()  # refused before any tier was opened


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_vllm_serve_on_a_cpu_ends_with_lmtiers_one_line_when_a_setting_is_bad(model, tmp_path):
    """``vllm serve`` as a script starts it: the connector finds the bad tier in an engine
    process after the model loaded, and the API process repeats it as its last line, below
    vLLM's "Engine core initialization failed"."""
    transfer = {
        "kv_connector": "LMTierConnector",
        "kv_connector_module_path": "lmtier.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"tiers": ["cpu://?size=64MiB", f"fiel://{tmp_path}/disk"]},
    }
    cmd = [str(Path(sys.executable).parent / "vllm"), "serve", model, "--port", "0", "--dtype", "bfloat16",
           "--enforce-eager", "--block-size", "64", "--max-model-len", "1024", "--kv-transfer-config",
           json.dumps(transfer)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != NOTE_ENV}  # as a shell starts it: a first process
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=840)
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if "resource_tracker" not in line]
    # (this process's registry may hold schemes other tests registered; the server's has lmtier's own)
    assert lines[-1].startswith("lmtier: ConfigError: unknown tier scheme 'fiel'; known: cpu, file, grpc")
    assert "Engine core initialization failed" in lines[-2]
