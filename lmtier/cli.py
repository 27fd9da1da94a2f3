"""The ``lmtier`` command: ``serve``, ``stats``, ``match``, ``inspect``, ``size``, ``keys``, ``demo``
(and ``bench``, deprecated: it forwards to ``benchmarks/run.py``). Errors are one line on
stderr and a non-zero exit, a missing optional dependency too (named with the extra that
brings it); ``--json`` where a program reads the output.

Longer than 400 lines: one parser for every subcommand, each a short function beside it."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from urllib.parse import quote

from lmtier.config import resolve_chunk_tokens
from lmtier.errors import LmtierError, MissingDependency
from lmtier.kv.keys import HASHES, Namespace
from lmtier.kv.layout import PRESETS, KVLayout, from_hf_config, preset
from lmtier.kv.sizing import plan
from lmtier.units import format_bytes, parse_count, parse_size


def _require(extra: str, *modules: str) -> None:
    """Refuse a command whose optional dependencies are not installed before it starts, as
    ``MissingDependency`` (one line naming the module and ``pip install 'lmtier[extra]'``),
    rather than with the traceback of an import deep inside it, or minutes into it."""
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package missing, or set to None
            found = False
        if not found:
            raise MissingDependency(name, extra)


def _layout(args: argparse.Namespace) -> KVLayout:
    dtype = getattr(args, "dtype", None)  # inspect takes none: a chunk's dtype is in its frame
    if args.config:
        layout = from_hf_config(args.config, dtype=dtype)
    elif args.model:
        layout = preset(args.model)
    else:
        raise LmtierError(f"give --model (one of: {', '.join(sorted(PRESETS))}) or --config config.json")
    return layout.with_dtype(dtype) if dtype else layout


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


def _read_tokens(path: str) -> list[int]:
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


def _engine_note(args: argparse.Namespace, command: str) -> None:
    """After a digest made without ``--engine``: a vLLM engine on CPU puts its engine
    identity into its namespace, so its digest differs from this one, and nothing else
    would say why or where to read the identity. A note on stderr, after the output."""
    if not args.engine.strip():
        print(f"lmtier {command}: note: no --engine, so this is the digest of an engine without an engine identity "
              "(vLLM on GPU); a vLLM engine on CPU has one in its namespace and logs it at start "
              "(\"engine identity 'vllm-cpu/block=N/isa=...'\"): pass that string as --engine for its digest",
              file=sys.stderr)  # fmt: skip


def _namespaces(args: argparse.Namespace, command: str) -> list[Namespace]:
    """The namespace of each tensor-parallel rank of an engine, as its connector builds
    them (each rank holds its shard of the KV heads)."""
    engine = _engine_identity(args)
    layout = _layout(args)
    size = _chunk_tokens(args, layout)
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


def _server_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--server", required=required, help="grpc://host:port (or grpcs://...) of a running lmtier serve")
    p.add_argument("--token", help="bearer token for the server (default: from the URL or LMTIER_TOKEN)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the server (default 5)")


def _namespace_args(p: argparse.ArgumentParser) -> None:
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
    tokens = _read_tokens(args.tokens_file)
    if not 0 <= args.tp_rank < args.tp_size:
        raise LmtierError(f"--tp-rank must lie in [0, {args.tp_size})")
    ns = _namespaces(args, "keys")[args.tp_rank]
    size = ns.chunk_tokens
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
        _engine_note(args, "keys")
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
    _engine_note(args, "keys")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.store_only:
        _require("torch", "torch")
        from lmtier.demo.embedded import run_demo

        return run_demo(tiers=args.tier or None, directory=args.dir)
    if args.questions < 2:
        raise LmtierError(f"--questions {args.questions}: at least 2 (A's first question prefills, the next hit)")
    _require("vllm", "vllm", "torch", "transformers", "tokenizers")  # the engines, and the model they load
    if args.what == "pd":
        _require("grpc", "grpc")  # the shared tier is lmtier serve
        from lmtier.demo.pd import run_pd_demo

        return run_pd_demo(out_dir=args.out, docs=args.docs, doc_tokens=args.doc_tokens, directory=args.dir)
    from lmtier.demo.vllm import run_vllm_demo

    return run_vllm_demo(
        out_dir=args.out, docs=args.docs, doc_tokens=args.doc_tokens, questions=args.questions, directory=args.dir
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    _require("server", "grpc", "google.protobuf")
    from lmtier.config import load_server_config, parse_token
    from lmtier.server import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.token:
        logging.getLogger("lmtier").warning(
            "--token puts a secret in the command line, which every local user can read (/proc/PID/cmdline): "
            "use --token-file or LMTIER_SERVER_TOKENS"
        )
    flags = {
        "host": args.host,
        "port": args.port,
        "tiers": tuple(args.tier) if args.tier else None,
        "tokens": tuple(parse_token(t) for t in args.token) if args.token else None,
        "token_file": args.token_file,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "tls_client_ca": args.tls_client_ca,
        "tls_identity": args.tls_identity,
        "operators": tuple(args.operator) if args.operator else None,
        "stall_timeout": args.stall_timeout,
        "call_timeout": args.call_timeout,
        "max_chunk_bytes": args.max_chunk,
        "max_message_bytes": args.max_message,
        "max_keys": args.max_keys,
        "workers": args.workers,
        "max_concurrent_rpcs": args.max_concurrent_rpcs,
        "max_calls_per_tenant": args.max_calls_per_tenant,
        "max_call_rate_per_tenant": args.max_call_rate_per_tenant,
        "max_streams_per_connection": args.max_streams_per_connection,
        "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
        "shm_dir": "" if args.no_shm else args.shm_dir,
        "data_channel": False if args.no_data_channel else None,
        "data_port": args.data_port,
        "grace": args.grace,
    }
    config = load_server_config(args.config, **flags)
    return serve(config)


def _server_tier(url: str, token: str | None, timeout: float):
    """A client of a running cache server, for one call (no shared memory)."""
    from lmtier.tiers.base import TierContext, TierURL

    parsed = TierURL.parse(url)
    if parsed.scheme not in ("grpc", "grpcs"):
        raise LmtierError(f"--server takes a grpc:// or grpcs:// URL, got {parsed.shown!r}")
    _require("grpc", "grpc", "google.protobuf")
    from lmtier.tiers.grpc import GrpcTier

    if token or "token" in parsed.options:
        print(
            "lmtier: a token given with --token or ?token= is in the command line, which every local user can "
            "read (/proc/PID/cmdline): set LMTIER_TOKEN instead",
            file=sys.stderr,
        )
    if token:  # encoded: a token may hold '+', '&' or '='
        url += ("&" if "?" in url else "?") + "token=" + quote(token, safe="")
    url += ("&" if "?" in url else "?") + f"shm=off&timeout={timeout}"
    return GrpcTier.from_url(TierURL.parse(url), TierContext())


def _server_stats(url: str, token: str | None, timeout: float) -> dict:
    """Ask a running cache server for its tiers, counters and settings."""
    from lmtier.errors import TierError

    tier = _server_tier(url, token, timeout)
    try:
        server = tier.server_stats(timeout)
    except TierError as exc:
        raise LmtierError(f"cannot get stats from {tier.target}: {exc}") from exc
    finally:
        tier.close()
    tiers = server["tiers"]
    # A chunk missed by one tier is asked of the next: reads are the hits of every tier
    # plus the misses of the last one (the store's counts: probes and internal reads left out).
    hits = sum(t["counters"].get("hits", 0) for t in tiers)
    misses = tiers[-1]["counters"].get("misses", 0) if tiers else 0
    return {
        "server": tier.target,
        "tenant_chunks": server["tenant_chunks"],
        "chunks": server["tenant_chunks"],  # distinct: a chunk in memory and on disk is one
        # no sum of the tiers' bytes: a chunk in memory and on disk would count twice, and
        # no tier holds the sum; each tier's used and capacity bytes are in "tiers"
        "hit_ratio": hits / (hits + misses) if hits + misses else None,
        "tiers": tiers,
        "config": server["config"],
    }


def _disk_frames(root: Path) -> list[tuple[bytes, str, int, int]]:
    """Every chunk of a disk tier's directory: (key, segment path, offset, length)."""
    from lmtier.tiers.disk import DiskTier

    if not (root / "index.sqlite").exists() and not (root / "segments").is_dir() and not (root / "chunks").is_dir():
        raise LmtierError(f"{root} is not an lmtier disk tier (no index.sqlite or segments/)")
    tier = DiskTier(root, size=1 << 62)  # only to read the index; nothing is evicted
    try:
        found = [(key, tier.locate(key)) for key in tier.keys(b"")]
    finally:
        tier.close()
    return [(key, *where) for key, where in found if where is not None]


