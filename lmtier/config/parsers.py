"""How each configuration key's value is parsed: the parser named beside its field.

A value from a file, an ``LMTIER_*`` variable or a flag becomes its field's through the
parser named beside the field (``setting(default, PARSER)``), as a tier URL's options do
through ``Tier.OPTIONS``. A parser raises TypeError / ValueError for a value of the wrong
kind (the loader then says what the key expects) or ConfigError in its own words.

    Parser(parse, expects, secret=False)   a parser and what it expects, for error messages
    setting(default, parser)               a configuration field: its default and its parser
    INTEGER, OPTIONAL_INTEGER, CHUNK_TOKENS, NUMBER, BOOL, STRING, STRINGS, SIZE, TOKENS
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmtier.config.tokens import parse_token
from lmtier.units import parse_size


@dataclass(frozen=True)
class Parser:
    parse: Callable[[Any], Any]
    expects: str  # in "port (environment) must be an integer, got 'many'"
    secret: bool = False  # a rejected value is not shown (tokens)


def _int(value: Any) -> int:
    if isinstance(value, (bool, float)):
        raise TypeError("expected an integer")
    return int(value)


def _optional_int(value: Any) -> int | None:
    return None if value in (None, "", "none", "off") else _int(value)


def _chunk_tokens(value: Any) -> int:
    return 0 if value == "auto" else _int(value)


def _float(value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError("expected a number")
    return float(value)


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("expected a string")
    return value


def _strings(value: Any) -> tuple[str, ...]:
    """A list of strings, or one whitespace-separated string (an environment variable)."""
    items = value.split() if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
        raise TypeError("expected a list of strings")
    return tuple(items)


def _tokens(value: Any) -> tuple[tuple[str, str], ...]:
    """``SECRET=TENANT`` strings (a map would merge every tenant into one), or (secret,
    tenant) pairs from code."""
    if isinstance(value, (list, tuple)) and all(
        isinstance(t, (list, tuple)) and len(t) == 2 and all(isinstance(x, str) for x in t) for t in value
    ):
        return tuple(tuple(t) for t in value)
    return tuple(parse_token(t) for t in _strings(value))


INTEGER = Parser(_int, "an integer")
OPTIONAL_INTEGER = Parser(_optional_int, "an integer")  # none, off or "": None
CHUNK_TOKENS = Parser(_chunk_tokens, "an integer or auto")  # "auto": 0
NUMBER = Parser(_float, "a number")
BOOL = Parser(_bool, "true or false")
STRING = Parser(_str, "a string")
STRINGS = Parser(_strings, "a list of strings")
SIZE = Parser(parse_size, "a size such as 8MiB")  # bytes, or a number and a unit
TOKENS = Parser(_tokens, "a list of SECRET=TENANT strings", secret=True)


def setting(default: Any, parser: Parser) -> Any:
    """A configuration field: its default and its parser."""
    return field(default=default, metadata={"parser": parser})
