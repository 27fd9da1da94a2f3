"""The vLLM connector's settings: checked before anything is opened, and a bad one told
as the last thing the user sees.

    settings(extra) -> StoreConfig    every key and tier URL checked (``ConfigError`` or
                                      ``MissingDependency``, one line naming what is wrong)

vLLM 0.32 hands a connector its settings before the model loads in one place only: its
own config validation asks ``requires_piecewise_for_cudagraph`` on engines with full CUDA
graphs (its default on GPUs), in the process that parsed the command line; the error
then ends that process's output. Elsewhere (``--enforce-eager``, the CPU build) the first
lmtier code to run is the connector, made in the engine core and the workers after the
model has loaded, and its error is followed there by vLLM's shutdown and "Engine core
initialization failed. See root cause above.". So the first process of an engine to
import this module (``vllm serve``'s API process, or the user's own for ``LLM()``: vLLM
imports it there while it validates its config) names a note for its children in their
environment; an engine process that finds a bad setting writes it there, and the first
process repeats it, in one line, as it exits.
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmtier.config.loading import engine_config, engine_keys
from lmtier.config.schema import StoreConfig
from lmtier.errors import ConfigError, MissingDependency

# kv_connector_extra_config keys: the engine-side settings (lmtier.config.StoreConfig) a
# connector takes per engine, plus the config file and the model's name in the keys.
EXTRA_KEYS = engine_keys()
NOTE_ENV = "_LMTIER_SETTINGS_NOTE"  # the first process's note, inherited by the engine's processes


def settings(extra: Mapping[str, Any] | None, kv_role: str | None = None) -> StoreConfig:
    """The connector's settings from its extra config, every key and tier URL checked, and
    (given vLLM's ``kv_role``) that its tiers can serve the role."""
    try:
        config = engine_config(dict(extra or {}), EXTRA_KEYS, "kv_connector_extra_config")
        if kv_role is not None:
            from lmtier.connectors.vllm.pd import role_of

            role_of(kv_role, config)
        return config
    except (ConfigError, MissingDependency) as exc:
        note = os.environ.get(NOTE_ENV)
        if note and os.getpid() != _OWNER:  # an engine process: the first one tells it last
            try:
                Path(note).write_text(f"{type(exc).__name__}: {exc}")
            except OSError:  # telling it twice is a convenience, never a new failure
                pass
        raise


def _repeat_at_exit() -> None:
    """In the first process: the bad setting one of the engine's processes found, as its
    last line (a child forked from it has inherited this hook: not its to run)."""
    if os.getpid() != _OWNER:
        return
    try:
        message = Path(_OWN_NOTE).read_text()
        os.unlink(_OWN_NOTE)
    except OSError:
        return
    print(f"lmtier: {message}", file=sys.stderr, flush=True)


_OWN_NOTE, _OWNER = "", -1
if NOTE_ENV not in os.environ:  # the first process to import it: its children inherit the name
    _OWNER = os.getpid()
    _OWN_NOTE = os.path.join(tempfile.gettempdir(), f"lmtier-settings-{os.getpid()}-{time.time_ns()}")
    os.environ[NOTE_ENV] = _OWN_NOTE
    atexit.register(_repeat_at_exit)
