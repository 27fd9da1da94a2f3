"""``lmtier plan``: a fleet (YAML) and a trace in, what each tier would hold and serve out
(the planner is ``lmtier.plan``).

    add_plan(subparsers)  the command and its flags
    cmd_plan(args)        run one plan or a sweep; print a table, write JSON (and a plot)
"""

from __future__ import annotations

import argparse
import json

from lmtier.errors import ConfigError
from lmtier.plan.fleet import Fleet
from lmtier.plan.report import parse_goal, plot, shown, smallest, sweep, table, values_of
from lmtier.plan.sim import simulate
from lmtier.plan.traces import load


def cmd_plan(args: argparse.Namespace) -> int:
    if (args.goal or args.plot) and not args.sweep:
        raise ConfigError("--goal and --plot compare the plans of a sweep: give --sweep SETTING=v1,v2,...")
    if args.goal:
        parse_goal(args.goal)  # a goal that cannot be read fails before the plans run
    fleet = Fleet.load(args.fleet)
    requests = load(args.trace, args.limit, fleet.chunk_tokens)
    if not requests:
        raise ConfigError(f"the trace {args.trace} holds no request")
    if args.sweep:
        setting, _, text = args.sweep.partition("=")
        rows = sweep(fleet, requests, setting.strip(), values_of(setting.strip(), text))
    else:
        setting, rows = "", [(None, simulate(fleet, requests))]
    out: dict = {"trace": args.trace, "requests": len(requests), "sweep": setting or None,
                 "plans": [{"value": v, **r} for v, r in rows]}  # fmt: skip
    print(table(rows, setting))
    if args.goal:
        met = smallest(rows, args.goal)
        out["goal"] = {"goal": args.goal, "smallest": met[0] if met else None}
        where = f" from {setting}={shown(setting, met[0])}" if met and setting else ""
        print(f"\n{args.goal}: " + (f"met{where}" if met else "not met"))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
    if args.plot and setting:
        plot(rows, setting, args.plot)
    return 0


def add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="replay a trace through a fleet: hit ratio per tier, bytes per link, TTFT")
    p.add_argument("fleet", help="the fleet, a YAML or JSON file (docs/plan.md)")
    p.add_argument("--trace", required=True,
                   help="mooncake:PATH, log:PATH (lmtier's request log) or synthetic:NAME[:N]")  # fmt: skip
    p.add_argument("--limit", type=int, help="the first N requests of the trace only")
    p.add_argument("--sweep", help="one setting over values, smallest first: memory=8GiB,16GiB,32GiB")
    p.add_argument("--goal", help="with --sweep: the smallest value that meets it, e.g. hit_ratio>=0.8")
    p.add_argument("--json-out", help="write every plan's figures here")
    p.add_argument("--plot", help="with --sweep: hit ratio per tier against the setting, as a PNG")
    p.set_defaults(func=cmd_plan)
