"""``lmtier demo``, and ``lmtier bench`` (deprecated): the commands that run tooling rather
than the product.

The one door from the product to tooling (``lmtier.demo``): the demo is imported only when
asked for, after its dependencies are checked, so no other command loads it. ``bench``
forwards to the benchmark runner of the source checkout lmtier was installed from.

    add_demo(subparsers)   the demo command and its flags
    cmd_demo(args)         run the vLLM, prefill/decode or store-only demo
    add_bench(subparsers)  the bench command: every argument is the runner's
    cmd_bench(args)        forward to ``benchmarks/run.py``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lmtier.cli.args import require
from lmtier.errors import LmtierError


def cmd_demo(args: argparse.Namespace) -> int:
    if args.store_only:
        require("torch", "torch")
        from lmtier.demo.embedded import run_demo

        return run_demo(tiers=args.tier or None, directory=args.dir)
    if args.questions < 2:
        raise LmtierError(f"--questions {args.questions}: at least 2 (A's first question prefills, the next hit)")
    require("vllm", "vllm", "torch", "transformers", "tokenizers")  # the engines, and the model they load
    if args.what == "pd":
        require("grpc", "grpc")  # the shared tier is lmtier serve
        from lmtier.demo.pd import run_pd_demo

        return run_pd_demo(out_dir=args.out, docs=args.docs, doc_tokens=args.doc_tokens, directory=args.dir)
    from lmtier.demo.vllm import run_vllm_demo

    return run_vllm_demo(
        out_dir=args.out, docs=args.docs, doc_tokens=args.doc_tokens, questions=args.questions, directory=args.dir
    )


def cmd_bench(args: argparse.Namespace) -> int:
    """Deprecated: the benchmark runner lives beside the benchmarks, in a source checkout
    (``python benchmarks/run.py``); this forwards to it with the same arguments."""
    runner = next((p for p in _BENCH_RUNNERS if p.is_file()), None)
    if runner is None and {"-h", "--help"} & set(args.bench_args):  # help needs no runner
        args.bench_parser.print_help()
        return 0
    if runner is None:
        raise LmtierError("the benchmarks live in a source checkout: run `python benchmarks/run.py` there")
    print("lmtier bench is deprecated: run `python benchmarks/run.py` (or `make bench`)", file=sys.stderr)
    import subprocess

    return subprocess.call([sys.executable, str(runner), *args.bench_args])


# The runner of the checkout this package was installed from (editable), never the current
# directory's: a command must not run whatever lies there. This file is lmtier/cli/demo.py.
_BENCH_RUNNERS = (Path(__file__).resolve().parents[2] / "benchmarks" / "run.py",)


def add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="two vLLM engines in two processes: the second skips the first's prefills")
    p.add_argument(
        "what", nargs="?", choices=("vllm", "pd"), default="vllm",
        help="vllm (default): one instance after another on a disk; pd: a prefill and a decode vllm serve, "
        "side by side, through lmtier serve and the reference proxy",
    )  # fmt: skip
    p.add_argument("--out", default="lmtier-demo", help="where the TTFT plot and JSON go (default ./lmtier-demo)")
    p.add_argument("--docs", type=int, default=3, help="documents (default 3)")
    p.add_argument("--doc-tokens", type=int, default=4096, help="tokens per document (default 4096)")
    p.add_argument(
        "--questions", type=int, default=3,
        help="vllm: questions per document and instance (default 3; at least 2: A's first prefills, its next hit)",
    )  # fmt: skip
    p.add_argument("--dir", help="where the demo's temporary files live (default: the system temp dir)")
    p.add_argument("--store-only", action="store_true", help="the embedded store alone, without an engine")
    p.add_argument("--tier", action="append", help="with --store-only: tier URL (repeatable)")
    p.set_defaults(func=cmd_demo)


def add_bench(sub: argparse._SubParsersAction) -> None:
    # No options of its own (add_help=False): every argument is the runner's, --help too,
    # which in a checkout prints the runner's options and elsewhere this parser's help.
    p = sub.add_parser(
        "bench",
        help="deprecated: python benchmarks/run.py in a checkout",
        add_help=False,
        usage="lmtier bench [RUNNER ARGUMENT ...]",
        description="Deprecated: runs `python benchmarks/run.py` of the source checkout lmtier was installed "
        "from (editable), with the same arguments; `lmtier bench --help` there lists them. An installed wheel "
        "has no benchmarks: clone the repository and run `python benchmarks/run.py` (or `make bench`).",
    )
    p.set_defaults(func=cmd_bench, bench_parser=p)
