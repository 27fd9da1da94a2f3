"""``lmtier keys``, and the engine namespaces it shares with ``lmtier match``: which keys an
engine's connector gives a prompt's chunks, computed here without the engine.

A key depends on the engine's namespace (model, layout of its rank's shard, chunk size,
revision, salt, hash, engine identity), so the namespace is built as the connector builds
it, from the same flags, and printed beside the keys; a digest that differs from an
engine's log line then says which field differs.

    add_keys(subparsers)               the command and its flags
    cmd_keys(args)                     print a prompt's namespace and chunk keys
    namespace_args(parser)             --revision, --tp-size, --salt, --hash, --engine
    read_tokens(path)                  a JSON list of token ids from a file or stdin
    engine_namespaces(args, command)   the namespace of each tensor-parallel rank
    engine_note(args, command)         why a digest made without --engine may differ
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from lmtier.cli.args import chunk_tokens, model_args, model_layout
from lmtier.errors import LmtierError
from lmtier.kv.keys import HASHES, Namespace


def read_tokens(path: str) -> list[int]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    try:
        tokens = json.loads(text)
    except ValueError as exc:
        raise LmtierError(f"{path}: not a JSON list of token ids ({exc})") from exc
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise LmtierError(f"{path}: expected a JSON list of token ids")
    bad = next((i for i, t in enumerate(tokens) if not 0 <= t < 2**31), None)
    if bad is not None:
        raise LmtierError(f"{path}: token id {bad} is {tokens[bad]}; token ids lie in [0, 2**31)")
    return tokens


# An engine identity names its block size (vLLM on CPU: "vllm-cpu/block=64/isa=AVX512").
_IDENTITY_BLOCK = re.compile(r"(?:^|/)block=([0-9]+)(?:/|$)")


def _engine_identity(args: argparse.Namespace) -> str:
    """``--engine`` as the engine's start-up line logs it (quotes and all), which also says
    the engine's block size: the automatic chunk size is then the engine's without
    ``--block-size``, and a ``--block-size`` that disagrees is refused."""
    engine = args.engine.strip().strip("'\"")
    block = _IDENTITY_BLOCK.search(engine)
    if block:
        if args.block_size is None:
            args.block_size = int(block.group(1))
        elif args.block_size != int(block.group(1)):
            raise LmtierError(f"--engine {engine!r} is an engine with blocks of {block.group(1)} tokens, "
                              f"not --block-size {args.block_size}")  # fmt: skip
    return engine


def engine_note(args: argparse.Namespace, command: str) -> None:
    """After a digest made without ``--engine``: a vLLM engine on CPU puts its engine
    identity into its namespace, so its digest differs from this one, and nothing else
    would say why or where to read the identity. A note on stderr, after the output."""
    if not args.engine.strip():
        print(f"lmtier {command}: note: no --engine, so this is the digest of an engine without an engine identity "
              "(vLLM on GPU); a vLLM engine on CPU has one in its namespace and logs it at start "
              "(\"engine identity 'vllm-cpu/block=N/isa=...'\"): pass that string as --engine for its digest",
              file=sys.stderr)  # fmt: skip


def engine_namespaces(args: argparse.Namespace, command: str) -> list[Namespace]:
    """The namespace of each tensor-parallel rank of an engine, as its connector builds
    them (each rank holds its shard of the KV heads)."""
    engine = _engine_identity(args)
    layout = model_layout(args)
    size = chunk_tokens(args, layout)
    model = args.model
    if not model:  # an engine names a model by the path it was given: the config's directory
        model = str(Path(args.config).parent)
        print(f"lmtier {command}: model id {model!r} (an engine started with that model path uses it; "
              "--model names another)", file=sys.stderr)  # fmt: skip
    shard = layout.shard(args.tp_size)
    return [
        Namespace(
            model=model,
            layout=shard,
            chunk_tokens=size,
            revision=args.revision,
            tp_rank=rank,
            tp_size=args.tp_size,
            salt=args.salt,
            hash=args.hash,
            engine=engine,
        )
        for rank in range(args.tp_size)
    ]


def namespace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--revision", default="", help="model revision")
    p.add_argument("--tp-size", type=int, default=1, help="the engine's tensor-parallel size")
    p.add_argument("--salt", default="", help="tenant / cache salt")
    p.add_argument("--hash", default="xxh3", choices=HASHES)
    p.add_argument(
        "--engine",
        default="",
        help="the engine identity in the namespace, as the engine logs it at start (\"engine identity '...'\"): "
        "vLLM on CPU has one (vllm-cpu/block=N/isa=...; its block size then needs no --block-size), "
        "on GPU none",
    )


def cmd_keys(args: argparse.Namespace) -> int:
    tokens = read_tokens(args.tokens_file)
    if not 0 <= args.tp_rank < args.tp_size:
        raise LmtierError(f"--tp-rank must lie in [0, {args.tp_size})")
    ns = engine_namespaces(args, "keys")[args.tp_rank]
    size = ns.chunk_tokens
    keys = ns.keys(tokens)
    in_bucket = _in_bucket(args.bucket, keys) if args.bucket else None
    if args.json:
        print(
            json.dumps(
                {
                    "namespace": ns.fields(),
                    "namespace_digest": ns.digest.hex(),
                    "tokens": len(tokens),
                    "keys": [
                        {"chunk": i, "tokens": [i * size, (i + 1) * size], "key": k.hex()}
                        | ({"in_bucket": in_bucket[i]} if in_bucket is not None else {})
                        for i, k in enumerate(keys)
                    ],
                },
                indent=2,
            )
        )
        engine_note(args, "keys")
        return 0
    print(f"namespace {ns.digest.hex()}")
    for name, value in ns.fields().items():
        print(f"  {name:<15} {value}")
    print(
        f"{len(tokens)} tokens -> {len(keys)} full chunks of {size} "
        f"(the {len(tokens) - len(keys) * size}-token tail is not cached)"
    )
    shown = {True: "  in the bucket", False: "  not in the bucket", None: "  (no answer)"}
    for i, key in enumerate(keys):
        where = shown[in_bucket[i]] if in_bucket is not None else ""
        print(f"chunk {i:>5}  tokens [{i * size}, {(i + 1) * size})  {key.hex()}{where}")
    engine_note(args, "keys")
    return 0


def _in_bucket(url: str, keys: list[bytes]) -> list[bool | None]:
    """Which chunks an object-storage tier holds (one HEAD each; the bucket is not changed)."""
    from lmtier.tiers.s3.survey import held

    return held(url, keys)


def add_keys(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="print the namespace and the chunk keys of a prompt")
    model_args(p)
    p.add_argument("--tokens-file", required=True, help="JSON list of token ids ('-' for stdin)")
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--bucket", help="an object-storage tier's URL: say which chunks it holds (a HEAD each)")
    namespace_args(p)
    p.set_defaults(func=cmd_keys)
