"""``lmtier size``: what a model's KV costs per token and per context, and what each tier
holds of it, before anything is deployed (the planner is ``lmtier.kv.sizing``).

    add_size(subparsers)  the command and its flags
    cmd_size(args)        print the plan, as text or JSON
"""

from __future__ import annotations

import argparse
import json

from lmtier.cli.args import chunk_tokens, model_args, model_layout
from lmtier.kv.sizing import plan
from lmtier.units import parse_count, parse_size


def cmd_size(args: argparse.Namespace) -> int:
    layout = model_layout(args)
    sizes = (("cpu", args.cpu), ("disk", args.disk), ("s3", args.s3))
    tiers = {name: parse_size(value) for name, value in sizes if value}
    result = plan(
        args.model or args.config,
        layout,
        parse_count(args.tokens),
        batch=args.batch,
        chunk_tokens=chunk_tokens(args, layout),
        tiers=tiers,
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.to_text())
    return 0


def add_size(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("size", help="plan KV memory: bytes per token, per context, what each tier holds")
    model_args(p)
    p.add_argument(
        "--tokens",
        required=True,
        help="context length, as vLLM's --max-model-len reads it: "
        "100000, 100k (100,000), 128K (131,072), 1m (1,000,000), 1M (1,048,576)",
    )
    p.add_argument("--batch", type=int, default=1, help="concurrent contexts (default 1)")
    p.add_argument("--cpu", help="host-memory tier size, e.g. 64GiB")
    p.add_argument("--disk", help="disk tier size, e.g. 2TiB")
    p.add_argument("--s3", help="object-storage tier size, e.g. 50TiB: what it holds, and its requests per context")
    p.set_defaults(func=cmd_size)
