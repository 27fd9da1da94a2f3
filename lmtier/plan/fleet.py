"""A fleet as ``lmtier plan`` reads it: a YAML (or JSON) file, every size per instance.

    instances: 4                 # engines
    router: kv_aware             # round_robin | affinity | kv_aware
    spill: 2.0                   # kv_aware: an instance with more than 2x the mean recent
                                 # requests (the last `window` seconds) sends new ones elsewhere
    chunk_tokens: 512            # lmtier's chunk (a trace's block, for a Mooncake trace)
    kv_bytes_per_token: 131072   # `lmtier size` prints it (Llama-3-8B, bf16: 128 KiB)
    prefill_tokens_per_s: 8000   # one instance's prefill rate
    request_ms: 0                # a request's own time to its first token, with nothing to compute
    gpu: 20GiB                   # the engine's own prefix cache (0: none)
    memory: 64GiB                # lmtier's memory tier
    disk: 1TiB                   # a local disk tier (0: none)
    shared: {kind: server, size: 2TiB}   # one shared tier: server | redis | s3 (none: omit)
    peers: true                  # instances read each other's memory and disk
    save_policy: always          # always | min_tokens | reuse (lmtier.store.admission)
    min_tokens: 0
    eviction: lru                # every tier's, or per tier: {memory: lru, disk: s3fifo, shared: arc}
                                 # (lru | arc | s3fifo | tinylfu | slru: lmtier.plan.policies)
    costs:                       # per medium: GB/s and ms a load (defaults below)
      disk: {gbps: 3.0, ms: 0.2}

``Fleet.load(path)``, ``Fleet.from_dict(d)``, ``fleet.replace(**changes)``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmtier.errors import ConfigError
from lmtier.plan.policies import EVICTION
from lmtier.store.admission import POLICIES
from lmtier.units import parse_size

ROUTERS = ("round_robin", "affinity", "kv_aware")
MAX_INSTANCES = 10_000  # a plan keeps every instance's tiers in memory
# bounds that keep every figure of a plan a finite number (a TTFT of 1e308 ms overflows)
LIMITS = {
    "prefill_tokens_per_s": (1e-6, 1e15),
    "request_ms": (0.0, 1e9),
    "spill": (0.0, 1e9),
    "window": (0.0, 1e9),
    "chunk_tokens": (1, 1 << 24),
    "kv_bytes_per_token": (1, 1 << 40),
}
MAX_BYTES = 1 << 70  # a tier's size (a zebibyte)
COST_LIMITS = {"gbps": (1e-12, 1e6), "ms": (0.0, 1e9)}
NUMBERS = ("prefill_tokens_per_s", "request_ms", "spill", "window")  # read from a string too ("8e3")
SHARED = ("server", "redis", "s3")
MEDIA = ("memory", "disk", "peers", "shared")
EVICTING = ("memory", "disk", "shared")  # the tiers whose eviction policy a plan sets
MAX_FILE = 1 << 20  # a fleet file's bytes


def _once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose every key is given once (``json.loads``' ``object_pairs_hook``)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"{key!r} is given twice")
        out[key] = value
    return out


def _yaml(text: str) -> Any:
    """``yaml.safe_load``, except that a key given twice in one mapping is an error, not
    the last one silently kept."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node)
            if isinstance(key, (list, dict)):  # unhashable: construct_mapping says so
                continue
            if key in seen:
                raise ConfigError(f"{key!r} is given twice (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return loader.construct_mapping(node)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return yaml.load(text, Loader=Loader) or {}


def _kind(kinds) -> str:
    names = {int: "an integer", bool: "true or false", str: "a string", float: "a number"}
    return names[kinds] if not isinstance(kinds, tuple) else "a number"


@dataclass(frozen=True)
class Cost:
    """One medium's load: ``ms`` a load (a round trip) plus its bytes at ``gbps`` (GB/s)."""

    gbps: float
    ms: float

    def seconds(self, nbytes: int) -> float:
        return self.ms / 1000 + nbytes / (self.gbps * 1e9)


# Rough figures of a node with a PCIe 4 NVMe and a 25 Gb/s network, for a plan made before
# anything is measured; `lmtier bench` on the fleet's own machines gives its own.
DEFAULT_COSTS = {
    "memory": Cost(gbps=20.0, ms=0.05),
    "disk": Cost(gbps=3.0, ms=0.2),
    "peers": Cost(gbps=2.5, ms=1.0),
    "shared": Cost(gbps=2.5, ms=1.0),
}
SHARED_COSTS = {"server": Cost(2.5, 1.0), "redis": Cost(1.5, 1.0), "s3": Cost(1.0, 30.0)}


@dataclass(frozen=True)
class Fleet:
    instances: int = 1
    router: str = "round_robin"
    spill: float = 2.0
    window: float = 10.0
    chunk_tokens: int = 512
    kv_bytes_per_token: int = 131072
    prefill_tokens_per_s: float = 8000.0
    request_ms: float = 0.0
    gpu: int = 0
    memory: int = 0
    disk: int = 0
    shared: str = ""  # "" (none), or one of SHARED
    shared_size: int = 0
    peers: bool = False
    save_policy: str = "always"
    min_tokens: int = 0
    costs: dict[str, Cost] = field(default_factory=lambda: dict(DEFAULT_COSTS))
    eviction: dict[str, str] = field(default_factory=lambda: dict.fromkeys(EVICTING, "lru"))

    def __post_init__(self) -> None:
        for name, kinds in (("instances", int), ("chunk_tokens", int), ("kv_bytes_per_token", int),
                            ("gpu", int), ("memory", int), ("disk", int), ("shared_size", int), ("min_tokens", int),
                            ("peers", bool), ("router", str), ("shared", str), ("save_policy", str),
                            ("spill", (int, float)), ("window", (int, float)),
                            ("prefill_tokens_per_s", (int, float)), ("request_ms", (int, float))):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, kinds) or (kinds is not bool and isinstance(value, bool)):
                raise ConfigError(f"{name} must be {_kind(kinds)}, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
        if self.instances > MAX_INSTANCES:
            raise ConfigError(f"instances: at most {MAX_INSTANCES} in one plan, got {self.instances}")
        if self.instances < 1:
            raise ConfigError(f"instances must be at least 1, got {self.instances}")
        if self.router not in ROUTERS:
            raise ConfigError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.shared and self.shared not in SHARED:
            raise ConfigError(f"shared.kind must be one of {', '.join(SHARED)}, got {self.shared!r}")
        if self.save_policy not in POLICIES:
            raise ConfigError(f"save_policy must be one of {', '.join(POLICIES)}, got {self.save_policy!r}")
        for name in ("chunk_tokens", "kv_bytes_per_token", "prefill_tokens_per_s", "spill", "window"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("gpu", "memory", "disk", "shared_size", "min_tokens", "request_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")
        for name, (low, high) in LIMITS.items():
            if not low <= getattr(self, name) <= high:
                raise ConfigError(f"{name} must lie between {low:g} and {high:g}, got {getattr(self, name)}")
        for name in ("gpu", "memory", "disk", "shared_size"):
            if getattr(self, name) > MAX_BYTES:
                raise ConfigError(f"{name}: at most {MAX_BYTES} bytes (1 ZiB), got {getattr(self, name)}")
        for medium, cost in self.costs.items():
            for name, (low, high) in COST_LIMITS.items():
                if not low <= getattr(cost, name) <= high:
                    raise ConfigError(f"costs of {medium}: {name} must lie between {low:g} and {high:g}, "
                                      f"got {getattr(cost, name)}")  # fmt: skip
        if self.shared and not self.shared_size:
            raise ConfigError("a shared tier needs its size")
        if not isinstance(self.eviction, dict) or set(self.eviction) != set(EVICTING):
            raise ConfigError(f"eviction names one policy for each of {', '.join(EVICTING)}, got {self.eviction!r}")
        for tier, policy in self.eviction.items():
            if policy not in EVICTION:
                raise ConfigError(f"eviction of {tier} must be one of {', '.join(EVICTION)}, got {policy!r}")

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_tokens * self.kv_bytes_per_token

    def chunks(self, nbytes: int) -> int:
        """Whole chunks a tier of ``nbytes`` holds."""
        return nbytes // self.chunk_bytes

    def empty_tiers(self) -> list[str]:
        """A warning for each tier given a size under one chunk: it holds nothing (a size
        without a unit is bytes: ``memory: 64`` is 64 bytes, not 64 GiB)."""
        sizes = {"gpu": self.gpu, "memory": self.memory, "disk": self.disk, "shared": self.shared_size}
        return [f"{name}: {size} bytes hold no chunk of {self.chunk_bytes:,} bytes: no {name} tier (a size without "
                "a unit is bytes: 64GiB)" for name, size in sizes.items() if 0 < size < self.chunk_bytes]  # fmt: skip

    def replace(self, **changes: Any) -> Fleet:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fleet:
        if not isinstance(data, dict):
            raise ConfigError("a fleet is a mapping of settings")
        named = [k for k in data if not isinstance(k, str)]
        if named:
            raise ConfigError(f"a fleet's settings are named by words, got {named[0]!r}")
        known = {f.name for f in dataclasses.fields(cls)} - {"shared_size"}  # a shared tier's size is in shared
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown fleet settings: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        d = dict(data)
        for name in NUMBERS:  # YAML 1.1 reads 8e3 as a string
            if isinstance(d.get(name), str):
                try:
                    d[name] = float(d[name])
                except ValueError:
                    raise ConfigError(f"{name} must be a number, got {d[name]!r}") from None
        for name in ("gpu", "memory", "disk"):
            if name in d:
                d[name] = parse_size(d[name] or 0)
        shared = d.pop("shared", None)
        if shared:
            if not isinstance(shared, dict) or set(shared) != {"kind", "size"}:
                raise ConfigError("shared is {kind: server|redis|s3, size: 2TiB}, nothing else")
            d["shared"], d["shared_size"] = str(shared["kind"]), parse_size(shared["size"])
        if "eviction" in d:
            d["eviction"] = cls.evictions(d["eviction"])
        costs = dict(DEFAULT_COSTS)
        if d.get("shared") in SHARED_COSTS:
            costs["shared"] = SHARED_COSTS[d["shared"]]
        given = d.pop("costs", None) or {}
        if not isinstance(given, dict):
            raise ConfigError("costs are per medium: {disk: {gbps: 3.0, ms: 0.2}, ...}")
        for medium, cost in given.items():
            if medium not in MEDIA or not isinstance(cost, dict) or not set(cost) <= {"gbps", "ms"}:
                raise ConfigError(f"costs are per medium ({', '.join(MEDIA)}), each {{gbps: 3.0, ms: 0.2}}; "
                                  f"got {medium!r}: {cost!r}")  # fmt: skip
            base = costs[medium]
            if any(isinstance(v, bool) for v in cost.values()):
                raise ConfigError(f"costs of {medium}: gbps and ms are numbers, got {cost!r}")
            try:
                costs[medium] = Cost(float(cost.get("gbps", base.gbps)), float(cost.get("ms", base.ms)))
            except (TypeError, ValueError):
                raise ConfigError(f"costs of {medium}: gbps and ms are numbers, got {cost!r}") from None
            gbps, ms = costs[medium].gbps, costs[medium].ms
            if not (math.isfinite(gbps) and math.isfinite(ms)) or gbps <= 0 or ms < 0:
                raise ConfigError(f"costs of {medium}: gbps must be a finite positive number and ms a finite one "
                                  f"not negative, got {cost!r}")  # fmt: skip
        try:
            return cls(**d, costs=costs)
        except TypeError as exc:
            raise ConfigError(f"a fleet setting has the wrong type: {exc}") from None

    @staticmethod
    def evictions(given: Any) -> dict[str, str]:
        """``lru`` (every tier) or ``{memory: arc}`` (the tiers not named keep LRU)."""
        if isinstance(given, str):
            return dict.fromkeys(EVICTING, given)
        if not isinstance(given, dict) or not set(given) <= set(EVICTING):
            raise ConfigError(f"eviction is one policy ({', '.join(EVICTION)}) or one per tier "
                              f"({', '.join(EVICTING)}), got {given!r}")  # fmt: skip
        return dict.fromkeys(EVICTING, "lru") | given

    @classmethod
    def load(cls, path: str | Path) -> Fleet:
        path = Path(path)
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_FILE + 1)
            text = raw.decode()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot be read as a fleet ({exc})") from None
        if len(raw) > MAX_FILE:
            raise ConfigError(f"{path}: a fleet is a file of {MAX_FILE >> 10} KiB at most")
        try:
            yaml_file = path.suffix.lower() in (".yaml", ".yml")
            data = _yaml(text) if yaml_file else json.loads(text, object_pairs_hook=_once)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        except Exception as exc:  # yaml.YAMLError, json.JSONDecodeError: one line, not a traceback
            raise ConfigError(f"{path}: not a fleet ({str(exc).splitlines()[0] if str(exc) else exc})") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["shared"] = self.shared or None
        out["costs"] = {m: dataclasses.asdict(c) for m, c in self.costs.items()}
        return out
