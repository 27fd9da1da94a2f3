"""The commands that report what a cache holds: ``lmtier stats`` (a running server's tiers,
a disk tier's directory, or an object-storage tier's bucket), ``lmtier match`` (how many
leading tokens of a prompt a server holds, as a router asks it) and ``lmtier inspect`` (a
disk tier's chunks, checked).

They only read: a server is asked through a one-call gRPC client without shared memory,
a disk tier is opened for its index alone with a size bound that evicts nothing (only
``inspect --delete-corrupt`` deletes, through that index). The figures are those a cache
can support: no sum of tiers' bytes (a chunk in memory and on disk would count twice),
no attention kind a stored chunk cannot tell.

    add_stats, add_match, add_inspect (subparsers)  the commands and their flags
    cmd_stats(args)     a server's, a disk tier's or a bucket's chunks, bytes and hit ratio
    cmd_match(args)     the leading tokens of a prompt a server holds, and in which tiers
    cmd_inspect(args)   a disk tier's chunks; with --verify, read and check each one
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from urllib.parse import quote

from lmtier.cli.args import model_args, model_layout, require
from lmtier.cli.keys import engine_namespaces, engine_note, namespace_args, read_tokens
from lmtier.errors import LmtierError
from lmtier.kv.layout import KVLayout
from lmtier.units import format_bytes


def _server_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--server", required=required, help="grpc://host:port (or grpcs://...) of a running lmtier serve")
    p.add_argument("--token", help="bearer token for the server (default: from the URL or LMTIER_TOKEN)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the server (default 5)")


def _server_tier(url: str, token: str | None, timeout: float):
    """A client of a running cache server, for one call (no shared memory)."""
    from lmtier.tiers.base import TierContext, TierURL

    parsed = TierURL.parse(url)
    if parsed.scheme not in ("grpc", "grpcs"):
        raise LmtierError(f"--server takes a grpc:// or grpcs:// URL, got {parsed.shown!r}")
    require("grpc", "grpc", "google.protobuf")
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


def _bucket_stats(url: str, time_limit: float) -> dict:
    from lmtier.errors import TierError
    from lmtier.tiers.s3.survey import survey

    try:
        return survey(url, time_limit)
    except TierError as exc:
        raise LmtierError(f"cannot list the bucket: {exc}") from exc


def cmd_stats(args: argparse.Namespace) -> int:
    if sum(map(bool, (args.server, args.disk, args.bucket))) != 1:
        raise LmtierError("give one of --server URL, --disk PATH or --bucket s3://bucket/prefix?...")
    if args.server:
        out = _server_stats(args.server, args.token, args.timeout)
    elif args.disk:
        out = _disk_stats(Path(args.disk))
    else:
        out = _bucket_stats(args.bucket, args.timeout * 12)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    if args.bucket:
        held = f"{format_bytes(out['used_bytes'])}" + (
            f" of {format_bytes(out['capacity_bytes'])}" if out["capacity_bytes"] else ""
        )
        cut = "" if out["complete"] else " (listing cut short by the time limit: more objects)"
        print(f"s3://{out['bucket']}/{out['prefix']}: {out['chunks']} chunks, {held}, {out['other_objects']} other "
              f"objects; oldest {out['oldest']}, newest {out['newest']}; {out['list_requests']} list requests{cut}. "
              "Request counts of the engines and servers that use it: their /metrics, "
              "lmtier_object_store_requests_total")  # fmt: skip
        return 0
    ratio = "n/a" if out["hit_ratio"] is None else f"{out['hit_ratio']:.1%}"
    if args.disk:
        print(f"{out['disk']}: {out['chunks']} chunks, {format_bytes(out['used_bytes'])} (a directory keeps no "
              "hit counts: its engines' are on their /metrics, vllm:lmtier_tier_reads_total)")  # fmt: skip
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

    tokens = read_tokens(args.tokens_file)
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
        namespaces = engine_namespaces(args, "match")
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
        engine_note(args, "match")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """List a disk tier's chunks; with --verify read each one and check it."""
    from lmtier.errors import IntegrityError
    from lmtier.kv import codec

    root = Path(args.path)
    model = model_layout(args) if args.model or args.config else None
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


def _progress(items, what: str, enabled: bool):
    """A progress bar on stderr (tqdm) when ``enabled`` and stderr is read by a person."""
    try:
        from tqdm import tqdm
    except ImportError:  # an optional nicety
        return items
    if not enabled:
        return items

    return tqdm(items, desc=what, unit="", file=sys.stderr, leave=False, disable=None)


def add_match(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("match", help="for routers: how many leading tokens of a prompt a cache server holds")
    _server_args(p, required=True)
    p.add_argument("--tokens-file", required=True, help="JSON list of token ids ('-' for stdin)")
    p.add_argument(
        "--namespace",
        action="append",
        help="an engine's namespace digest (hex, as its log line or `lmtier keys` prints it), once per "
        "tensor-parallel rank in rank order; without it the namespaces come from --model/--config and the rest",
    )
    model_args(p)
    namespace_args(p)
    p.set_defaults(func=cmd_match)


def add_stats(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stats", help="ask a running server, or read a disk tier: chunks, bytes, hit ratio")
    _server_args(p)
    p.add_argument("--disk", help="a disk tier's directory")
    p.add_argument(
        "--bucket", help="an object-storage tier's URL (s3://bucket/prefix?endpoint=...): listed, never changed"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_stats)


def add_inspect(sub: argparse._SubParsersAction) -> None:
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
