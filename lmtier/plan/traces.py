"""Request traces for ``lmtier plan``: each request is its arrival time, its prompt's full
chunks as chained keys (key *i* names chunk *i* and everything before it, as lmtier's keys
do), and its prompt length in tokens. A plan's key is a 64-bit integer (an xxh3 hash of
its chunk's id, seeded with the key before it): the replay's dictionaries hash and compare
integers faster than lmtier's 32-byte keys, and two of ten million distinct chunks share a
key with a chance of about 3 in a million.

    Request(t, keys, tokens)
    mooncake(path, limit, chunk_tokens)   the Mooncake trace format (../shared/traces)
    request_log(path, limit)              a log of requests: lmtier's own format (below)
    synthetic(name, n, seed, rate, chunk_tokens)   no_reuse, system_prompts, conversations
    load(spec, limit, chunk_tokens)       any of these, named as the command line names it

**Mooncake** (one JSON object per line): ``timestamp`` (ms), ``input_length`` (tokens),
``hash_ids`` (the prompt as a chain of blocks; equal ids at the same position mean an
equal prefix). A trace's block is its chunk (512 tokens in Mooncake's release).

**Request log** (one JSON object per line), what a user writes from their own traffic:

    {"t": 12.5, "tokens": 3100, "chunk_tokens": 256, "chunks": ["9f2c...", "41aa...", ...]}

``t``: seconds from any origin, non-decreasing; ``tokens``: the prompt's length;
``chunk_tokens`` (optional): the engine's chunk, checked against the fleet's; ``chunks``:
one string per full chunk of the prompt, equal strings at the same position meaning an
equal prefix up to there (lmtier's chunk keys in hex, or any stable hash of
each chunk's tokens and those before it). A vLLM engine with ``request_log: PATH`` writes
it (lmtier/engine/requestlog.py).

Either file may be gzip-compressed (a name ending in ``.gz``, in any case).

The partial last chunk of a prompt is never stored by an engine, so it never hits: a
request's keys are its full chunks only.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

from lmtier.errors import ConfigError

log = logging.getLogger(__name__)

SYNTHETIC = ("no_reuse", "system_prompts", "conversations")


class Request(NamedTuple):
    t: float  # arrival, seconds
    keys: list[int]  # the prompt's full chunks, chained
    tokens: int  # the prompt's length


def chain(ids: Iterable[int], salt: int = 0) -> list[int]:
    """Chained keys: each names its id and every id before it (and ``salt``)."""
    keys, key = [], salt
    for i in ids:
        key = xxhash.xxh3_64_intdigest(int(i).to_bytes(8, "little", signed=True), key)
        keys.append(key)
    return keys


def _salt(raw: bytes, after: int = 0) -> int:
    """A chain's start from random bytes (after the key ``after``)."""
    return xxhash.xxh3_64_intdigest(raw, after)


def _lines(path: Path, limit: int | None) -> Iterable[tuple[int, dict]]:
    opener = gzip.open if path.suffix.lower() == ".gz" else open  # a trace may be kept compressed
    try:
        with opener(path, "rt") as f:
            yield from _records(path, f, limit)
    except (OSError, EOFError, UnicodeDecodeError) as exc:  # unreadable, not gzip, cut short, not text
        raise ConfigError(f"{path}: cannot be read as a trace: {exc}") from None


def _records(path: Path, f, limit: int | None) -> Iterable[tuple[int, dict]]:
    """Each line's request object and its line number; ``limit`` requests at most (blank
    lines are not requests). A line is read MAX_LINE characters at most: a file without
    line breaks is an error, not all of it in memory."""
    count = n = 0
    while limit is None or count < limit:
        line = f.readline(MAX_LINE + 1)
        if not line:
            return
        n += 1
        if len(line) > MAX_LINE:
            raise ConfigError(f"{path}:{n}: a line of more than {MAX_LINE:,} characters is not a request")
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:  # not JSON, a number of more digits than Python reads, or
            # arrays nested deeper than its parser goes
            if not line.endswith("\n"):  # the file's last line, cut short by a crash or a full disk
                log.warning("%s:%d: the last line is cut short: left out", path, n)
                return
            raise ConfigError(f"{path}:{n}: not JSON: {str(exc).splitlines()[0]}") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{path}:{n}: a request is a JSON object")
        count += 1
        yield n, record


