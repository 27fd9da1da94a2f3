"""What the S3 tier learns of its prefix by listing it, in a thread of its own: at start,
then every ``relist`` seconds; never on an engine's path.

    Learner(tier).start() / .stop()
      .step()          one pass: pages until the listing ends or ``list_timeout`` passes

A pass that runs out of time stops where it is, and the next one goes on from there
(``start-after`` the last name seen), at once: a prefix too large for one pass is listed
in several, and only a whole listing forgets what it did not show. Objects other writers
stored since the listing before began go behind what the tier knows; older ones in front
(``Held.learn``). What is over the size is deleted once a pass has learnt what it could,
never in the middle of one, and what is over the count bound after each page (memory).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from lmtier.errors import TierError

log = logging.getLogger(__name__)

DELETE_BATCH = 1000  # deletes in flight at once when a listing finds the prefix over its size
RETRY = 30.0  # seconds before a listing that failed is tried again (at most ``relist``)
# Last-modified times come in whole seconds (SeaweedFS), from the server's clock: an object
# that much older than the listing before is still taken for another writer's new one.
FRESH_SLACK = 5.0


class Learner:
    def __init__(self, tier: Any) -> None:  # an S3Tier (which imports this module)
        self.tier = tier
        self.after = ""  # where an unfinished listing goes on from ("": a new listing)
        self.began = time.time()  # when the current whole listing began
        self.fresh_after = self.began  # objects written since then are another writer's new ones
        self.generation = 0
        self._closed = threading.Event()
        self._one = threading.Lock()  # one pass at a time
        self._thread = threading.Thread(target=self._loop, name=f"s3-list-{tier.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> None:
        self._closed.set()
        self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        relist = self.tier.relist
        while not self._closed.is_set():
            pause = relist
            try:
                whole = self.step()
            except TierError as exc:  # the bucket did not answer: tried again sooner than a relist
                log.warning("%s", exc)
                whole, pause = True, min(relist, RETRY)
            except Exception:
                log.exception("s3 tier %s: listing failed", self.tier.name)
                whole, pause = True, min(relist, RETRY)
            if whole and (not relist or self._closed.wait(pause)):
                return

    def step(self) -> bool:
        """One pass of the listing; whether the listing is whole (it reached the end)."""
        with self._one:
            return self._step()

    def _step(self) -> bool:
        tier = self.tier
        if not self.after:
            self.generation += 1
            self.began = time.time()
        deadline = time.monotonic() + (tier.list_timeout or float("inf"))
        token, seen, whole, pages = "", 0, False, 0
        while not self._closed.is_set() and (pages == 0 or time.monotonic() < deadline):  # a page at least
            pages += 1
            fetched = time.monotonic()
            page, token = tier.remote.list(tier.prefix, token, self.after)
            if page:
                self.after = page[-1][0]
            named = ((tier._key(n), size, modified) for n, size, modified in page)
            objects = [(k, size, m) for k, size, m in named if k is not None and size <= tier.max_object]
            seen += len(objects)
            with tier._lock:
                tier.held.learn(objects, self.generation, self.fresh_after - FRESH_SLACK, fetched)  # type: ignore[arg-type]
                crowded = tier.held.victims(0) if len(tier.held) > tier.held.max_entries else []
            self._delete(crowded)
            if not token:
                whole = True
                break
        if whole:
            self.after = ""
            self.fresh_after = self.began
            with tier._lock:
                tier.held.forget_unlisted(self.generation)
        elif not self._closed.is_set():
            log.info("s3 tier %s: a listing pass ended at its time limit (%d objects); the next goes on", tier.name,
                     seen)  # fmt: skip
        with tier._lock:
            over = tier.held.victims(0)
        self._delete(over)
        tier._count("listed", seen)
        tier._count("listings")  # last: a pass counted is one whose deletes are done
        return whole or self._closed.is_set()

    def _delete(self, keys: list[bytes]) -> None:
        for i in range(0, len(keys), DELETE_BATCH):
            if self._closed.is_set():
                return
            self.tier._delete(keys[i : i + DELETE_BATCH], evicted=True)
