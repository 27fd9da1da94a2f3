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
initialization failed. See root cause above.". So an engine process that finds a bad
setting writes it down, and the process that started the engine (``vllm serve``'s API
process or the user's own for ``LLM()``: the leader of their process group, which
imported this module while vLLM validated its config) repeats it, in one line, as it
exits.
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

from lmtier.config import StoreConfig, engine_config, engine_keys
from lmtier.errors import ConfigError, MissingDependency

# kv_connector_extra_config keys: the engine-side settings (lmtier.config.StoreConfig) a
# connector takes per engine, plus the config file and the model's name in the keys.
EXTRA_KEYS = engine_keys()
_STARTED = time.time()


def settings(extra: Mapping[str, Any] | None) -> StoreConfig:
    """The connector's settings from its extra config, every key and tier URL checked."""
    try:
        return engine_config(dict(extra or {}), EXTRA_KEYS, "kv_connector_extra_config")
    except (ConfigError, MissingDependency) as exc:
        if os.getpid() != os.getpgrp():  # an engine process: the group's leader started it
            try:
                _note().write_text(f"{type(exc).__name__}: {exc}")
            except OSError:  # telling it twice is a convenience, never a new failure
                pass
        raise


def _note() -> Path:
    return Path(tempfile.gettempdir()) / f"lmtier-settings-{os.getuid()}-{os.getpgrp()}"


def _repeat_at_exit() -> None:
    """In the process that started the engine: the bad setting an engine process of its
    group found since it started, as its last line."""
    if os.getpid() != os.getpgrp():
        return
    note = _note()
    try:
        message = note.read_text() if note.stat().st_mtime >= _STARTED else None  # else an older group's
        note.unlink()
    except OSError:
        return
    if message:
        print(f"lmtier: {message}", file=sys.stderr, flush=True)


atexit.register(_repeat_at_exit)