def _disk_stats(root: Path) -> dict:
    frames = _disk_frames(root)
    return {
        "disk": str(root),
        "chunks": len(frames),
        "used_bytes": sum(length for *_, length in frames),
        "hit_ratio": None,  # a disk keeps no counters; ask the server or /metrics
    }


def cmd_stats(args: argparse.Namespace) -> int:
    if bool(args.server) == bool(args.disk):
        raise LmtierError("give one of --server URL or --disk PATH")
    out = _server_stats(args.server, args.token, args.timeout) if args.server else _disk_stats(Path(args.disk))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    ratio = "n/a" if out["hit_ratio"] is None else f"{out['hit_ratio']:.1%}"
    if args.disk:
        print(f"{out['disk']}: {out['chunks']} chunks, {format_bytes(out['used_bytes'])}, hit ratio {ratio}")
    else:  # what each tier holds: a chunk may be in several, so their bytes add up to nothing held
        held = "; ".join(f"{t['name']} holds {t['chunks']} chunks, {_bytes_of(t)}" for t in out["tiers"])
        print(f"{out['server']}: {out['chunks']} distinct chunks, hit ratio {ratio}; {held}")
    for t in out.get("tiers", ()):
        counters = ", ".join(f"{k} {v}" for k, v in sorted(t["counters"].items()))
        print(f"  {t['name']:<10} {t['chunks']:>8} chunks  {format_bytes(t['used_bytes']):>10} of "
              f"{format_bytes(t['capacity_bytes']):>10}  {counters}")  # fmt: skip
    if out.get("config"):
        print(f"  tenant chunks {out['tenant_chunks']}; settings: {json.dumps(out['config'], sort_keys=True)}")
    return 0


