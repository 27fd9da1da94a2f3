"""Which chunks earn a write, and to which tier: the save policy (pure logic, no I/O).

    SavePolicy(name="always", min_tokens=0, keys=65536, min_reuse=0.25)
      seen(keys)                         a request looked these chunks up: count the sighting
      stores(prompt_tokens)              -> bool: is a prompt this long stored at all (min_tokens)
      admit_first(keys, prompt_tokens)   -> int: leading chunks to store in memory now
      admit_lower(keys, hits)            -> [bool]: which chunks earn a lower-tier write
      checkpoint(keys, hits)             -> [bool]: write-back: which chunks still in memory to write now
      let_go(keys, hits)                 write-back: memory let go of chunks written before
      write_mode                         "through" (ask admit_lower at save) or "back" (at eviction)
      stats()                            -> dict of counts, for metrics
    FrequencySketch(keys)                bounded sighting counts: add(key), estimate(key)
    GhostFilter(keys)                    bounded "was this key let go recently?" set

Why a policy at all: engines store every prompt's KV, yet most of it is never read back
(74% of the distinct chunks of Mooncake's conversation trace, 55% of its synthetic
trace's), and every byte of it costs a disk, Redis or network write. Why not the obvious
fix, "store a chunk once it has been seen twice": most reuse that happens is the *first*
reuse, and that rule loses every one of them (0.58x of the offline optimum on a
production trace, where plain LRU kept 0.76-0.99x). What the traces show, and what the
``reuse`` policy does about it:

- Memory is cheap to write and is where a first reuse that comes soon is caught: every
  full chunk goes there (``admit_first`` returns them all).
- The lower tiers are written when memory lets a chunk go (write-back), because by then
  the chunk has shown whether it is reused: a chunk read while resident (``hits``) or
  looked up by two requests (the sketch) is *proven* and is written.
- An *unproven* chunk (never read in memory) is a bet. Whether it pays depends on the
  workload: with memory at 10% of the distinct chunks, 12% of such chunks came back
  later on the conversation trace, 47% on the synthetic one (documents asked about again
  minutes apart), none on a no-reuse workload. So the policy measures it: every unproven
  chunk let go enters a ghost filter (its key, not its bytes), and a later sighting of it
  counts as a return. Unproven chunks are written while the measured return rate is at
  least ``min_reuse`` and skipped below it.
- Write-back does not wait for the eviction to write what it will write anyway: a few
  seconds after a chunk lands in memory the store asks ``checkpoint`` (the decision an
  eviction would make now, without counting a let-go) and writes the chunks it admits,
  so a process that dies (``kill -9``, a pod's stop without grace) loses only its last
  seconds. An unproven chunk it turns away is asked again later (it may prove itself);
  at its eviction, ``let_go`` does the ghost filter's bookkeeping for chunks already written.
- Memory's eviction order stays LRU, each prompt's head most recent. Frequency-aware
  variants were measured and left out: TinyLFU's admission filter and LFU with aging lose
  hits to LRU on both traces (they turn away the first reuses), segmented LRU loses on the
  conversation trace, and one extra lap for proven chunks moved the hit ratio by -2% to +3%
  depending on the workload: not worth a change to the memory tier.

``always`` is today's behaviour (every full chunk to every tier, write-through);
``min_tokens`` is ``always`` for prompts of at least ``min_tokens`` tokens and nothing for
shorter ones. ``reuse`` honours ``min_tokens`` too; its default is 0 because a threshold
of 4096 tokens lost hits on every workload with reuse in benchmarks/bench_trace.py (up to
11%) and saved only 1-4% of the bytes on both Mooncake traces.

What it gives up: a first reuse that comes after memory let the chunk go, on a workload
whose measured return rate is under ``min_reuse``. On the conversation trace, memory at
10% of its chunks in front of a lower tier at 25% or 50%, that is 4% of the hits of
``always``, for 61% and 44% fewer lower-tier writes (at 10%, where ``always`` thrashes the
lower tier, ``reuse`` hits 12% more with 74% fewer writes). And after each start, about
``keys / 2`` unproven chunks are written before a workload without returns is recognised.

Every call is cheap and does no I/O: about 5 us a key in this pure-Python code (one xxh3
hash and a few byte updates, under one lock shared by the engine's calls and the writer
thread), a few milliseconds for a long prompt. A halving of the sketch (every ``2 x
keys`` sightings) copies it once under that lock: about 2 ms at the default size, 0.16 s at
the 4M-key cap. Sightings come from reads (``get``), saves (``put``) and, in an engine,
the lookups that find a prefix the engine then serves from its own prefix cache (the vLLM
connector hands those to its workers, whose memory tier decides at eviction).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import xxhash

from lmtier.errors import ConfigError

POLICIES = ("always", "min_tokens", "reuse")
DEFAULT_POLICY = "always"  # StoreConfig.save_policy's default too
MAX_COUNT = 15  # counters saturate here: 4-bit counters, held one per byte for speed
_HALVE = bytes(i >> 1 for i in range(256))  # bytearray.translate table: every counter halved


def _pow2(n: int) -> int:
    return 1 << max(6, (n - 1).bit_length())


def _hashes(key: bytes) -> tuple[int, int]:
    """Two independent 32-bit hashes of a key; row i of a structure uses h1 + i * h2."""
    h = xxhash.xxh3_64_intdigest(key)
    return h & 0xFFFFFFFF, (h >> 32) | 1


class FrequencySketch:
    """How often each key was seen lately: a count-min sketch with conservative update and
    periodic halving (TinyLFU's aging).

    Memory, fixed at construction: ``depth x width`` bytes, ``width`` the power of two at
    least ``4 x keys``: 16 to 32 bytes per key, 1 MiB for the default 65,536. Counters
    saturate at 15.

    Estimates never under-count a key's sightings since the last halving (count-min only
    over-counts); a halving, every ``window = 2 x keys`` sightings, divides every count by
    two, so what was seen long ago fades. Over-counting needs all ``depth`` cells of a key
    raised by others; with conservative update (only a key's smallest cells grow) and at
    most ``width / 2`` distinct keys between halvings, a key seen once reads 2 or more in
    0.6% of cases at worst (a window of distinct keys, just before a halving) and about
    0.2% when half the sightings are repeats (tests/test_admission.py checks it).
    """

    def __init__(self, keys: int = 1 << 16, depth: int = 4) -> None:
        if keys < 1 or depth < 1:
            raise ConfigError(f"a sketch needs keys >= 1 and depth >= 1, got {keys} and {depth}")
        self.width = _pow2(4 * keys)
        self.depth = depth
        self.window = 2 * keys
        self.nbytes = depth * self.width
        self._counts = bytearray(self.nbytes)
        self._mask = self.width - 1
        self.added = 0  # sightings since the last halving
        self.halvings = 0

    def _cells(self, key: bytes) -> list[int]:
        h1, h2 = _hashes(key)
        w, m = self.width, self._mask
        return [i * w + ((h1 + i * h2) & m) for i in range(self.depth)]

    def estimate(self, key: bytes) -> int:
        counts = self._counts
        return min(counts[c] for c in self._cells(key))

    def add(self, key: bytes) -> int:
        """Count one sighting of ``key``; returns its estimate *before* this sighting."""
        counts = self._counts
        cells = self._cells(key)
        low = min(counts[c] for c in cells)
        if low < MAX_COUNT:
            for c in cells:  # conservative update: only the cells at the minimum grow
                if counts[c] == low:
                    counts[c] = low + 1
        self.added += 1
        if self.added >= self.window:
            self.halve()
        return low

    def halve(self) -> None:
        self._counts = bytearray(self._counts.translate(_HALVE))
        self.added = 0
        self.halvings += 1


class GhostFilter:
    """Keys let go lately, without their bytes: two Bloom filters, the newer taking every
    insertion until it holds ``keys`` of them, then the older one is cleared and they swap.

    A key is remembered for ``keys`` to ``2 x keys`` insertions. Memory, fixed: two filters of
    at least ``16 x keys`` bits (4 to 8 bytes per key). False positives: three probes at 16
    bits per key, about 0.5% per full filter, 1% for the pair; no false negative within
    the remembered span.
    """

    PROBES = 3

    def __init__(self, keys: int = 1 << 16) -> None:
        if keys < 1:
            raise ConfigError(f"a ghost filter needs keys >= 1, got {keys}")
        self.bits = _pow2(16 * keys)
        self.capacity = keys
        self.nbytes = 2 * self.bits // 8
        self._new = bytearray(self.bits // 8)
        self._old = bytearray(self.bits // 8)
        self._mask = self.bits - 1
        self.inserted = 0  # into the newer filter
        self.rotations = 0

    def _bits(self, key: bytes) -> list[int]:
        h1, h2 = _hashes(key)
        return [(h1 + i * h2) & self._mask for i in range(self.PROBES)]

    def add(self, key: bytes) -> bool:
        """Remember ``key``; True when this rotated the filters (the older span was forgotten)."""
        for b in self._bits(key):
            self._new[b >> 3] |= 1 << (b & 7)
        self.inserted += 1
        if self.inserted < self.capacity:
            return False
        self._old, self._new = self._new, bytearray(len(self._new))
        self.inserted = 0
        self.rotations += 1
        return True

    def __contains__(self, key: bytes) -> bool:
        bits = self._bits(key)
        return all(self._new[b >> 3] >> (b & 7) & 1 for b in bits) or all(
            self._old[b >> 3] >> (b & 7) & 1 for b in bits
        )


class SavePolicy:
    """One policy for one store: ``always`` (the default), ``min_tokens`` or ``reuse``.

    ``keys``: the number of chunks the store's tiers hold together (capacity / chunk bytes),
    which sizes the sketch and the ghost filter: 20 to 40 bytes per key in all, 1.25 MiB
    for the default. ``min_tokens``: prompts shorter than this are not stored (policies
    ``min_tokens`` and ``reuse``). ``min_reuse``: the share of unproven chunks that must
    come back after memory let them go for ``reuse`` to keep writing such chunks to the
    lower tiers.
    """

    def __init__(self, name: str = DEFAULT_POLICY, *, min_tokens: int = 0, keys: int = 1 << 16,
                 min_reuse: float = 0.25) -> None:  # fmt: skip
        if name not in POLICIES:
            raise ConfigError(f"unknown save policy {name!r}; choose one of {', '.join(POLICIES)}")
        if min_tokens < 0:
            raise ConfigError(f"min_tokens must be >= 0, got {min_tokens}")
        if not 0.0 <= min_reuse <= 1.0:
            raise ConfigError(f"min_reuse must lie in [0, 1], got {min_reuse}")
        self.name = name
        self.min_tokens = min_tokens
        self.min_reuse = min_reuse
        self.write_mode = "back" if name == "reuse" else "through"
        self._lock = threading.Lock()
        self.sketch = FrequencySketch(keys) if name == "reuse" else None
        self.ghost = GhostFilter(keys) if name == "reuse" else None
        # Unproven chunks let go, and how many of them came back: a pair halved every quarter
        # of ``keys`` chunks let go, so the estimate follows the workload at that pace. It
        # starts at a quarter of ``keys`` that all came back: returns arrive late (a median
        # of ~6,000 chunks after they leave memory on the synthetic trace), and until they can
        # have arrived, no evidence is not evidence of no reuse.
        self._decay_every = max(1, keys // 4)
        self._let_go = self._returned = float(self._decay_every)
        self._since_decay = 0
        self._counts = {"seen": 0, "first": 0, "proven": 0, "unproven_written": 0, "unproven_skipped": 0}

    # -- the calls an engine integration makes --------------------------------------------
    def seen(self, keys: Sequence[bytes]) -> None:
        """A request looked these keys up (once per request): count each sighting, and note
        a chunk that comes back after memory let it go unproven."""
        if self.sketch is None:
            return
        with self._lock:
            self._counts["seen"] += len(keys)
            for key in keys:
                before = self.sketch.add(key)
                if before <= 1 and key in self.ghost:  # its first return since we let it go
                    self._returned += 1

    def stores(self, prompt_tokens: int) -> bool:
        """Whether a prompt of ``prompt_tokens`` tokens is stored at all (``min_tokens``)."""
        return self.name == "always" or prompt_tokens >= self.min_tokens

    def admit_first(self, keys: Sequence[bytes], prompt_tokens: int) -> int:
        """How many leading chunks of this request to store in the first (memory) tier."""
        n = 0 if self.name != "always" and prompt_tokens < self.min_tokens else len(keys)
        with self._lock:
            self._counts["first"] += n
        return n

    def admit_lower(self, keys: Sequence[bytes], hits: Sequence[int] | None = None) -> list[bool]:
        """Which of ``keys`` earn a write to the lower tiers. ``write_mode == "through"``: asked
        at save time (``hits`` unused). ``"back"``: asked when the memory tier lets the chunks
        go, with ``hits`` = how often each was read while resident."""
        if self.sketch is None:
            return [True] * len(keys)
        hits = hits if hits is not None else [0] * len(keys)
        out: list[bool] = []
        with self._lock:
            for key, read in zip(keys, hits, strict=True):
                if self._proven(key, read):
                    self._counts["proven"] += 1
                    out.append(True)
                    continue
                self._let_go_unproven(key)
                bet = self._betting()
                self._counts["unproven_written" if bet else "unproven_skipped"] += 1
                out.append(bet)
        return out

    def checkpoint(self, keys: Sequence[bytes], hits: Sequence[int]) -> list[bool]:
        """Write-back: which chunks still in memory to write to the lower tiers now, as
        their eviction would decide now (proven, or unproven while such chunks come back),
        so that they survive a process that dies before letting them go. Counts the writes
        it admits, not a let-go: the chunks stay in memory (``let_go`` when they leave)."""
        if self.sketch is None:
            return [True] * len(keys)
        out: list[bool] = []
        with self._lock:
            bet = self._betting()
            for key, read in zip(keys, hits, strict=True):
                proven = self._proven(key, read)
                if proven or bet:
                    self._counts["proven" if proven else "unproven_written"] += 1
                out.append(proven or bet)
        return out

    def let_go(self, keys: Sequence[bytes], hits: Sequence[int]) -> None:
        """Write-back: memory let go of chunks a checkpoint wrote down before. Nothing to
        decide; an unproven one enters the ghost filter, so that its return still counts."""
        if self.sketch is None:
            return
        with self._lock:
            for key, read in zip(keys, hits, strict=True):
                if not self._proven(key, read):
                    self._let_go_unproven(key)

    def _proven(self, key: bytes, read: int) -> bool:
        return read > 0 or self.sketch.estimate(key) >= 2  # type: ignore[union-attr]

    def _betting(self) -> bool:
        """Whether unproven chunks are written: enough of those let go came back."""
        return self._returned >= self.min_reuse * self._let_go

    def _let_go_unproven(self, key: bytes) -> None:
        self.ghost.add(key)  # type: ignore[union-attr]
        self._since_decay += 1
        if self._since_decay >= self._decay_every:
            self._since_decay = 0
            self._let_go /= 2
            self._returned /= 2
        self._let_go += 1

    # -- derived --------------------------------------------------------------------------
    @property
    def return_rate(self) -> float:
        """The measured share of unproven chunks that came back after memory let them go."""
        return self._returned / self._let_go

    @property
    def nbytes(self) -> int:
        """The fixed memory of the sketch and the ghost filter."""
        return (self.sketch.nbytes + self.ghost.nbytes) if self.sketch is not None else 0

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"policy": self.name, "return_rate": self.return_rate, "bytes": self.nbytes, **self._counts}
