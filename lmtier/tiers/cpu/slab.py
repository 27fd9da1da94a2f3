"""The memory tier's host memory: one slab cut into fixed slots, and which slots are free.
Bytes and slots only; which chunk holds which slots, and what goes to make room, is the
index's and the tier's business (the tier's lock guards all of it).

Free slots are kept as runs (start -> length, coalesced as slots come back), and a chunk
takes one run of the slots it needs wherever one is free: the start of the shortest run
that fits (a fresh slab is one run, handed out from slot 0 up). A chunk then lies in one
piece of the slab (one zero-copy view, publishable to same-host readers), and a chunk
evicted leaves a run that its successor of the same size fits exactly. Only when no free
run is long enough (chunks of other sizes around) is a chunk spread over several runs, the
longest first, and read back gathered from them. The slab is pinned when CUDA
is present (copies to the GPU can then be asynchronous), or a named shared-memory segment
when the tier's chunks are published to clients; it is mapped on first use, and its pages
are faulted in by a background thread a little ahead of the slots handed out
(``buffers.Prefault``), so a save copies into mapped memory instead of paying page faults
on the engine's save path.

    Slab(num_slots, slot_bytes, pin, shared_dir)
      .ensure() -> array                  the slab, mapped (and prefaulting) on first use
      .locate(data) -> offset | None      where a view of one run of the slab lies in it
      .available                          how many slots are free
      .take(count) -> [slot]              ``count`` free slots, ascending, one run where one is free
      .give(slots)                        slots free again
      .views(array, slots, nbytes)        a chunk's bytes in its slots, one view per run
      .close()                            forget the slab (leased views keep it alive)
    is_run(slots) -> bool                 whether slots are one run of the slab
    scatter(src, views)                   a chunk's bytes copied into the views of its slots
"""

from __future__ import annotations

import mmap
import sys

import numpy as np

from lmtier.buffers import Prefault
from lmtier.kv.chunk import iter_segments
from lmtier.transport.shm.segment import Segment

PREFAULT_AHEAD = 256 << 20  # memory faulted in beyond the highest slot handed out so far


class Slab:
    """One tier's slab and its free slots; made anew in a forked child, which starts empty
    (the parent's mapping, segment and prefaulting thread are the parent's)."""

    def __init__(self, num_slots: int, slot_bytes: int, pin: bool | None, shared_dir: str) -> None:
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        self.capacity = num_slots * slot_bytes
        self._pin = pin
        self._shared_dir = shared_dir
        self.array: np.ndarray | None = None
        self.segment: Segment | None = None  # the shared-memory segment holding it, when shared
        self.prefault: Prefault | None = None
        self._runs = _Runs(num_slots)

    def ensure(self) -> np.ndarray:
        if self.array is None:
            if self._shared_dir:
                self.segment = Segment(self._shared_dir, self.capacity, self.slot_bytes)
                self.segment.protect()  # clients map it read-only; none may cut it short
                self.array, region = np.frombuffer(self.segment.map, dtype=np.uint8), self.segment.map
            else:
                self.array, region = _allocate(self.capacity, self._pin)
            if region is not None:  # slots are handed out from slot 0 up: fault them in ahead
                self.prefault = Prefault(region, PREFAULT_AHEAD)
                self.prefault.need(0)
        return self.array

    def locate(self, data: np.ndarray) -> int | None:
        slab = self.array
        if slab is None or not data.flags.c_contiguous:
            return None
        offset = data.__array_interface__["data"][0] - slab.__array_interface__["data"][0]
        return offset if offset >= 0 and offset + data.size <= slab.size else None

    @property
    def available(self) -> int:
        return self._runs.free

    def take(self, count: int) -> list[int]:
        slots = self._runs.take(count)
        if self.prefault is not None:
            self.prefault.need((slots[-1] + 1) * self.slot_bytes)
        return slots

    def give(self, slots: list[int]) -> None:
        self._runs.give(slots)

    def views(self, array: np.ndarray, slots: list[int], nbytes: int) -> list[np.ndarray]:
        """``array``: the slab as the caller found it under the lock (a close meanwhile
        forgets ``self.array``, not the memory)."""
        if is_run(slots):
            start = slots[0] * self.slot_bytes
            return [array[start : start + nbytes]]
        views, left = [], nbytes
        for slot in slots:
            start = slot * self.slot_bytes
            take = min(left, self.slot_bytes)
            views.append(array[start : start + take])
            left -= take
        return views

    def close(self) -> None:
        self._runs = _Runs(0)
        self.array = None  # leased views keep their memory alive until released
        if self.prefault is not None:
            self.prefault.close()
            self.prefault = None  # it holds the mapping: let it go with the slab
        if self.segment is not None:
            self.segment.close()


