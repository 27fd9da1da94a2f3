"""Import SGLang's cache code on a CPU-only machine, and build its real host pools.

SGLang 0.5.23 is installed without its CUDA dependencies (scripts/setup-venv.sh). Its
``memory_pool`` module pulls in model configs that import torchvision at module level, and
PyPI's torchvision does not load beside the CPU build of torch: ``use()`` puts an inert
stand-in for torchvision on the import path when the real one is absent, used only while
SGLang's modules are imported (nothing of torchvision runs in the cache code). ``unuse()``
takes it away again, so later tests in the same process see the machine as it is.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _Anything:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __call__(self, *args, **kwargs):
        return _Anything()

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__file__ = "<lmtier test stand-in>"
        module.__version__ = "0.0"
        return module

    def exec_module(self, module) -> None:
        pass


_FINDER = _TorchvisionStandIn()


def use() -> None:
    if _FINDER in sys.meta_path:
        return
    if importlib.util.find_spec("torchvision") is None:
        sys.meta_path.insert(0, _FINDER)
    import sglang.srt.mem_cache.memory_pool  # noqa: F401  (the heavy import, done once)


def unuse() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]


def storage_config(*, mla: bool, page_first: bool, extra: dict, tp_rank: int = 0, tp_size: int = 1, model="tiny"):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=page_first,
        model_name=model,
        extra_config=dict(extra),
    )


def host_pool(kind: str, layout: str, *, page_size: int = 4, layers: int = 2, tokens: int = 64):
    """A real SGLang host pool on CPU over a real device pool built on "cpu"."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    common = {"device_capacity_tokens": tokens, "start_layer": 0, "end_layer": layers - 1}
    if kind == "mha":
        device = MHATokenToKVPool(tokens, page_size, torch.bfloat16, 2, 16, layers, "cpu", False, start_layer=0,
                                  end_layer=layers - 1)  # fmt: skip
        info = device.get_device_pool_infos()[0].buffer_info
        return MHATokenToKVPoolHost(info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu", **common)
    device = MLATokenToKVPool(tokens, page_size, torch.bfloat16, 24, 8, layers, "cpu", False, start_layer=0,
                              end_layer=layers - 1)  # fmt: skip
    info = device.get_device_pool_infos()[0].buffer_info
    return MLATokenToKVPoolHost(info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                target_layer_num=layers, **common)  # fmt: skip


def fill_random(pool, host_indices, seed: int) -> None:
    """Random KV in the pages at ``host_indices`` (bf16 bit patterns, NaNs included)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for start in range(0, len(host_indices), pool.page_size):
        page = pool.get_data_page(int(host_indices[start]), flat=False)
        bits = torch.randint(-(2**15), 2**15, page.shape, generator=g, dtype=torch.int16)
        page.copy_(bits.view(page.dtype))


def page_bytes(pool, host_indices) -> list[bytes]:
    """The bytes of each page at ``host_indices``, in the pool's own order."""
    out = []
    for start in range(0, len(host_indices), pool.page_size):
        page = pool.get_data_page(int(host_indices[start]), flat=False)
        out.append(page.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return out


def backend(tiers, *, mla=False, layout="page_first", pool=None, interface_v1=1, **extra):
    """A backend made the way SGLang's cache controller makes one: the factory's
    ``dynamic`` option, then ``register_mem_pool_host``."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    tp_rank = extra.pop("tp_rank", 0)
    tp_size = extra.pop("tp_size", 1)
    model = extra.pop("model", "tiny")
    pool = pool or host_pool("mla" if mla else "mha", layout)
    config = storage_config(
        mla=mla,
        page_first=layout != "layer_first",
        tp_rank=tp_rank,
        tp_size=tp_size,
        model=model,
        extra={
            "backend_name": "lmtier",
            "module_path": "lmtier.connectors.sglang",
            "class_name": "LMTierStorage",
            "interface_v1": interface_v1,
            "tiers": list(tiers),
            **extra,
        },
    )
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    storage.register_mem_pool_host(pool)
    return storage, pool


def page_keys(n: int, seed: int = 0) -> list[str]:
    """SGLang-style page hashes: a sha256 chain, hex."""
    keys, prev = [], b"seed-%d" % seed
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        keys.append(prev.hex())
    return keys


def alloc(pool, pages: int):
    indices = pool.alloc(pages * pool.page_size)
    assert indices is not None
    return indices


def token_kv(pool, indices):
    """KV of the tokens at ``indices`` read through SGLang's own per-layer views (not
    through lmtier's page mapping): MHA [layers, K/V, tokens, heads, dim]; MLA [layers,
    tokens, latent]."""
    import torch

    idx = indices.long()
    if hasattr(pool, "kv_cache_dim"):
        if pool.layout == "layer_first":
            return pool.kv_buffer[:, idx, 0].clone()
        return pool.kv_buffer[idx, :, 0].transpose(0, 1).clone()
    return torch.stack(
        [torch.stack([pool.k_data_refs[i][idx], pool.v_data_refs[i][idx]]) for i in range(pool.layer_num)]
    )
