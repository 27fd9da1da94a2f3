"""Every error lmtier raises, in one place.

``LmtierError`` is the root. Errors that a caller may retry (a remote tier that is down,
a timeout) derive from ``RetryableError``; everything else is a bug in the input or the
configuration and retrying will not help.

On the engine's hot path (``lookup``, ``get``, background saves) these never escape:
the store turns them into misses and counts them. They do escape from calls whose
arguments are wrong, because silently ignoring a wrong shape would hide a bug.
"""

from __future__ import annotations


class LmtierError(Exception):
    """Root of every lmtier error."""


class ConfigError(LmtierError, ValueError):
    """A configuration value, URL or size string is invalid."""


class LayoutError(LmtierError, ValueError):
    """A tensor or a stored chunk does not match the expected KV layout."""


class IntegrityError(LmtierError):
    """Stored bytes failed verification (checksum, header, namespace). Treated as a miss."""


class MissingDependency(LmtierError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""

    def __init__(self, module: str, extra: str) -> None:
        how = f"pip install 'lmtier[{extra}]'"
        if extra in ENGINE_EXTRAS:  # an engine's own build, not a plain pip of the extra on every machine
            how += f" (without a GPU: {ENGINE_EXTRAS[extra]}; docs/install.md)"
        super().__init__(f"{module!r} is not installed; install it with: {how}")
        self.module = module
        self.extra = extra


# What an engine extra means on a machine without a GPU: the CPU build, after the CPU torch.
ENGINE_EXTRAS = {"vllm": "python3 scripts/vllm_cpu_env.py VENV in lmtier's checkout makes a vLLM CPU environment"}


class TierError(LmtierError):
    """A tier failed to serve a request."""


class RetryableError(TierError):
    """A transient failure (connection lost, timeout); the call may succeed later."""


class CapacityError(TierError):
    """A chunk cannot be stored because it is larger than the tier could ever hold."""


class FormatError(IntegrityError):
    """Bytes are not a well-formed lmtier chunk (bad magic, version, lengths, header)."""


class ChecksumError(IntegrityError):
    """A chunk's checksum does not match its bytes."""


class LayoutMismatch(IntegrityError, LayoutError):
    """A stored chunk has a different KV layout than the reader expects."""


class NamespaceMismatch(IntegrityError):
    """A stored chunk belongs to another namespace (model, rank, tenant) or key."""