MAX_LINE = 16 << 20  # characters of one request's line (a million-token prompt's keys are 2 MiB)
MAX_TOKENS = 1 << 40  # a prompt's length: more is not a prompt, and would make a TTFT overflow
MOONCAKE_BLOCK = 512  # tokens of a Mooncake trace's block
MAX_SECONDS = 1e12  # a request's time (30,000 years: Unix times fit; a link's seconds stay exact)
MAX_SYNTHETIC = 2_000_000  # requests of a synthetic workload: a few GiB of keys at most


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"a time is a number, got {value!r}")
    return float(value)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS


def _check_time(path: Path, line: int, t: float, last: float, unit: float = 1.0, name: str = "s") -> float:
    """``t`` (seconds) a time, not before ``last``; errors in the file's own unit (``unit``
    of them a second, named ``name``)."""
    if not 0 <= t <= MAX_SECONDS:
        raise ConfigError(f"{path}:{line}: a request's time must be a number of seconds from 0 to "
                          f"{MAX_SECONDS:g}, not {t * unit!r} {name}")  # fmt: skip
    if t < last:
        raise ConfigError(f"{path}:{line}: the time goes back ({t * unit:g} {name} after {last * unit:g} {name}): "
                          "requests are in arrival order")  # fmt: skip
    return t


