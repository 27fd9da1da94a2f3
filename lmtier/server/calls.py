"""How every call of the cache service runs, whatever it does: its request parsed, its
tenant resolved, admitted, counted, and any failure turned into a status.

    Abort(code, message)                    raised inside a handler: end the call so
    Calls(auth, limit)                      the calls in flight, per tenant
        .unary(name, fn, request_type, admit=True) -> behaviour for gRPC's method handler
        .stream(name, fn, request_type) -> the same for a server-streaming method
        .in_flight(tag) -> int

A handler ``fn(request, context, tag)`` gets its request parsed (``request_type`` None:
raw bytes, for the bulk methods) and its caller's tenant tag. Parsing here, not in gRPC,
makes a malformed request ``INVALID_ARGUMENT`` (gRPC's own deserializer answers
``INTERNAL``). A tenant already at ``limit`` calls is refused with ``RESOURCE_EXHAUSTED``,
so that one client (however many connections it opens) cannot take every worker;
``admit=False`` lets a call through regardless (``Release``, which frees memory). An
``Abort`` ends the call with its status, a client that went away is ``CANCELLED``, anything
else is ``INTERNAL`` with a logged traceback: a bug, and the server never dies of one call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from lmtier import metrics
from lmtier.server.auth import Authenticator

log = logging.getLogger(__name__)


class Abort(Exception):
    """Raised inside a handler to end the call with a status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Calls:
    def __init__(self, auth: Authenticator, limit: int) -> None:
        self.auth = auth
        self.limit = limit
        self._calls: dict[bytes, int] = {}  # tenant tag -> calls in flight
        self._lock = threading.Lock()

    def unary(self, name: str, fn: Callable[..., Any], request_type: Any, admit: bool = True) -> Callable:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            with self._accounted(name, context, admit) as tag:
                return fn(_parsed(request_type, request), context, tag)

        return call

    def stream(self, name: str, fn: Callable[..., Iterator[Any]], request_type: Any) -> Callable:
        def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            with self._accounted(name, context, True) as tag:
                yield from fn(_parsed(request_type, request), context, tag)

        return call

    def in_flight(self, tag: bytes) -> int:
        with self._lock:
            return self._calls.get(tag, 0)

    @contextmanager
    def _accounted(self, name: str, context: grpc.ServicerContext, admit: bool) -> Iterator[bytes]:
        metrics.SERVER_INFLIGHT.inc()
        code = grpc.StatusCode.OK
        try:
            with self._admitted(context, admit) as tag:
                yield tag
        except Exception as exc:
            code, message = _failure(name, context, exc)
            if message is not None:
                context.abort(code, message)
            raise
        finally:
            metrics.SERVER_INFLIGHT.dec()
            metrics.SERVER_RPCS.labels(name, code.name).inc()

    @contextmanager
    def _admitted(self, context: grpc.ServicerContext, admit: bool) -> Iterator[bytes]:
        """The caller's tenant tag, for as long as the call runs."""
        tag = self.auth.tag(context)
        if not admit:
            yield tag
            return
        with self._lock:
            held = self._calls.get(tag, 0)
            if held >= self.limit:
                raise Abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this tenant has {held} calls in flight; the limit is {self.limit} (max_calls_per_tenant)",
                )
            self._calls[tag] = held + 1  # one entry per tenant with a call in flight: bounded
        try:
            yield tag
        finally:
            with self._lock:
                held = self._calls.pop(tag) - 1
                if held:
                    self._calls[tag] = held


def _parsed(request_type: Any, raw: Any) -> Any:
    """The request message from its bytes; malformed bytes are the caller's error."""
    if request_type is None:
        return raw
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {request_type.__name__}: {exc}") from exc


def _failure(name: str, context: grpc.ServicerContext, exc: BaseException) -> tuple[grpc.StatusCode, str | None]:
    """The status a failed call ends with, and the message to abort it with (None: the
    call was aborted already, by the authenticator)."""
    if isinstance(exc, Abort):
        return exc.code, str(exc)
    if isinstance(exc, grpc.RpcError):  # the client went away while we read its stream
        return grpc.StatusCode.CANCELLED, None
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode) and code != grpc.StatusCode.OK:
        return code, None
    log.exception("%s failed", name)  # not an abort: a bug
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
