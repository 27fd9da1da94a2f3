"""Parsing and printing sizes: ``8GiB``, ``500GB``, ``128k`` tokens.

One convention for both: a suffix without ``i`` is decimal (k = 1,000, M = 1,000,000), one
with ``i`` binary (Ki = 1,024, Mi = 1,048,576). ``100k`` tokens are 100,000 tokens, as a
model card's "100k" reads; a context of 131,072 tokens is ``128Ki``."""

from __future__ import annotations

import re

from lmtier.errors import ConfigError

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
# Token counts take the size units without bytes: k, M, G decimal; Ki, Mi, Gi binary. (Counts
# once read k as 1,024, so that 100k meant 102,400 tokens: one suffix, one meaning.)
_COUNT_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}
_NUMBER = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def _parse(text: str | int, units: dict[str, int], what: str, known: str = "") -> int:
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"{what} must not be negative: {text}")
        return text
    match = _NUMBER.match(str(text))
    if not match or match.group(2).lower() not in units:
        known = known or ", ".join(sorted({u for u in units if u}))
        raise ConfigError(f"cannot parse {what} {text!r} (a number with one of: {known})")
    value = float(match.group(1)) * units[match.group(2).lower()]
    return round(value)


def parse_size(text: str | int) -> int:
    """Bytes from ``"8GiB"``, ``"500GB"``, ``"2TiB"`` or a plain integer."""
    return _parse(text, _BYTE_UNITS, "size")


def parse_count(text: str | int) -> int:
    """A token count from ``"100k"`` (100,000), ``"1M"`` (1,000,000), ``"128Ki"`` (131,072)
    or ``"100000"``."""
    return _parse(text, _COUNT_UNITS, "count", "k, M, G (powers of 1000), Ki, Mi, Gi (powers of 1024)")


def _format(n: float, base: int, units: tuple[str, ...], digits: int) -> str:
    for unit in units:
        if abs(n) < base or unit == units[-1]:
            return f"{int(n)} B" if unit == "B" else f"{n:.{digits}g} {unit}"
        n /= base
    raise AssertionError("unreachable")


def format_bytes(n: float) -> str:
    """Binary units, four significant digits: ``1 GiB``, ``320 KiB``, ``30.52 GiB``."""
    return _format(n, 1024, ("B", "KiB", "MiB", "GiB", "TiB", "PiB"), 4)


def format_si(n: float) -> str:
    """Decimal units, three significant digits, as vendors print them: ``32.8 GB``."""
    return _format(n, 1000, ("B", "kB", "MB", "GB", "TB", "PB"), 3)
