"""Plans over several fleets: one setting swept over values, the smallest value that meets
a goal, and the results as a table and a plot.

    sweep(fleet, requests, setting, values) -> list of (value, report)
    fleets_of(fleet, setting, values) -> the swept fleets, each checked
    smallest(rows, goal) -> the first row that meets ``goal`` ("hit_ratio>=0.8", "ttft_p99_ms<=500")
    table(rows, setting) -> str (Markdown)
    plot(rows, setting, path)
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmtier.errors import ConfigError
from lmtier.plan.fleet import ROUTERS, Fleet
from lmtier.plan.policies import EVICTION
from lmtier.plan.sim import simulate
from lmtier.plan.traces import Request
from lmtier.store.admission import POLICIES
from lmtier.units import parse_size

SIZED = ("gpu", "memory", "disk", "shared_size")
COUNTED = ("instances",)
# settings a sweep compares by name, each with its choices
NAMED = {"router": ROUTERS, "save_policy": POLICIES, "eviction": EVICTION, "peers": ("false", "true")}
GOALS = {
    "hit_ratio": lambda r: r["hit_ratio"],
    "ttft_p50_ms": lambda r: r["ttft_ms"]["p50"],
    "ttft_p99_ms": lambda r: r["ttft_ms"]["p99"],
    "ttft_mean_ms": lambda r: r["ttft_ms"]["mean"],
}
_GOAL = re.compile(r"^\s*(\w+)\s*(>=|<=)\s*([0-9.eE+-]+)\s*$")


def values_of(setting: str, text: str) -> list[Any]:
    """``memory=8GiB,16GiB`` style values, in the setting's own unit, ascending; or for a
    named setting (``router=round_robin,kv_aware``), its choices in the order given."""
    if setting in NAMED:
        names = list(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
        wrong = [v for v in names if v not in NAMED[setting]]
        if wrong or not names:
            raise ConfigError(f"{setting} takes {', '.join(NAMED[setting])}; got {text!r}")
        return names
    if setting not in (*SIZED, *COUNTED):
        raise ConfigError(f"a sweep is over one of {', '.join((*SIZED, *COUNTED, *NAMED))}, got {setting!r}")
    parse = parse_size if setting in SIZED else int
    try:
        values = sorted({parse(v.strip()) for v in text.split(",") if v.strip()})
    except ValueError:
        kind = "sizes (8GiB)" if setting in SIZED else "whole numbers"
        raise ConfigError(f"{setting} is swept over {kind}, got {text!r}") from None
    if not values:
        raise ConfigError(f"no values to sweep {setting} over")
    return values


def fleets_of(fleet: Fleet, setting: str, values: Sequence[Any]) -> list[Fleet]:
    """The fleet with ``setting`` at each value: each checked (a bad value is an error
    before any plan runs)."""
    if setting == "shared_size" and not fleet.shared:
        raise ConfigError("a sweep of shared_size needs a shared tier in the fleet (shared: {kind: ..., size: ...})")
    return [fleet.replace(**{setting: _value(setting, v)}) for v in values]


def sweep(fleet: Fleet, requests: Sequence[Request], setting: str, values: Sequence[Any],
          compiled: bool | None = None) -> list[tuple[Any, dict]]:  # fmt: skip
    fleets = fleets_of(fleet, setting, values)
    return [(v, simulate(f, requests, compiled)) for v, f in zip(values, fleets, strict=True)]


def _value(setting: str, value: Any) -> Any:
    if setting == "eviction":
        return Fleet.evictions(value)
    if setting == "peers":
        return value == "true"
    return value


def parse_goal(goal: str):
    """``NAME>=X`` or ``NAME<=X``: a test of one report."""
    m = _GOAL.match(goal)
    if not m or m.group(1) not in GOALS:
        raise ConfigError(f"a goal is NAME>=X or NAME<=X, NAME one of {', '.join(GOALS)}; got {goal!r}")
    try:
        limit = float(m.group(3))
    except ValueError:
        raise ConfigError(f"a goal's limit is a number, got {m.group(3)!r}") from None
    measure, compare = GOALS[m.group(1)], {">=": operator.ge, "<=": operator.le}[m.group(2)]
    return lambda report: compare(measure(report), limit)


def smallest(rows: Sequence[tuple[Any, dict]], goal: str) -> tuple[Any, dict] | None:
    """The first row (the smallest value; for a named setting, the first given) whose
    report meets ``goal``, or None."""
    meets = parse_goal(goal)
    return next((row for row in rows if meets(row[1])), None)


def _size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} B"


def _rate(n: float) -> str:
    return f"{n / 1e9:.2f} GB/s" if n >= 1e8 else f"{n / 1e6:.1f} MB/s"


def shown(setting: str, value: Any) -> str:
    return _size(value) if setting in SIZED else str(value)


def table(rows: Sequence[tuple[Any, dict]], setting: str = "") -> str:
    tiers = ("gpu", "memory", "disk", "shared", "peers")
    head = [setting or "fleet", "hit ratio", *(f"from {t}" for t in tiers), "TTFT p50 ms", "TTFT p99 ms",
            "GPU-s saved", "shared peak", "network peak", "disk peak"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for value, r in rows:
        by, links = r["hit_ratio_by_tier"], r["links"]
        name = shown(setting, value) if setting else "as given"
        cells = [name, f"{r['hit_ratio']:.3f}", *(f"{by[t]:.3f}" for t in tiers), f"{r['ttft_ms']['p50']:.0f}",
                 f"{r['ttft_ms']['p99']:.0f}", f"{r['gpu_seconds_saved']:.0f}",
                 *(_rate(links[k]["peak_bytes_per_s"]) for k in ("shared", "network", "disk"))]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: Sequence[tuple[Any, dict]], setting: str, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [v / (1 << 30) if setting in SIZED else v for v, _ in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = [0.0] * len(rows)
    for tier in ("gpu", "memory", "disk", "shared", "peers"):
        share = [r["hit_ratio_by_tier"][tier] for _, r in rows]
        if any(share):
            top = [b + s for b, s in zip(bottom, share, strict=True)]
            ax.fill_between(xs, bottom, top, label=tier, step=None, alpha=0.8)
            bottom = top
    ax.plot(xs, [r["hit_ratio"] for _, r in rows], color="black", marker="o", label="total")
    ax.set_xlabel(f"{setting} per instance (GiB)" if setting in SIZED and setting != "shared_size" else setting)
    ax.set_ylabel("token hit ratio")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
