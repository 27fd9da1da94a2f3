"""Names of earlier releases, still importable for a release with a DeprecationWarning
naming the new home (CHANGELOG.md lists them).

    MOVED           old module name -> new one (importable, and runnable with ``python -m``)
    NAMES           module -> {name that left it -> the module that holds it now}
    forward(module) the ``__getattr__`` a module of NAMES sets, finding each name that left it

Modules moved into packages by role, long ones were split (a name that left a module
whose name stayed is found through ``forward``), tooling left the product's top level
(``lmtier.testing``, ``lmtier.demo``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable
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


def _all(module: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, module)


NAMES: dict[str, dict[str, str]] = {
    "lmtier.store": {
        **_all("lmtier.store.readpath", "LOAD_BATCH_BYTES", "READ_AHEAD", "deadline_after", "load_batch"),
        **_all(
            "lmtier.store.writeback",
            "CHECKPOINTS_PER_WAIT",
            "CHECKPOINT_BATCH",
            "CHECKPOINT_KEYS",
            "DEMOTE_BYTES",
            "WRITEBACK_AFTER_S",
        ),
        **_all("lmtier.store.tiered", "LOOKUP_RUNS", "WRITE_MODES"),
    },
    "lmtier.config": {
        **_all(
            "lmtier.config.schema",
            "AUTO_CHUNK_MIN_BYTES",
            "DEFAULT_CHUNK_TOKENS",
            "WRITE_MODES",
            "default_server_tiers",
        ),
        **_all(
            "lmtier.config.parsers",
            "BOOL",
            "CHUNK_TOKENS",
            "INTEGER",
            "NUMBER",
            "OPTIONAL_INTEGER",
            "SIZE",
            "STRING",
            "STRINGS",
            "TOKENS",
            "setting",
        ),
        **_all(
            "lmtier.config.loading",
            "ENV_PREFIX",
            "OTHER_ENV",
            "ROLE_KEYS",
            "SERVER_ENV_PREFIX",
            "from_env",
            "read_file",
        ),
        **_all("lmtier.config.tokens", "WEAK_TOKEN"),
    },
    "lmtier.cli": {
        **_all("lmtier.cli.demo", "cmd_bench", "cmd_demo"),
        **_all("lmtier.cli.reports", "cmd_inspect", "cmd_match", "cmd_stats"),
        **_all("lmtier.cli.keys", "cmd_keys"),
        **_all("lmtier.cli.serve", "cmd_serve"),
        **_all("lmtier.cli.size", "cmd_size"),
    },
    "lmtier.tiers.cpu": {
        **_all("lmtier.tiers.cpu.tier", "DEFAULT_SIZE", "PROBE_WAIT_S", "Publisher"),
        **_all("lmtier.tiers.cpu.placement", "PAGE"),
        **_all("lmtier.tiers.cpu.slab", "PREFAULT_AHEAD"),
    },
    "lmtier.tiers.disk.tier": {
        **_all("lmtier.tiers.disk.read", "READ_FRAMES", "READ_PIECE", "TOUCH_WAIT_S"),
        **_all("lmtier.tiers.disk.write", "WRITE_PIECE"),
    },
    "lmtier.tiers.disk.files": _all("lmtier.tiers.disk.claim", "segment_name"),
    "lmtier.server.service": {
        **_all("lmtier.server.methods.reads", "GET_BATCH"),
        **_all("lmtier.server.methods.saves", "HEAD_READ", "PUT_BATCH", "PUT_BATCH_BYTES"),
        **_all("lmtier.server.methods.control", "STATS_CACHED", "STATS_COUNT_LIMIT", "STATS_REFRESH_S"),
    },
    "lmtier.server.data": _all(
        "lmtier.server.data.channel",
        "ACCEPT_PAUSE_S",
        "DataChannel",
        "GET_BATCH",
        "HANDSHAKE_S",
        "IDLE_S",
        "PENDING",
        "PENDING_PER_SOURCE",
        "WARN_EVERY_S",
    ),
    "lmtier.connectors.vllm.scheduler": _all(
        "lmtier.connectors.vllm.lookup", "ENGINE", "HANDOFF_LOOKS_PER_STEP", "WINDOW_TRIES"
    ),
    "lmtier.connectors.vllm.worker": _all("lmtier.connectors.vllm.saves", "MAX_COPY_REPORTS", "SAVE_BUFFER_BYTES"),
    "lmtier.connectors.sglang": {
        **_all("lmtier.connectors.sglang.storage", "ENGINE", "METRIC_SAMPLES", "OWN_KEYS", "SGLANG_KEYS"),
        **_all("lmtier.connectors.sglang.pages", "PageShape", "byte_view", "page_shape"),
    },
}


def forward(module: str) -> Callable[[str], object]:
    """The ``__getattr__`` of ``module`` (a key of NAMES): a name that left it is found where
    it lives now, with a DeprecationWarning saying where (a module's ``__getattr__`` is asked
    only for names it lacks)."""
    moved = NAMES[module]

    def __getattr__(name: str) -> object:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} is now {moved[name]}.{name}; the old name goes away in a later release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(moved[name]), name)

    return __getattr__


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
