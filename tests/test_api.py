"""The embedded API, as its documentation page (docs/embedded-api.md) shows it to integrators."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lmtier
from lmtier.errors import LayoutError
from lmtier.tiers.base import register_tier
from lmtier.tiers.cpu import CpuTier


def test_the_documented_example_runs_as_pasted():
    """The embedded-API page's example, executed as it stands."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "embedded-api.md").read_text()
    block = page.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(block, "docs/embedded-api.md", "exec"), {})


def test_the_readme_example():
    store = lmtier.open_store(
        ["cpu://?size=1GiB"],
        model="my-model",
        layout=lmtier.KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
    )
    tokens = list(range(700))
    kv = torch.randn(32, 2, 700, 8, 128).to(torch.bfloat16)
    stored = store.put(tokens, kv)
    assert stored == 512  # full chunks only
    hit = store.lookup(tokens)
    assert hit == 512
    kv2 = store.get(tokens[:hit])
    assert kv2.shape == (32, 2, 512, 8, 128) and kv2.dtype == torch.bfloat16
    assert torch.equal(kv2, kv[:, :, :512])
    store.close()


def test_a_second_prompt_sharing_a_prefix_hits_that_prefix_only():
    layout = lmtier.KVLayout(4, 2, 32, "float16")
    with lmtier.open_store(["cpu://?size=64MiB"], model="m", layout=layout, chunk_tokens=32) as store:
        a = torch.arange(200)
        kv = torch.randn(layout.tensor_shape(200)).half()
        store.put(a, kv)
        b = torch.cat([a[:100], torch.arange(5000, 5100)])
        assert store.lookup(b) == 96
        assert torch.equal(store.get(b), kv[:, :, :96])


def test_min_tokens_leaves_short_prompts_out_of_the_embedded_store():
    layout = lmtier.KVLayout(2, 2, 32, "float16")
    tiers = ["cpu://?size=16MiB"]
    with lmtier.open_store(tiers, model="m", layout=layout, chunk_tokens=32, save_policy="min_tokens",
                           min_tokens=128) as store:  # fmt: skip
        short, long = torch.arange(96), torch.arange(1000, 1128)
        assert store.put(short, torch.randn(layout.tensor_shape(96)).half()) == 0
        assert store.lookup(short) == 0
        assert store.put(long, torch.randn(layout.tensor_shape(128)).half()) == 128
        assert store.lookup(long) == 128


def test_mla_layouts_take_one_latent_per_token():
    layout = lmtier.KVLayout(num_layers=3, num_kv_heads=1, head_dim=576, dtype="bfloat16", mla=True)
    with lmtier.open_store(model="deepseek", layout=layout, chunk_tokens=64) as store:
        kv = torch.randn(3, 130, 576).to(torch.bfloat16)  # [layers, tokens, latent]
        assert store.put(range(130), kv) == 128
        got = store.get(range(130))
        assert got.shape == (3, 128, 576)
        assert torch.equal(got, kv[:, :128])


def test_numpy_kv_and_get_into_a_preallocated_tensor():
    layout = lmtier.KVLayout(2, 2, 16, "float32")
    with lmtier.open_store(["cpu://?size=8MiB"], model="m", layout=layout, chunk_tokens=16) as store:
        kv = np.random.default_rng(0).standard_normal(layout.tensor_shape(64)).astype(np.float32)
        assert store.put(np.arange(64), kv) == 64
        out = torch.zeros(layout.tensor_shape(80))
        assert store.get_into(np.arange(64), out) == 64
        assert np.array_equal(out[:, :, :64].numpy(), kv)
        assert not out[:, :, 64:].any()


def test_a_strided_kv_view_is_stored_without_a_contiguous_copy():
    layout = lmtier.KVLayout(2, 2, 16, "float16")
    big = torch.randn(2, 2, 128, 2, 16).half()
    view = big[:, :, 32:96]  # not contiguous
    with lmtier.open_store(["cpu://?size=8MiB"], model="m", layout=layout, chunk_tokens=16) as store:
        assert store.put(range(64), view) == 64
        assert torch.equal(store.get(range(64)), view)


