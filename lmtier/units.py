"""Parsing and printing sizes: ``8GiB``, ``500GB``, ``128K`` tokens.

Bytes: a suffix without ``i`` is decimal (kB = 1,000, MB = 1,000,000), one with ``i`` binary
(KiB = 1,024), whatever its case. Token counts are read as vLLM reads ``--max-model-len``,
by case: lowercase is decimal (``128k`` = 128,000), uppercase binary (``128K`` = 131,072),
so that one context length means the same number in both commands; ``128Ki`` is binary too."""

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
# Token counts, by case as vLLM's ``human_readable_int`` reads them (k, m, g, t decimal; K, M,
# G, T binary), and Ki, Mi, Gi, Ti binary in either case.
_COUNT_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
                "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}  # fmt: skip
_COUNT_UNITS |= {f"{p}i": 1024 ** (n + 1) for n, p in enumerate("kmgt")}
_COUNT_HELP = "k, m, g (powers of 1000), K, M, G or Ki, Mi, Gi (powers of 1024), as vLLM reads them"
_NUMBER = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def _parse(text: str | int, units: dict[str, int], what: str, known: str = "", fold=str.lower) -> int:
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"{what} must not be negative: {text}")
        return text
    match = _NUMBER.match(str(text))
    if not match or fold(match.group(2)) not in units:
        known = known or ", ".join(sorted({u for u in units if u}))
        raise ConfigError(f"cannot parse {what} {text!r} (a number with one of: {known})")
    value = float(match.group(1)) * units[fold(match.group(2))]
    return round(value)


def parse_size(text: str | int) -> int:
    """Bytes from ``"8GiB"``, ``"500GB"``, ``"2TiB"`` or a plain integer."""
    return _parse(text, _BYTE_UNITS, "size")


def parse_count(text: str | int) -> int:
    """A token count as vLLM's ``--max-model-len`` reads it: ``"100k"`` (100,000), ``"128K"``
    (131,072), ``"1m"`` (1,000,000), ``"1M"`` (1,048,576), ``"128Ki"`` (131,072) or
    ``"100000"``."""
    return _parse(text, _COUNT_UNITS, "count", _COUNT_HELP, _count_suffix)


def _count_suffix(suffix: str) -> str:
    """The case matters for k/K and the rest; ``Ki`` is binary in any case."""
    return suffix[0].lower() + "i" if len(suffix) == 2 and suffix[1] in "iI" else suffix


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
