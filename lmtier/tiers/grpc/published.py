"""The grpc tier's reads through a same-host server's published directory (``lmtier.transport.directory``).

    DirectoryReads(memory, wanted, ask, send, on_damage, count)
        warm()                         map the pages of the chunks published now, in the
                                       background, off the first loads' path
        contains(keys) -> int          the leading run of ``keys`` the directory names
        get(keys) -> list[Chunk]       that run as chunks over the server's memory, verified
                                       as the engine copies them (no call at all)
        report()                       tell the server what was read since the last report
                                       (reads left unreported are sent ``REPORT_EVERY_S``
                                       later, and at close, so the server counts them all)

A server with one tenant publishes where its memory tier's chunks lie; the client asks it
once for the directory's name (``ask``: the ``Directory`` call), maps it read-only with the
slab it names (``SharedMemory.attach``) and from then on finds chunks there. A chunk read
so is a view of the server's memory, like one lent by a ``Get``, but holds no lease: it is
*volatile* (``lmtier.kv.chunk``), checked where it is copied and only as it was copied. If
the server evicts it before the engine copies it, the copy fails its checksum, or the
entry's move is seen after the copy, and it is a miss (counted in ``directory_races``);
a failed check of an entry that did not move is damage, and the server's copy is deleted
(``on_damage``). The reads are reported to the server
(``send``, without waiting) every ``REPORT_EVERY_S`` or ``REPORT_KEYS`` chunks and before a
write, so that it keeps what is read, as a ``Get`` would make it. A directory whose server
stops beating is dropped and asked for again, as is one the server's answer no longer
names (a restarted server).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import grpc

from lmtier.errors import IntegrityError, NamespaceMismatch
from lmtier.kv import codec
from lmtier.kv.chunk import Chunk
from lmtier.tiers.grpc.memory import SharedMemory
from lmtier.transport.directory import DirectoryReader, Entry

ASK_S = 5.0  # a server without a directory readable here is asked again after this long
REPORT_KEYS = 1024  # chunks read through the directory reported in one call at most
REPORT_EVERY_S = 0.5  # ... and at least this often while reads go on
log = logging.getLogger(__name__)

HEADS_KEPT = 16384  # parsed frame heads of directory entries (a few hundred bytes each)
WARM_BYTES = 8 << 30  # the most of the server's published chunks whose pages ``warm`` maps


def _checked_length(head: bytes) -> int:
    """The payload length of a directory entry's head, checked as a whole frame head (a
    torn or foreign head raises): what ``warm`` may map for it."""
    length = codec.payload_length(head)
    codec.read_head(head, length)
    return length


class DirectoryReads:
    def __init__(
        self,
        memory: SharedMemory,
        wanted: bool,
        ask: Callable[[], str],
        send: Callable[[list[bytes], Callable[[str], None]], None],
        on_damage: Callable[[bytes], None],
        count: Callable[[str, int], None],
    ) -> None:
        self.memory, self.wanted = memory, wanted
        self._ask, self._send, self._on_damage, self._count = ask, send, on_damage, count
        self._ask_after = 0.0
        self._read: deque[list[bytes]] = deque(maxlen=REPORT_KEYS)  # batches read, not yet reported
        self._unreported = 0
        self._reported_at = 0.0
        self._heads: dict[bytes, codec.Header] = {}  # an entry's head -> its parse, checked
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._timer: threading.Timer | None = None  # reports what the last reads left unreported

    def reader(self) -> DirectoryReader | None:
        """The server's directory, if it has one readable here."""
        reader = self.memory.published
        if reader is not None or not self.wanted or not self.memory.wanted:
            return reader
        if time.monotonic() < self._ask_after:
            return None
        self._ask_after = time.monotonic() + ASK_S
        try:
            name = self._ask()
        except grpc.RpcError:  # an older server (UNIMPLEMENTED) or none: the calls say the rest
            return None
        self.memory.attach(name)
        return self.memory.published

    def warm(self) -> None:
        """Start mapping the pages of what the server publishes now (once per directory
        mapped in this process): the first load of each chunk otherwise maps them on the
        engine's path."""
        reader = self.reader()
        with self._lock:
            if reader is None or reader.warmed:
                return
            reader.warmed = True
        threading.Thread(target=self._populate, args=(reader,), name="lmtier-directory-warm", daemon=True).start()

    def _populate(self, reader: DirectoryReader) -> None:
        try:
            mapped = reader.populate(_checked_length, WARM_BYTES, self._closed.is_set)
        except Exception as exc:  # only a saving on the first loads is lost
            log.info("directory %s: its pages were not mapped ahead: %s", reader.name, exc)
        else:
            self._count("directory_warmed_bytes", mapped)

    def forget(self) -> None:
        """In a forked child: ask for the directory at once, with locks of its own (and no
        timer: the parent's thread is not here)."""
        self._ask_after = 0.0
        self._lock = threading.Lock()
        self._timer = None

    def close(self) -> None:
        """Stop warming (at the thread's next entry) and reporting later; the caller sends
        the last report first (``report``), while its channel is open."""
        self._closed.set()
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def contains(self, keys: Sequence[bytes]) -> int:
        reader = self.reader()
        n = 0
        while reader is not None and n < len(keys) and reader.find(keys[n]) is not None:
            n += 1
        return n

    def get(self, keys: Sequence[bytes]) -> list[Chunk]:
        reader = self.reader()
        if reader is None:
            return []
        out: list[Chunk] = []
        for key in keys:
            entry = reader.find(key)
            if entry is None:
                break
            try:
                chunk = self._chunk(reader, entry)
            except IntegrityError:
                self._damaged(reader, entry)
                break
            out.append(chunk)
        if out:
            self._count("directory_reads", len(out))
            with self._lock:
                self._read.append([c.key for c in out])
                self._unreported += len(out)
                due = self._unreported >= REPORT_KEYS or time.monotonic() - self._reported_at >= REPORT_EVERY_S
                later = None
                if not due and self._timer is None and not self._closed.is_set():
                    # no read may come after these: report them in a moment anyway
                    later = self._timer = threading.Timer(REPORT_EVERY_S, self.report)
                    later.daemon = True
            if due:
                self.report()
            elif later is not None:  # started here: a report meanwhile may have cancelled it (then it ends at once)
                later.start()
        return out

    def _chunk(self, reader: DirectoryReader, entry: Entry) -> Chunk:
        payload = reader.payload(entry, codec.payload_length(entry.head))
        header = self._heads.get(entry.head)
        if header is None:  # parsed and checked once per version of an entry
            header = codec.read_header(entry.head, payload)[0]
            if header.key != entry.key:
                raise NamespaceMismatch("chunk is stored under another key")
            if len(self._heads) >= HEADS_KEPT:
                self._heads.clear()
            self._heads[entry.head] = header
        return Chunk.from_buffer(
            entry.key,
            header.layout,
            header.num_tokens,
            payload,
            namespace=header.namespace,
            checksum=header.payload_sum,
            verified=False,  # checked as the engine copies it out
            on_corrupt=lambda: self._damaged(reader, entry),
            volatile=lambda: not reader.moved(entry),  # no lease: the server may reuse the slot
        )

    def _damaged(self, reader: DirectoryReader, entry: Entry) -> None:
        """A chunk read through the directory failed its check: a race with its eviction
        when its entry moved meanwhile (a miss), damage otherwise."""
        if reader.moved(entry):
            self._count("directory_races", 1)
        else:
            self._on_damage(entry.key)

    def report(self) -> None:
        reader = self.memory.published
        with self._lock:
            timer, self._timer = self._timer, None
            if timer is not None:
                timer.cancel()  # this report carries its reads (no-op when it is the timer)
            if not self._read:
                return
            # The latest batch first, each in its own order: the server makes the first key
            # the most recent, so a prompt's head stays longer than its tail, as after a Get.
            keys = [key for batch in reversed(self._read) for key in batch]
            self._read.clear()
            self._unreported = 0
            self._reported_at = time.monotonic()
        for start in range(0, len(keys) if reader is not None else 0, REPORT_KEYS):  # every read, in calls
            self._send(keys[start : start + REPORT_KEYS], lambda name: self._answered(reader, name))

    def _answered(self, reader: DirectoryReader, name: str) -> None:
        if name != reader.name:  # the server publishes elsewhere now, or not at all
            self.memory.detach()
            self._ask_after = 0.0
