"""``lmtier plan``: a fleet (YAML) and a trace in, what each tier would hold and serve out
(the planner is ``lmtier.plan``).

    add_plan(subparsers)  the command and its flags
    cmd_plan(args)        run one plan or a sweep; print a table, write JSON (and a plot)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from lmtier.errors import ConfigError
from lmtier.plan.fleet import Fleet
from lmtier.plan.report import NAMED, fleets_of, parse_goal, plot, shown, smallest, sweep, table, values_of
from lmtier.plan.sim import simulate
from lmtier.plan.traces import load

REPLAYS = {"auto": None, "compiled": True, "python": False}  # --replay: simulate()'s ``compiled``


def _writable(path: str, what: str, inputs: list[str], suffix: str | None = None) -> None:
    """Refuse an output path that cannot be written, or is one of the inputs, before any
    plan runs."""
    if not path:
        raise ConfigError(f"{what} needs a path")
    p = Path(path)
    for given in inputs:
        if given and p.exists() and Path(given).exists() and p.samefile(given):
            raise ConfigError(f"{what}: {path} is an input of this plan; it would be overwritten")
    if suffix and p.suffix.lower() != suffix:
        raise ConfigError(f"{what} is a {suffix} file, got {path!r}")
    if p.is_dir():
        raise ConfigError(f"{what}: {path} is a directory")
    if not p.parent.is_dir() or not os.access(p.parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(f"{what}: {path} cannot be written")


def cmd_plan(args: argparse.Namespace) -> int:
    if (args.goal or args.plot) and not args.sweep:
        raise ConfigError("--goal and --plot compare the plans of a sweep: give --sweep SETTING=v1,v2,...")
    if args.goal:
        parse_goal(args.goal)  # a goal that cannot be read fails before the plans run
    inputs = [args.fleet, args.trace.partition(":")[2]]
    if args.json_out is not None:
        _writable(args.json_out, "--json-out", inputs)
    if args.plot is not None:
        _writable(args.plot, "--plot", inputs, ".png")
        if args.json_out and Path(args.json_out).resolve() == Path(args.plot).resolve():
            raise ConfigError(f"--json-out and --plot are one file, {args.plot}: the plot would overwrite the JSON")
    setting, values = "", []
    if args.sweep:
        setting, _, text = args.sweep.partition("=")
        setting = setting.strip()
        values = values_of(setting, text)  # a sweep that cannot be read fails before the plans run
        if args.plot and setting in NAMED:
            raise ConfigError(f"--plot draws a sweep over a size or a count, not over {setting}")
    fleet = Fleet.load(args.fleet)
    if setting:
        fleets_of(fleet, setting, values)  # every swept fleet valid, before the trace is read
    requests = load(args.trace, args.limit, fleet.chunk_tokens)
    if not requests:
        raise ConfigError(f"the trace {args.trace} holds no request")
    compiled = REPLAYS[args.replay]
    if setting:
        rows = sweep(fleet, requests, setting, values, compiled)
    else:
        rows = [(None, simulate(fleet, requests, compiled))]
    out: dict = {"trace": args.trace, "requests": len(requests), "sweep": setting or None,
                 "plans": [{"value": v, **r} for v, r in rows]}  # fmt: skip
    print(table(rows, setting))
    for value, r in rows:
        for warning in r["warnings"]:
            print(f"warning{f' ({setting}={shown(setting, value)})' if setting else ''}: {warning}")
    met = None
    if args.goal:
        met = smallest(rows, args.goal)
        out["goal"] = {"goal": args.goal, "smallest": met[0] if met else None}
        if met:
            print(f"\n{args.goal}: first met at {setting}={shown(setting, met[0])} (in the order swept)")
        else:
            print(f"\n{args.goal}: not met by any value swept")
    if args.json_out:
        text = json.dumps(out, indent=2, allow_nan=False)  # whole before the file is touched
        target = Path(args.json_out)
        fd, partial = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
        try:  # a name of its own beside the output (never a file of the user's), then renamed over it
            mask = os.umask(0)
            os.umask(mask)
            os.fchmod(fd, 0o666 & ~mask)  # the mode a file written plainly gets, not mkstemp's 0600
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(partial, target)
        except BaseException:
            Path(partial).unlink(missing_ok=True)
            raise
    if args.plot and setting:
        plot(rows, setting, args.plot)
    return 1 if args.goal and not met else 0


def add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="replay a trace through a fleet: hit ratio per tier, bytes per link, TTFT")
    p.add_argument("fleet", help="the fleet, a YAML or JSON file (docs/plan.md)")
    p.add_argument("--trace", required=True,
                   help="mooncake:PATH, log:PATH (lmtier's request log) or synthetic:NAME[:N]")  # fmt: skip
    p.add_argument("--limit", type=int, help="the first N requests of the trace only")
    p.add_argument(
        "--sweep",
        help="one setting over values, smallest first: memory=8GiB,16GiB,32GiB; or over "
        "choices: router=round_robin,affinity,kv_aware (also save_policy, eviction, peers=false,true)",
    )
    p.add_argument(
        "--goal",
        help="with --sweep: the first value (the smallest) that meets it, e.g. "
        "hit_ratio>=0.8; the exit status is 1 when none does",
    )
    p.add_argument("--replay", choices=REPLAYS, default="auto",
                   help="compiled (numba, the same answers; refused where it cannot give them), python, or "
                   "auto: compiled from 100,000 requests where it can")  # fmt: skip
    p.add_argument("--json-out", help="write every plan's figures here")
    p.add_argument("--plot", help="with --sweep: hit ratio per tier against the setting, as a PNG")
    p.set_defaults(func=cmd_plan)
