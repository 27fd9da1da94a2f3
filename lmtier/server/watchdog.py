"""``Watchdog``: no call waits on its client for long, and no call lasts for ever.

A call waiting for its client (the next request message, or room to send the next
answer) holds a worker thread of the server; a client that opens calls and then sends
or reads nothing would hold them all. Every such wait is watched: a call that makes no
progress for ``stall`` seconds while waiting on its client, or that has run ``limit``
seconds in all, is cancelled (``RpcContext.cancel``: the client sees ``CANCELLED``, the
worker's wait ends, and the call's ``finally`` blocks run). Work the server itself does
(reading a tier, storing a batch) is never cut short by the stall timeout.

    watchdog = Watchdog(stall=10.0, limit=120.0)
    with watchdog.watch(context) as watch:
        with watch.waiting():           # blocked on the client: counted against ``stall``
            message = next(requests)
    watchdog.stop()

One thread checks every call in flight a few times per ``stall``; entries exist only for
calls in flight (bounded by the server's ``max_concurrent_rpcs``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lmtier import metrics

log = logging.getLogger(__name__)


class Watch:
    __slots__ = ("context", "started", "waiting_since")

    def __init__(self, context: Any) -> None:
        self.context = context
        self.started = time.monotonic()
        self.waiting_since: float | None = None

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """The call is blocked on its client for the duration (each time from zero)."""
        self.waiting_since = time.monotonic()
        try:
            yield
        finally:
            self.waiting_since = None


class Watchdog:
    def __init__(self, stall: float, limit: float) -> None:
        self.stall = stall
        self.limit = limit
        self._calls: dict[int, Watch] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmtier-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def watch(self, context: Any) -> Iterator[Watch]:
        entry = Watch(context)
        with self._lock:
            self._calls[id(entry)] = entry
        try:
            yield entry
        finally:
            with self._lock:
                self._calls.pop(id(entry), None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        interval = max(0.05, min(self.stall, self.limit) / 4)
        while not self._stop.wait(interval):
            now = time.monotonic()
            with self._lock:
                late = []
                for w in self._calls.values():
                    if w.waiting_since is not None and now - w.waiting_since > self.stall:
                        late.append((w, "stalled"))
                    elif now - w.started > self.limit:
                        late.append((w, "over its time"))
                for w, _ in late:
                    self._calls.pop(id(w), None)
            for w, why in late:
                metrics.SERVER_CANCELLED.labels(why).inc()
                log.info("lmtier serve: cancelled a call %s (stall_timeout %ss, call_timeout %ss)", why,
                         self.stall, self.limit)  # fmt: skip
                try:
                    w.context.cancel()
                except Exception:  # the call ended meanwhile
                    log.debug("cancel of a finished call", exc_info=True)
