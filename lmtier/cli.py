"""The ``lmtier`` command: ``size``, ``keys``, ``demo``, ``serve``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lmtier.config import resolve_chunk_tokens
from lmtier.errors import LmtierError
from lmtier.keys import HASHES, Namespace
from lmtier.layout import PRESETS, KVLayout, from_hf_config, preset
from lmtier.planner import plan
from lmtier.units import parse_count, parse_size


def _layout(args: argparse.Namespace) -> KVLayout:
    if args.config:
        layout = from_hf_config(args.config, dtype=args.dtype)
    elif args.model:
        layout = preset(args.model)
    else:
        raise LmtierError(f"give --model (one of: {', '.join(sorted(PRESETS))}) or --config config.json")
    return layout.with_dtype(args.dtype) if args.dtype else layout


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=f"model id; a preset gives the layout ({', '.join(sorted(PRESETS))})")
    p.add_argument("--config", help="a Hugging Face config.json to read the layout from")
    p.add_argument("--dtype", help="KV dtype: bf16, fp16, fp8, fp32 (default: the model's)")
    p.add_argument("--chunk-tokens", type=int, help="tokens per chunk (default: as chunk_tokens=auto picks)")
    p.add_argument(
        "--block-size",
        type=int,
        help="the engine's KV block size: auto chunks are then what that engine's connector uses (without it: 256)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")


def _chunk_tokens(args: argparse.Namespace, layout: KVLayout) -> int:
    return resolve_chunk_tokens(args.chunk_tokens or 0, args.block_size, layout.chunk_bytes(1))


def cmd_size(args: argparse.Namespace) -> int:
    layout = _layout(args)
    tiers = {name: parse_size(value) for name, value in (("cpu", args.cpu), ("disk", args.disk)) if value}
    result = plan(
        args.model or args.config,
        layout,
        parse_count(args.tokens),
        batch=args.batch,
        chunk_tokens=_chunk_tokens(args, layout),
        tiers=tiers,
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.to_text())
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    layout = _layout(args)
    text = sys.stdin.read() if args.tokens_file == "-" else Path(args.tokens_file).read_text()
    try:
        tokens = json.loads(text)
    except ValueError as exc:
        raise LmtierError(f"{args.tokens_file}: not a JSON list of token ids ({exc})") from exc
    if not isinstance(tokens, list):
        raise LmtierError(f"{args.tokens_file}: expected a JSON list of token ids")
    size = _chunk_tokens(args, layout)
    ns = Namespace(
        model=args.model or str(args.config),
        layout=layout,
        chunk_tokens=size,
        revision=args.revision,
        tp_rank=args.tp_rank,
        tp_size=args.tp_size,
        salt=args.salt,
        hash=args.hash,
    )
    keys = ns.keys(tokens)
    if args.json:
        print(
            json.dumps(
                {
                    "namespace": ns.fields(),
                    "namespace_digest": ns.digest.hex(),
                    "tokens": len(tokens),
                    "keys": [
                        {"chunk": i, "tokens": [i * size, (i + 1) * size], "key": k.hex()} for i, k in enumerate(keys)
                    ],
                },
                indent=2,
            )
        )
        return 0
    print(f"namespace {ns.digest.hex()}")
    for name, value in ns.fields().items():
        print(f"  {name:<15} {value}")
    print(
        f"{len(tokens)} tokens -> {len(keys)} full chunks of {size} "
        f"(the {len(tokens) - len(keys) * size}-token tail is not cached)"
    )
    for i, key in enumerate(keys):
        print(f"chunk {i:>5}  tokens [{i * size}, {(i + 1) * size})  {key.hex()}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.store_only:
        from lmtier.demo import run_demo

        return run_demo(tiers=args.tier or None, directory=args.dir)
    from lmtier.demo_vllm import run_vllm_demo

    return run_vllm_demo(out_dir=args.out, docs=args.docs, doc_tokens=args.doc_tokens, directory=args.dir)


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from lmtier.config import ServerConfig, parse_token, read_token_file
    from lmtier.server import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tokens = [parse_token(t) for t in args.token or ()]
    for path in args.token_file or ():
        tokens += read_token_file(path)
    defaults = ServerConfig()
    config = ServerConfig(
        host=args.host,
        port=args.port,
        tiers=tuple(args.tier) if args.tier else defaults.tiers,
        tokens=tuple(tokens),
        tls_cert=args.tls_cert or "",
        tls_key=args.tls_key or "",
        tls_client_ca=args.tls_client_ca or "",
        max_chunk_bytes=parse_size(args.max_chunk),
        max_message_bytes=parse_size(args.max_message),
        max_keys=args.max_keys,
        workers=args.workers,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        metrics_port=args.metrics_port,
        shm_dir="" if args.no_shm else args.shm_dir,
        grace=args.grace,
    )
    return serve(config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmtier", description="Multi-tier KV-cache offloading for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("size", help="plan KV memory: bytes per token, per context, what each tier holds")
    _model_args(p)
    p.add_argument("--tokens", required=True, help="context length, e.g. 8k, 128k, 100000")
    p.add_argument("--batch", type=int, default=1, help="concurrent contexts (default 1)")
    p.add_argument("--cpu", help="host-memory tier size, e.g. 64GiB")
    p.add_argument("--disk", help="disk tier size, e.g. 2TiB")
    p.set_defaults(func=cmd_size)

    p = sub.add_parser("keys", help="print the namespace and the chunk keys of a prompt")
    _model_args(p)
    p.add_argument("--tokens-file", required=True, help="JSON list of token ids ('-' for stdin)")
    p.add_argument("--revision", default="", help="model revision")
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--salt", default="", help="tenant / cache salt")
    p.add_argument("--hash", default="xxh3", choices=HASHES)
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser("demo", help="two vLLM engines in two processes: the second skips the first's prefills")
    p.add_argument("--out", default="lmtier-demo", help="where the TTFT plot and JSON go (default ./lmtier-demo)")
    p.add_argument("--docs", type=int, default=3, help="documents (default 3)")
    p.add_argument("--doc-tokens", type=int, default=4096, help="tokens per document (default 4096)")
    p.add_argument("--dir", help="where the demo's temporary files live (default: the system temp dir)")
    p.add_argument("--store-only", action="store_true", help="the embedded store alone, without an engine")
    p.add_argument("--tier", action="append", help="with --store-only: tier URL (repeatable)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("serve", help="run the shared cache server (gRPC), for engines' grpc:// tiers")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=50051, help="port (default 50051; 0 picks a free one)")
    p.add_argument(
        "--tier",
        action="append",
        help="tier URL, fastest first, repeatable (default: cpu://?size=1GiB&slot=256KiB and "
        "file://~/.cache/lmtier/server?size=10GiB)",
    )
    p.add_argument("--token", action="append", help="SECRET[=TENANT]: a bearer token and its tenant (repeatable)")
    p.add_argument("--token-file", action="append", help="a file of SECRET=TENANT lines (repeatable)")
    p.add_argument("--tls-cert", help="server certificate (PEM): turns TLS on")
    p.add_argument("--tls-key", help="the certificate's private key (PEM)")
    p.add_argument("--tls-client-ca", help="CA that signs client certificates: turns mutual TLS on")
    p.add_argument("--metrics-port", type=int, help="serve /metrics, /healthz and /readyz on this port")
    p.add_argument("--max-chunk", default="64MiB", help="largest chunk frame accepted (default 64MiB)")
    p.add_argument("--max-message", default="80MiB", help="largest gRPC message accepted (default 80MiB)")
    p.add_argument("--max-keys", type=int, default=4096, help="keys per request (default 4096)")
    p.add_argument("--workers", type=int, default=16, help="threads serving calls (default 16)")
    p.add_argument("--max-concurrent-rpcs", type=int, default=64, help="calls at once; more are refused (default 64)")
    p.add_argument("--shm-dir", default="/dev/shm", help="where same-host clients' segments live")
    p.add_argument("--no-shm", action="store_true", help="refuse the shared-memory data plane")
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight calls get on shutdown")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (LmtierError, ValueError, OSError) as exc:
        print(f"lmtier {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
