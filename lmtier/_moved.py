"""Module names of earlier releases, still importable (and runnable with ``python -m``) for a
release, with a DeprecationWarning naming the new home. Tooling left the product's top
level (``lmtier.testing``, ``lmtier.demo``); two modules were renamed for what they hold.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import CodeType, ModuleType

MOVED = {
    "lmtier.tinymodel": "lmtier.testing.tinymodel",
    "lmtier.redisproc": "lmtier.testing.redis_server",
    "lmtier.certs": "lmtier.testing.certs",
    "lmtier.enginerun": "lmtier.testing.engine",
    "lmtier.server.process": "lmtier.testing.cache_server",
    "lmtier.demo_vllm": "lmtier.demo.vllm",
    "lmtier.planner": "lmtier.kv.sizing",
    "lmtier.wire": "lmtier.transport.pieces",
    "lmtier.tiers.diskindex": "lmtier.tiers.disk.index",
    "lmtier.layout": "lmtier.kv.layout",
    "lmtier.keys": "lmtier.kv.keys",
    "lmtier.chunk": "lmtier.kv.chunk",
    "lmtier.codec": "lmtier.kv.codec",
    "lmtier.sizing": "lmtier.kv.sizing",
    "lmtier.pieces": "lmtier.transport.pieces",
    "lmtier.shm": "lmtier.transport.shm",
    "lmtier.directory": "lmtier.transport.directory",
    "lmtier.datachannel": "lmtier.transport.datachannel",
    "lmtier.transfer": "lmtier.engine.transfer",
    "lmtier.layerload": "lmtier.engine.layerload",
    "lmtier.devicecopy": "lmtier.engine.devicecopy",
    "lmtier.admission": "lmtier.store.admission",
    "lmtier.fairqueue": "lmtier.store.fairqueue",
    "lmtier.events": "lmtier.store.events",
    "lmtier.connectors.vllm_scheduler": "lmtier.connectors.vllm.scheduler",
    "lmtier.connectors.vllm_worker": "lmtier.connectors.vllm.worker",
    "lmtier.connectors.vllm_events": "lmtier.connectors.vllm.events",
    "lmtier.connectors.vllm_groups": "lmtier.connectors.vllm.groups",
    "lmtier.connectors.vllm_pd": "lmtier.connectors.vllm.pd",
    "lmtier.connectors.vllm_plans": "lmtier.connectors.vllm.plans",
    "lmtier.connectors.vllm_settings": "lmtier.connectors.vllm.settings",
    "lmtier.connectors.vllm_stats": "lmtier.connectors.vllm.stats",
    "lmtier.server.data_limits": "lmtier.server.data.limits",
    "lmtier.server.data_saves": "lmtier.server.data.saves",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Finds an old name and loads the module under its new one."""

    def find_spec(self, name: str, path: object = None, target: object = None):
        if name not in MOVED:
            return None
        warnings.warn(
            f"{name} is now {MOVED[name]}; the old name goes away in a later release", DeprecationWarning, stacklevel=2
        )
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])  # the one module, under both names

    def exec_module(self, module: ModuleType) -> None:
        pass  # imported already, under its new name

    def get_code(self, fullname: str) -> CodeType | None:  # `python -m lmtier.tinymodel`
        print(f"{fullname} is now {MOVED[fullname]}: run python -m {MOVED[fullname]}", file=sys.stderr)
        spec = importlib.util.find_spec(MOVED[fullname])
        return spec.loader.get_code(spec.name)  # type: ignore[union-attr]

    def get_source(self, fullname: str) -> str | None:
        spec = importlib.util.find_spec(MOVED[fullname])
        return spec.loader.get_source(spec.name)  # type: ignore[union-attr]


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.append(_Alias())
