"""The ``lmtier`` command line: one parser of every subcommand, and how a run ends.

Each command family adds its own subcommands (its flags beside the code that reads them);
this module puts them in the order ``lmtier --help`` lists them and turns what a command
raises into one line on stderr and an exit status: 2 for a usage error, a configuration
or I/O error, or a missing optional dependency (named with the extra that brings it); 0
when the reader of a pipe has gone (``lmtier stats | head``). A bug in lmtier keeps its
traceback.

    build_parser()  the parser of ``lmtier`` and its subcommands
    main(argv)      parse, run the command, return its exit status
"""

from __future__ import annotations

import argparse
import os
import sys

from lmtier.cli.demo import add_bench, add_demo
from lmtier.cli.keys import add_keys
from lmtier.cli.plan import add_plan
from lmtier.cli.reports import add_inspect, add_match, add_stats
from lmtier.cli.serve import add_serve
from lmtier.cli.size import add_size
from lmtier.errors import LmtierError


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line: ``lmtier serve: error: ...``, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lmtier", description="Multi-tier KV-cache offloading for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (add_size, add_plan, add_keys, add_match, add_demo, add_serve, add_stats, add_inspect, add_bench):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":  # deprecated; everything after it is the runner's
        args.bench_args = rest
    elif rest:
        parser.parse_args(argv)  # the usual one-line error for what was not recognized
    try:
        code = args.func(args)
        sys.stdout.flush()  # what is still buffered meets a closed pipe here, not at exit
        return code
    except BrokenPipeError:  # `lmtier stats | head`: the reader has all it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout at exit
        return 0
    except (LmtierError, ValueError, OSError) as exc:
        print(f"lmtier {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # one that require could not foresee (a dependency's own)
        if (exc.name or "lmtier").split(".")[0] == "lmtier":
            raise  # lmtier's own: a bug, with its traceback
        print(
            f"lmtier {args.command}: error: {exc.name!r}, which this command needs, is not installed", file=sys.stderr
        )
        return 2
