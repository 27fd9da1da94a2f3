"""What several ``lmtier`` commands share before they run: the model they are about, and
the optional dependencies they need.

A command about a model's KV (``size``, ``keys``, ``match``, ``inspect``) names the model the
same way everywhere, so one set of flags and one reading of them; a command that needs an
optional extra says so before it starts, not minutes into it.

    require(extra, *modules)    refuse a command whose optional dependencies are missing
    model_args(parser)          --model, --config, --dtype, --chunk-tokens, --block-size, --json
    model_layout(args)          the KV layout those flags name
    chunk_tokens(args, layout)  tokens per chunk: --chunk-tokens, or as chunk_tokens=auto picks
"""

from __future__ import annotations

import argparse
import importlib.util

from lmtier.config.schema import resolve_chunk_tokens
from lmtier.errors import LmtierError, MissingDependency
from lmtier.kv.layout import PRESETS, KVLayout, from_hf_config, preset


def require(extra: str, *modules: str) -> None:
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


def model_layout(args: argparse.Namespace) -> KVLayout:
    dtype = getattr(args, "dtype", None)  # inspect takes none: a chunk's dtype is in its frame
    if args.config:
        layout = from_hf_config(args.config, dtype=dtype)
    elif args.model:
        layout = preset(args.model)
    else:
        raise LmtierError(f"give --model (one of: {', '.join(sorted(PRESETS))}) or --config config.json")
    return layout.with_dtype(dtype) if dtype else layout


def model_args(p: argparse.ArgumentParser) -> None:
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


def chunk_tokens(args: argparse.Namespace, layout: KVLayout) -> int:
    return resolve_chunk_tokens(args.chunk_tokens or 0, args.block_size, layout.chunk_bytes(1))
