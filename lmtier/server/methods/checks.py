"""The input checks every method of ``CacheService`` shares: what keeps one tenant's
request from reaching another's chunks or the server's own memory.

    KEY_LENGTHS                  the lengths a chunk key may have
    check_key(key, what)         a key of one of them, or ``INVALID_ARGUMENT``
    RequestChecks                the checks, as methods of the service (its methods' base)
        ._scoped(tag, keys) -> the request's keys under the caller's tenant
        ._segment_io(io, segment) -> ``io`` on a client's segment, failures as statuses
        ._not_own(segment)       a client's segment is never the server's own slab

A tenant's keys are stored under its tag (``auth``), so a request's keys are checked
and scoped before anything looks them up; a request that names client memory names it
by a segment every process on the host can see, so the server reads and writes it only
where it maps client segments at all, and never its own.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from lmtier.errors import LmtierError
from lmtier.server.calls import Abort
from lmtier.transport.shm.access import SegmentFiles, SegmentUnavailable

KEY_LENGTHS = (16, 32)  # xxh3-128 and sha256 chunk keys


def check_key(key: bytes, what: str) -> None:
    if len(key) not in KEY_LENGTHS:
        raise Abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what} is {len(key)} bytes; chunk keys are {' or '.join(map(str, KEY_LENGTHS))} bytes",
        )


class RequestChecks:
    """The base of the service's methods (``reads``, ``saves``, ``control``), built by
    ``CacheService``; uses its ``config`` (``max_keys``),
    ``maps`` (the client segments it maps, None where it maps none), ``shared`` (the
    memory tier, where it lends it) and ``_no_shm`` (why it maps none)."""

    def _scoped(self, tag: bytes, keys) -> list[bytes]:
        if len(keys) > self.config.max_keys:
            raise Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(keys)} keys in one request; the limit is {self.config.max_keys}",
            )
        out = []
        for i, key in enumerate(keys):
            check_key(key, f"key {i}")
            out.append(tag + key)
        return out

    def _segment_io(self, io: Callable[[SegmentFiles], object], segment: str):
        """``io(files)`` on a client's segment; a segment this server cannot or will not
        use, or a region outside it, is the caller's error, with a status."""
        if self.maps is None:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, self._no_shm)
        self._not_own(segment)
        try:
            return io(self.maps)
        except SegmentUnavailable as exc:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
        except LmtierError as exc:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc

    def _not_own(self, segment: str) -> None:
        """A client's segment is never the server's own slab (a lease owned by it would
        never expire, and the server would write into its own memory)."""
        if self.shared is not None and segment == self.shared.shared_name:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "a request names the server's own segment as the client's")