def _bytes_of(tier: dict) -> str:
    """``1.5 MiB of 16 MiB``; a tier that reports no capacity (0) has its bytes alone."""
    used = format_bytes(tier["used_bytes"])
    return f"{used} of {format_bytes(tier['capacity_bytes'])}" if tier.get("capacity_bytes") else used


def cmd_match(args: argparse.Namespace) -> int:
    """How many leading tokens of a prompt a cache server holds (its ``Match``), as a
    router asks it: token ids and the engine's namespace digests."""
    from lmtier.errors import TierError

    tokens = _read_tokens(args.tokens_file)
    if args.chunk_tokens is not None and args.chunk_tokens <= 0:
        raise LmtierError(f"--chunk-tokens must be positive, got {args.chunk_tokens}")
    if args.namespace:
        if args.chunk_tokens is None:
            raise LmtierError("--namespace needs --chunk-tokens (the engine's chunk size)")
        try:
            digests = [bytes.fromhex(h) for h in args.namespace]
        except ValueError as exc:
            raise LmtierError(f"--namespace takes hex digests ({exc})") from exc
        chunk, hash_name = args.chunk_tokens, args.hash
    else:
        namespaces = _namespaces(args, "match")
        digests = [ns.digest for ns in namespaces]
        chunk, hash_name = namespaces[0].chunk_tokens, namespaces[0].hash
    tier = _server_tier(args.server, args.token, args.timeout)
    try:
        out = tier.match(tokens, digests, chunk, hash_name)
    except TierError as exc:
        raise LmtierError(f"match at {tier.target} failed: {exc}") from exc
    finally:
        tier.close()
    out = {"server": tier.target, "prompt_tokens": len(tokens), "chunk_tokens": chunk, **out}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        where = ", ".join(f"{r['chunks']} in {r['tier']}" for r in out["runs"]) or "nothing"
        print(f"{out['server']}: {out['tokens']} of {len(tokens)} tokens held ({out['chunks']} chunks of {chunk}: "
              f"{where})")  # fmt: skip
    if not args.namespace:  # the digests came from --model/--config and the rest
        _engine_note(args, "match")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """List a disk tier's chunks; with --verify read each one and check it."""
    from lmtier.errors import IntegrityError
    from lmtier.kv import codec

    root = Path(args.path)
    model = _layout(args) if args.model or args.config else None
    frames = _disk_frames(root)
    rows, corrupt = [], []
    for key, path, offset, length in _progress(
        frames, "verifying" if args.verify else "listing", enabled=args.verify and not args.quiet
    ):
        row = {"key": key.hex(), "bytes": length}
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                frame = f.read(length)
            header, _ = codec.read_header(frame)
            row["attention"] = _attention_of(header.layout, model)
            row["layout"] = header.layout.describe(row["attention"])
            row["tokens"] = header.num_tokens
            if args.verify:
                codec.decode(frame, key=key)
                row["ok"] = True
        except (IntegrityError, ValueError, OSError) as exc:
            row["ok"] = False
            row["error"] = str(exc)
            corrupt.append(key)
        rows.append(row)
    deleted = 0
    if corrupt and args.delete_corrupt:
        from lmtier.tiers.disk import DiskTier

        tier = DiskTier(root, size=1 << 62)  # only to delete through the index; nothing is evicted
        try:
            tier.delete(corrupt)
            deleted = len(corrupt)
        finally:
            tier.close()
    summary = {"path": str(root), "chunks": len(rows), "corrupt": len(corrupt), "deleted": deleted}
    if args.json:
        print(json.dumps({**summary, "chunks_list": rows[: args.limit]}, indent=2))
    else:
        for row in rows[: args.limit]:
            state = "" if "ok" not in row else ("ok" if row["ok"] else f"CORRUPT: {row['error']}")
            print(f"{row['key']}  {row['bytes']:>10}  {row.get('layout', '?')}  {state}")
        print(f"{len(rows)} chunks, {len(corrupt)} corrupt" + (f", {deleted} deleted" if deleted else ""))
    return 1 if corrupt and not deleted else 0


