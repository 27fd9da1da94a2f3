"""Small objects for remote calls: a circuit breaker, a retry backoff, a quiet warning.

    CircuitBreaker   allow() -> bool, success(), failure(), is_open: stop calling a tier
                     that keeps failing, try again later
    Backoff          delays() -> list[float]; call(fn, *args) -> fn's result, retried
                     after each ``RetryableError`` as its attempts and budget allow
    QuietWarning     warning(message, *args): a warning that repeats with every failing
                     call is logged once per interval, with a count of the ones held back
                     (a dead server must not flood the log)

The ``TieredStore`` owns all three, one of each per tier: a tier raises, and the store
decides whether to retry (the tier's ``backoff``), to skip the tier (its breaker) and what
to log.

Closed: calls go through. After ``threshold`` consecutive failures it opens: calls are
skipped (they become misses at once instead of waiting on a dead server) until
``cooldown`` seconds have passed; then one call goes through (half-open) and its outcome
closes or re-opens the breaker.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from lmtier.errors import RetryableError

T = TypeVar("T")


class QuietWarning:
    def __init__(self, logger: logging.Logger, every: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self._log, self.every, self._clock = logger, every, clock
        self._lock = threading.Lock()
        self._next = 0.0
        self._held = 0

    def warning(self, message: str, *args: object) -> None:
        now = self._clock()
        with self._lock:
            if now < self._next:
                self._held += 1
                return
            held, self._held, self._next = self._held, 0, now + self.every
        if held:
            message, args = message + " (and %d more like it since the last)", (*args, held)
        self._log.warning(message, *args)


class CircuitBreaker:
    def __init__(self, threshold: int = 3, cooldown: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.threshold = threshold
        self.cooldown = cooldown
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None
        self._probing = False

    @property
    def is_open(self) -> bool:
        return self._opened_at is not None

    def allow(self) -> bool:
        """Whether a call may go through now."""
        with self._lock:
            if self._opened_at is None:
                return True
            if self._probing or self._clock() - self._opened_at < self.cooldown:
                return False
            self._probing = True  # half-open: let exactly one call try
            return True

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            self._opened_at = None
            self._probing = False

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._probing or self._failures >= self.threshold:
                self._opened_at = self._clock()
            self._probing = False


class Backoff:
    """Retry delays: ``base`` doubling up to ``cap``, with jitter (so clients that failed
    together do not retry together), for at most ``attempts`` retries.

    ``budget`` (seconds, optional): no retry begins once the call has run this long. A
    tier whose calls carry a deadline sets it to that deadline, so a call that waited out
    its deadline (a hung server) is not made to wait it out again, while a failure that
    came at once (a refused connection, a server at its call limit) is retried."""

    def __init__(self, attempts: int = 2, base: float = 0.05, cap: float = 1.0, budget: float | None = None) -> None:
        self.attempts = attempts
        self.base = base
        self.cap = cap
        self.budget = budget

    def delays(self) -> list[float]:
        return [min(self.cap, self.base * 2**i) * (0.5 + random.random() / 2) for i in range(self.attempts)]

    def call(self, fn: Callable[..., T], *args: Any, on_retry: Callable[[], None] | None = None) -> T:
        """``fn(*args)``, called again after each ``RetryableError`` while retries and
        budget last (``on_retry`` runs before each new try); the last failure propagates."""
        if not self.attempts:  # most tiers: the store's hot path pays nothing for retries
            return fn(*args)
        began = time.monotonic()
        for delay in self.delays():
            try:
                return fn(*args)
            except RetryableError:
                if self.budget is not None and time.monotonic() - began >= self.budget:
                    raise
            if on_retry is not None:
                on_retry()
            time.sleep(delay)
        return fn(*args)