@pytest.mark.parametrize(
    ("kv", "match"),
    [
        (torch.zeros(4, 2, 64, 2, 8), "shape"),  # wrong head dim
        (torch.zeros(4, 2, 63, 2, 16), "shape"),  # tokens disagree
        (torch.zeros(4, 64, 2, 16), "shape"),  # missing K/V axis
        (torch.zeros(4, 2, 64, 2, 16, dtype=torch.float16), "dtype"),
        (torch.zeros(4, 2, 64, 16, 2).transpose(3, 4), "contiguous"),
    ],
)
def test_bad_arguments_raise_clearly(kv, match):
    layout = lmtier.KVLayout(4, 2, 16, "float32")
    with lmtier.open_store(["cpu://?size=8MiB"], model="m", layout=layout, chunk_tokens=16) as store:
        with pytest.raises(LayoutError, match=match):
            store.put(range(64), kv)
        assert store.lookup(range(64)) == 0


class BrokenTier(CpuTier):
    """Fault injection: every call fails."""

    scheme = "broken"

    def contains(self, keys):
        raise ConnectionError("down")

    get = put = contains


def test_tier_failures_never_raise_from_lookup_get_or_put():
    register_tier("broken", "test_api:BrokenTier")
    layout = lmtier.KVLayout(2, 2, 16, "float16")
    with lmtier.open_store(["broken://?size=1MiB"], model="m", layout=layout, chunk_tokens=16) as store:
        kv = torch.randn(layout.tensor_shape(32)).half()
        assert store.put(range(32), kv) == 0
        assert store.lookup(range(32)) == 0
        assert store.get(range(32)).shape == (2, 2, 0, 2, 16)


def test_configuration_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LMTIER_TIERS", "cpu://?size=4MiB&name=envtier")
    monkeypatch.setenv("LMTIER_CHUNK_TOKENS", "32")
    layout = lmtier.KVLayout(2, 2, 16, "float16")
    with lmtier.open_store(model="m", layout=layout) as store:
        assert store.chunk_tokens == 32
        assert store.store.tiers[0].name == "envtier"
    with lmtier.open_store(["cpu://?size=4MiB"], model="m", layout=layout, chunk_tokens=64) as store:
        assert store.chunk_tokens == 64  # arguments win over the environment


def test_preset_names_are_accepted_as_layouts():
    with lmtier.open_store(["cpu://?size=64MiB"], model="m", layout="llama-3-8b", chunk_tokens=16) as store:
        assert store.layout.bytes_per_token == 128 * 1024


def test_the_core_runs_without_importing_torch():
    """The cache server and sidecar install the core without torch: keep it that way."""
    import subprocess
    import sys

    script = (
        "import sys, numpy as np, lmtier;"
        "layout = lmtier.KVLayout(2, 2, 8, 'float32');"
        "s = lmtier.open_store(['cpu://?size=1MiB'], model='m', layout=layout, chunk_tokens=8);"
        "kv = np.ones(layout.tensor_shape(16), np.float32);"
        "assert s.put(np.arange(16), kv) == 16 and s.lookup(np.arange(16)) == 16;"
        "out = np.zeros_like(kv); assert s.get_into(np.arange(16), out) == 16 and (out == kv).all();"
        "s.close(); assert 'torch' not in sys.modules, 'torch was imported'"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_a_tier_unreachable_at_start_misses_and_a_misconfigured_one_is_an_error():
    from lmtier.errors import ConfigError
    from lmtier.testing.redis_server import free_port

    layout = lmtier.KVLayout(2, 2, 16, "float32")
    down = f"redis+cluster://127.0.0.1:{free_port()}?connect_timeout=0.2&timeout=0.2"
    with lmtier.open_store(["cpu://?size=8MiB", down], model="m", layout=layout, chunk_tokens=16) as store:
        kv = torch.randn(layout.tensor_shape(64))
        assert store.put(range(64), kv) == 64  # memory serves; the shared tier misses
        assert torch.equal(store.get(range(64)), kv)
        shared = store.stats()["tiers"][1]
        assert shared["state"] == "unavailable" and "CLUSTER SLOTS" in shared["error"]
    with pytest.raises(ConfigError, match="bad host:port in"):
        lmtier.open_store(["cpu://?size=8MiB", "redis+cluster://127.0.0.1:port"], model="m", layout=layout)