def mooncake(path: str | Path, limit: int | None = None, chunk_tokens: int = MOONCAKE_BLOCK) -> list[Request]:
    """A Mooncake trace: its blocks are its chunks, so the fleet's chunk must be its block."""
    if chunk_tokens != MOONCAKE_BLOCK:
        raise ConfigError(f"a Mooncake trace's block is {MOONCAKE_BLOCK} tokens: the fleet's chunk_tokens must be "
                          f"{MOONCAKE_BLOCK}, not {chunk_tokens}")  # fmt: skip
    path, out, last = Path(path), [], 0.0
    for line, r in _lines(path, limit):
        try:
            tokens, ids, t = r["input_length"], r["hash_ids"], _seconds(r.get("timestamp", 0)) / 1000
            if not _count(tokens) or not isinstance(ids, list):
                raise TypeError("input_length is a count of tokens (at most 2**40) and hash_ids a list")
            if not all(type(i) is int and -(1 << 63) <= i < 1 << 63 for i in ids):  # (not true or false)
                raise TypeError("hash_ids are 64-bit integers")
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ConfigError(f"{path}:{line}: a Mooncake request needs input_length and hash_ids ({exc})") from None
        last = _check_time(path, line, t, last, 1000.0, "ms")
        out.append(Request(t, chain(ids[: tokens // chunk_tokens]), tokens))
    return out


def request_log(path: str | Path, limit: int | None = None, chunk_tokens: int | None = None) -> list[Request]:
    """lmtier's request log. Its chunks are chained here (a key names its chunk and every
    one before it), so that equal strings mean an equal prefix only at the same position.
    With ``chunk_tokens`` (the fleet's), a line written by an engine with another chunk
    size, or naming more chunks than its tokens fill, is an error."""
    path, out, last = Path(path), [], 0.0
    for line, r in _lines(path, limit):
        try:
            t, tokens, chunks = _seconds(r["t"]), r["tokens"], r["chunks"]
            if not _count(tokens):
                raise TypeError("tokens is a count of tokens (at most 2**40)")
            if not isinstance(chunks, list) or not all(isinstance(c, str) for c in chunks):
                raise TypeError("chunks must be a list of strings")
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ConfigError(f"{path}:{line}: a request needs t, tokens and chunks ({exc})") from None
        last = _check_time(path, line, t, last)
        if chunk_tokens:
            theirs = r.get("chunk_tokens")
            if theirs is not None and (not _count(theirs) or theirs == 0):
                raise ConfigError(f"{path}:{line}: chunk_tokens is a positive count of tokens, got {theirs!r}")
            if theirs is not None and theirs != chunk_tokens:
                raise ConfigError(f"{path}:{line}: written by an engine with chunks of {theirs} tokens; the fleet's "
                                  f"chunk_tokens is {chunk_tokens}: set chunk_tokens: {theirs}")  # fmt: skip
            if len(chunks) > tokens // chunk_tokens:
                raise ConfigError(f"{path}:{line}: {len(chunks)} chunks of {chunk_tokens} tokens do not fit in "
                                  f"{tokens} tokens: is the fleet's chunk_tokens the engine's?")  # fmt: skip
        keys, key = [], 0
        for c in chunks:
            try:
                key = xxhash.xxh3_64_intdigest(c.encode(), key)
            except UnicodeEncodeError:
                raise ConfigError(f"{path}:{line}: a chunk's string is not text (a lone surrogate)") from None
            keys.append(key)
        out.append(Request(t, keys, tokens))
    return out


def no_reuse(n: int, seed: int = 1, chunk_tokens: int = 512) -> list[tuple[list[int], int]]:
    """Every prompt unique (1-40 chunks): the case where every write is waste."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(chunk_tokens, 40 * chunk_tokens, n)
    return [(chain(range(t // chunk_tokens), _salt(rng.bytes(8))), int(t)) for t in lengths]


def system_prompts(n: int, seed: int = 2, prompts: int = 8, chunk_tokens: int = 512) -> list[tuple[list[int], int]]:
    """A few shared system prompts (2-11 chunks), Zipf popular, in front of unique tails."""
    rng = np.random.default_rng(seed)
    heads = [chain(range(int(rng.integers(2, 12))), _salt(b"system%d" % i)) for i in range(prompts)]
    weights = 1 / np.arange(1, prompts + 1)
    out = []
    for which in rng.choice(prompts, n, p=weights / weights.sum()):
        tail = int(rng.integers(2, 30))
        keys = heads[which] + chain(range(tail), _salt(rng.bytes(8), heads[which][-1]))
        out.append((keys, len(keys) * chunk_tokens + int(rng.integers(0, chunk_tokens))))
    return out


def conversations(n: int, seed: int = 3, chunk_tokens: int = 512) -> list[tuple[list[int], int]]:
    """Chats of geometric length (mean 4 turns), each turn 1-6 chunks longer than the last,
    starting anywhere in the run, turns a mean of 1/8 of the run apart."""
    rng = np.random.default_rng(seed)
    events: list[tuple[float, list[int]]] = []
    while len(events) < n:
        t, keys, salt = float(rng.uniform(0, 1)), [], _salt(rng.bytes(8))
        for _ in range(int(rng.geometric(0.25))):
            keys = keys + chain(range(int(rng.integers(1, 7))), (keys[-1] if keys else salt))
            events.append((t, keys))
            t += float(rng.exponential(1 / 8))
    events.sort(key=lambda e: e[0])
    return [(keys, len(keys) * chunk_tokens + int(rng.integers(0, chunk_tokens))) for _, keys in events[:n]]


def synthetic(name: str, n: int, seed: int = 0, rate: float = 10.0, chunk_tokens: int = 512) -> list[Request]:
    """One of ``SYNTHETIC``, ``n`` requests arriving ``rate`` a second."""
    makers = {"no_reuse": no_reuse, "system_prompts": system_prompts, "conversations": conversations}
    if name not in makers:
        raise ConfigError(f"a synthetic workload is one of {', '.join(SYNTHETIC)}, got {name!r}")
    made = makers[name](n, **({"seed": seed} if seed else {}), chunk_tokens=chunk_tokens)
    return [Request(i / rate, keys, tokens) for i, (keys, tokens) in enumerate(made)]


def load(spec: str, limit: int | None = None, chunk_tokens: int = 512) -> list[Request]:
    """``mooncake:PATH``, ``log:PATH``, or ``synthetic:NAME[:N]`` (N requests, 10,000 by default)."""
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be a positive number of requests, got {limit}")
    kind, _, rest = spec.partition(":")
    if kind == "mooncake":
        return mooncake(rest, limit, chunk_tokens)
    if kind == "log":
        return request_log(rest, limit, chunk_tokens)
    if kind == "synthetic":
        name, _, count = rest.partition(":")
        if count and (not count.isascii() or not count.isdigit() or len(count) > 12 or int(count) == 0):
            raise ConfigError(f"synthetic:NAME:N takes a positive number of requests (at most {MAX_SYNTHETIC:,}), "
                              f"got {count[:20]!r}")  # fmt: skip
        n = int(count) if count else 10_000
        if n > MAX_SYNTHETIC:
            raise ConfigError(f"synthetic:NAME:N makes at most {MAX_SYNTHETIC:,} requests, got {n:,}")
        return synthetic(name, min(n, limit) if limit else n, chunk_tokens=chunk_tokens)
    raise ConfigError(f"a trace is mooncake:PATH, log:PATH or synthetic:NAME[:N], got {spec!r}")