def _attention_of(stored: KVLayout, model: KVLayout | None) -> str | None:
    """The attention kind of a stored chunk: its frame records the KV heads (of one
    tensor-parallel rank) but not the query heads, so only MLA shows without the model;
    with it (``--model``/``--config``), the model's kind for the chunks shaped like its own
    or one rank's share of its KV heads."""
    if model is None:
        return stored.attention
    alike = (stored.num_layers, stored.head_dim, stored.mla) == (model.num_layers, model.head_dim, model.mla)
    return (model if alike and model.num_kv_heads % stored.num_kv_heads == 0 else stored).attention


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
# directory's: a command must not run whatever lies there.
_BENCH_RUNNERS = (Path(__file__).resolve().parent.parent / "benchmarks" / "run.py",)


def _progress(items, what: str, enabled: bool):
    """A progress bar on stderr (tqdm) when ``enabled`` and stderr is read by a person."""
    try:
        from tqdm import tqdm
    except ImportError:  # an optional nicety
        return items
    if not enabled:
        return items

    return tqdm(items, desc=what, unit="", file=sys.stderr, leave=False, disable=None)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line: ``lmtier serve: error: ...``, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lmtier", description="Multi-tier KV-cache offloading for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("size", help="plan KV memory: bytes per token, per context, what each tier holds")
    _model_args(p)
    p.add_argument(
        "--tokens", required=True, help="context length: 100000, 100k (100,000), 1M (1,000,000) or 128Ki (131,072)"
    )
    p.add_argument("--batch", type=int, default=1, help="concurrent contexts (default 1)")
    p.add_argument("--cpu", help="host-memory tier size, e.g. 64GiB")
    p.add_argument("--disk", help="disk tier size, e.g. 2TiB")
    p.set_defaults(func=cmd_size)

    p = sub.add_parser("keys", help="print the namespace and the chunk keys of a prompt")
    _model_args(p)
    p.add_argument("--tokens-file", required=True, help="JSON list of token ids ('-' for stdin)")
    p.add_argument("--tp-rank", type=int, default=0)
    _namespace_args(p)
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser("match", help="for routers: how many leading tokens of a prompt a cache server holds")
    _server_args(p, required=True)
    p.add_argument("--tokens-file", required=True, help="JSON list of token ids ('-' for stdin)")
    p.add_argument(
        "--namespace",
        action="append",
        help="an engine's namespace digest (hex, as its log line or `lmtier keys` prints it), once per "
        "tensor-parallel rank in rank order; without it the namespaces come from --model/--config and the rest",
    )
    _model_args(p)
    _namespace_args(p)
    p.set_defaults(func=cmd_match)

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

    p = sub.add_parser("serve", help="run the shared cache server (gRPC), for engines' grpc:// tiers")
    p.add_argument("--config", help="a YAML / TOML / JSON config file (its server: section); flags override it")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, help="port (default 50051; 0 picks a free one)")
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
    p.add_argument("--metrics-host", help="the metrics port's address (default: the gRPC address, --host)")
    p.add_argument("--max-chunk", help="largest chunk frame accepted (default 64MiB)")
    p.add_argument("--max-message", help="largest gRPC message accepted (default 16MiB; a client's pieces are 4MiB)")
    p.add_argument("--max-keys", type=int, help="keys per request (default 4096)")
    p.add_argument("--workers", type=int, help="threads serving calls (default 16)")
    p.add_argument("--max-concurrent-rpcs", type=int, help="calls at once; more are refused (default 64)")
    p.add_argument(
        "--max-calls-per-tenant",
        type=int,
        help="calls of one tenant at once; more are refused (default: half the workers when several tenants "
        "share the server, all of them for one)",
    )
    p.add_argument(
        "--tls-identity",
        choices=["auto", "cn", "uri", "dns"],
        help="what names a mutual-TLS client's tenant (default auto: common name, else URI, else DNS name)",
    )
    p.add_argument("--operator", action="append", help="a tenant that sees the whole server in stats (repeatable)")
    p.add_argument(
        "--max-call-rate-per-tenant", type=float, help="calls one tenant may start per second (default 0: no limit)"
    )
    p.add_argument("--stall-timeout", type=float, help="seconds a call may wait on its client (default 10)")
    p.add_argument("--call-timeout", type=float, help="seconds any call may run (default 300)")
    p.add_argument(
        "--max-streams-per-connection", type=int, help="streams of one connection at once; more wait (default 16)"
    )
    p.add_argument("--shm-dir", help="where same-host clients' segments live (default /dev/shm)")
    p.add_argument("--no-shm", action="store_true", help="refuse the shared-memory data plane")
    p.add_argument(
        "--data-port", type=int, help="the bulk data channel's port, for other hosts' loads (default: --port + 1)"
    )
    p.add_argument("--no-data-channel", action="store_true", help="serve other hosts' loads through gRPC alone")
    p.add_argument("--grace", type=float, help="seconds in-flight calls get on shutdown (default 10)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("stats", help="ask a running server, or read a disk tier: chunks, bytes, hit ratio")
    _server_args(p)
    p.add_argument("--disk", help="a disk tier's directory")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("inspect", help="list a disk tier's chunks; --verify finds corrupt ones")
    p.add_argument("path", help="the disk tier's directory")
    p.add_argument(
        "--model", help="the model of the chunks, a preset: names their attention kind (chunks record KV heads only)"
    )
    p.add_argument("--config", help="the model's Hugging Face config.json, instead of --model")
    p.add_argument("--verify", action="store_true", help="read every chunk and check its checksum")
    p.add_argument("--delete-corrupt", action="store_true", help="with --verify: delete the chunks that fail")
    p.add_argument("--limit", type=int, default=50, help="chunks listed (default 50; all are checked)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_inspect)

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
    except ModuleNotFoundError as exc:  # one that _require could not foresee (a dependency's own)
        if (exc.name or "lmtier").split(".")[0] == "lmtier":
            raise  # lmtier's own: a bug, with its traceback
        print(
            f"lmtier {args.command}: error: {exc.name!r}, which this command needs, is not installed", file=sys.stderr
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