class _Runs:
    """Free slots as maximal runs: ``start -> length``, ``end -> start`` to coalesce a run
    given back with its neighbours, and the starts of the runs of each length (few distinct
    lengths: they sum to at most the slots), so a fit is found without a scan of the slab."""

    def __init__(self, num_slots: int) -> None:
        self.free = 0
        self._length: dict[int, int] = {}
        self._start_of_end: dict[int, int] = {}
        self._starts: dict[int, set[int]] = {}
        if num_slots:
            self._add(0, num_slots)

    def _add(self, start: int, length: int) -> None:
        self._length[start] = length
        self._start_of_end[start + length] = start
        self._starts.setdefault(length, set()).add(start)
        self.free += length

    def _remove(self, start: int) -> int:
        length = self._length.pop(start)
        del self._start_of_end[start + length]
        starts = self._starts[length]
        starts.discard(start)
        if not starts:
            del self._starts[length]
        self.free -= length
        return length

    def take(self, count: int) -> list[int]:
        if count > self.free:
            raise ValueError(f"{count} slots asked, {self.free} free")
        fits = [n for n in self._starts if n >= count]
        if fits:
            length = min(fits)
            start = next(iter(self._starts[length]))
            self._remove(start)
            if length > count:
                self._add(start + count, length - count)
            return list(range(start, start + count))
        slots: list[int] = []  # no run long enough: the longest ones, until there are enough
        while len(slots) < count:
            start = next(iter(self._starts[max(self._starts)]))
            length = self._remove(start)
            used = min(length, count - len(slots))
            if used < length:
                self._add(start + used, length - used)
            slots.extend(range(start, start + used))
        return sorted(slots)

    def give(self, slots: list[int]) -> None:
        i = 0
        ordered = sorted(slots)
        while i < len(ordered):  # each run of the slots given, merged with its free neighbours
            j = i
            while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
                j += 1
            start, end = ordered[i], ordered[j] + 1
            if start in self._start_of_end:
                before = self._start_of_end[start]
                self._remove(before)
                start = before
            if end in self._length:
                end += self._remove(end)
            self._add(start, end - start)
            i = j + 1


def is_run(slots: list[int]) -> bool:
    """Whether an entry's ``slots`` (distinct, in order: ``Slab.take``) are one run of the slab."""
    return slots[-1] - slots[0] == len(slots) - 1


def _allocate(nbytes: int, pin: bool | None) -> tuple[np.ndarray, mmap.mmap | None]:
    """The slab: pinned through torch when CUDA is present (or asked for: pinned memory is
    resident from the start), else an anonymous mapping, returned too for prefaulting."""
    torch = sys.modules.get("torch")
    if pin is None:
        pin = bool(torch is not None and torch.cuda.is_available())
    if pin:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy(), None
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(region, dtype=np.uint8), region


def scatter(src: np.ndarray, dst: list[np.ndarray]) -> None:
    """Copy the canonical bytes of a (possibly strided) 4-d chunk into slot views."""
    if len(dst) == 1:
        np.copyto(dst[0].reshape(src.shape), src)
        return
    it = iter(dst)
    out, pos = next(it), 0
    for seg in iter_segments(src):
        done = 0
        while done < seg.size:
            if pos == out.size:
                out, pos = next(it), 0
            n = min(seg.size - done, out.size - pos)
            out[pos : pos + n] = seg[done : done + n]
            pos += n
            done += n
