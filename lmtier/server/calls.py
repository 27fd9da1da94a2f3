"""How every call of the cache service runs, whatever it does: its request parsed, its
tenant resolved, admitted, counted, and any failure turned into a status.

    Abort(code, message)                    raised inside a handler: end the call so
    Calls(auth, limit, workers, watchdog)   the calls in flight, per tenant
        .unary(name, fn, request_type, admit=True) -> behaviour of a unary method
        .stream(name, fn, request_type) -> the same for a server-streaming method
        .uploads(name, fn) -> the same for a client-streaming method (Put)
        .bidi(name, fn) -> the same for one streaming both ways (gRPC reflection)
        .in_flight(tag) -> int
    Gate(methods, auth)                     methods behind a check of the call's credentials

Every behaviour is registered as request-streaming (``handlers``), whatever the method's
shape on the wire: gRPC then runs it as soon as the call's headers are in, not once its
request has arrived, so the call is counted against its tenant and watched while it
waits for its client (``Watchdog``: a client that stalls is cancelled after
``stall_timeout``), instead of holding a worker uncounted and unwatched.

A handler ``fn(request, context, tag)`` gets its request parsed (``request_type`` None:
raw bytes, for the bulk methods) and its caller's tenant tag. Parsing here, not in gRPC,
makes a malformed request ``INVALID_ARGUMENT`` (gRPC's own deserializer answers
``INTERNAL``). A tenant already at ``limit`` calls is refused with ``RESOURCE_EXHAUSTED``,
so that one client (however many connections it opens) cannot take every worker; and
while fewer than a quarter of the workers are free, a tenant holding its fair share
(the workers over the tenants with calls in flight) gets no more, so the others always
find one; a tenant past ``max_call_rate_per_tenant`` calls a second is refused too.
``admit=False`` (``Release``, which frees memory) gets ``RELEASE_EXTRA`` calls beyond
the limit, and no rate or fair-share check: it is counted, so silent releases cannot
hold the workers either. An
``Abort`` ends the call with its status, a client that went away is ``CANCELLED``, anything
else is ``INTERNAL`` with a logged traceback: a bug, and the server never dies of one call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from lmtier import metrics
from lmtier.server.auth import PEER_METHODS, Authenticator, is_peer_lane, peer_lane
from lmtier.server.watchdog import Watch, Watchdog

log = logging.getLogger(__name__)


class Abort(Exception):
    """Raised inside a handler to end the call with a status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


RELEASE_EXTRA = 2  # calls a tenant at its limit may still make to release what it holds


class Calls:
    def __init__(self, auth: Authenticator, limit: int, workers: int, watchdog: Watchdog, rate: float = 0.0) -> None:
        self.auth = auth
        self.limit = limit
        self.rate = rate  # calls a tenant may start per second (0: no limit), a second's worth at once
        self._buckets: dict[bytes, list[float]] = {}  # tenant tag -> [tokens, when last filled]
        self.workers = workers
        self.reserve = max(1, workers // 4)  # kept free for tenants under their fair share
        self.watchdog = watchdog
        self._calls: dict[bytes, int] = {}  # tenant tag -> calls in flight
        self._busy = 0
        self._lock = threading.Lock()

    def unary(self, name: str, fn: Callable[..., Any], request_type: Any, admit: bool = True) -> Callable:
        def call(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            with self._accounted(name, context, admit) as (tag, watch):
                return fn(_parsed(request_type, _first(requests, watch)), context, tag)

        return call

    def stream(self, name: str, fn: Callable[..., Iterator[Any]], request_type: Any) -> Callable:
        def call(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            with self._accounted(name, context, True) as (tag, watch):
                for answer in fn(_parsed(request_type, _first(requests, watch)), context, tag):
                    with watch.waiting():  # gRPC sends it while this generator waits here
                        yield answer

        return call

    def uploads(self, name: str, fn: Callable[..., Any]) -> Callable:
        def call(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            with self._accounted(name, context, True) as (tag, watch):
                return fn(_watched(requests, watch), context, tag)

        return call

    def bidi(self, name: str, fn: Callable[..., Iterator[Any]]) -> Callable:
        """The same for a method streaming both ways whose handler takes no tenant
        (``fn(requests, context)``: gRPC's reflection service)."""

        def call(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            with self._accounted(name, context, True) as (_, watch):
                for answer in fn(_watched(requests, watch), context):
                    with watch.waiting():
                        yield answer

        return call

    def in_flight(self, tag: bytes) -> int:
        with self._lock:
            return self._calls.get(tag, 0)

    @contextmanager
    def _accounted(self, name: str, context: grpc.ServicerContext, admit: bool) -> Iterator[tuple[bytes, Watch]]:
        metrics.SERVER_INFLIGHT.inc()
        code = grpc.StatusCode.OK
        try:
            with self.watchdog.watch(context) as watch, self._admitted(context, admit) as tag:
                yield tag, watch
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
        lane = peer_lane(tag) if self.auth.reads_only(context.invocation_metadata()) else tag
        with self.admitted(lane, admit):
            yield tag

    @contextmanager
    def admitted(self, tag: bytes, admit: bool = True) -> Iterator[None]:
        """A call of tenant ``tag`` counted for as long as it runs, or ``Abort``
        (RESOURCE_EXHAUSTED) where the tenant is at its limit, its rate or its share (the
        data channel's loads are admitted here too: ``lmtier.server.data``)."""
        # a tenant's peers, together, at most half the workers: the instance beside its
        # sidecar always finds some (``peer_lane``)
        limit = min(self.limit, max(1, self.workers // 2)) if is_peer_lane(tag) else self.limit
        with self._lock:
            held = self._calls.get(tag, 0)
            if not admit and held >= limit + RELEASE_EXTRA:
                raise Abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this tenant has {held} calls in flight, releases included; the limit is {limit} "
                    f"(max_calls_per_tenant) and {RELEASE_EXTRA} more for releases",
                )
            if admit and self.rate and not self._take(tag):
                raise Abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this tenant is over its call rate of {self.rate:g} a second (max_call_rate_per_tenant)",
                )
            if admit and held >= limit:
                raise Abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this tenant has {held} calls in flight; the limit is {limit} (max_calls_per_tenant)",
                )
            tenants = len(self._calls) + (tag not in self._calls)
            fair = max(1, self.workers // tenants)
            if admit and held >= fair and self._busy >= self.workers - self.reserve:
                raise Abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the server is busy and this tenant has its share of it ({held} calls of {self.workers} workers)",
                )
            self._calls[tag] = held + 1  # one entry per tenant with a call in flight: bounded
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                held = self._calls.pop(tag) - 1
                if held:
                    self._calls[tag] = held
                self._busy -= 1

    def _take(self, tag: bytes) -> bool:
        """One call from the tenant's bucket (with the lock held)."""
        now = time.monotonic()
        bucket = self._buckets.get(tag)
        if bucket is None:
            if len(self._buckets) >= 10_000:  # bounded: tenants come from config or certificates
                self._buckets.clear()
            bucket = self._buckets[tag] = [self.rate, now]
        bucket[0] = min(self.rate, bucket[0] + (now - bucket[1]) * self.rate)
        bucket[1] = now
        if bucket[0] < 1:
            return False
        bucket[0] -= 1
        return True


def _first(requests: Iterator[Any], watch: Watch) -> Any:
    """A unary method's one request, waited for under the watchdog."""
    with watch.waiting():
        request = next(requests, None)
    if request is None:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its request")
    return request


def _watched(requests: Iterator[Any], watch: Watch) -> Iterator[Any]:
    """A client stream's messages, each waited for under the watchdog."""
    while True:
        with watch.waiting():
            message = next(requests, None)
        if message is None:
            return
        yield message


def refusal(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A method handler that ends the call at once with ``code`` (request-streaming, so
    gRPC runs it without waiting for a request: nothing is read, no worker waits)."""

    def refuse(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        context.abort(code, message)
        yield from ()

    return grpc.stream_stream_rpc_method_handler(refuse)


class Gate(grpc.GenericRpcHandler):
    """The service's methods behind a check of the call's credentials as its headers
    arrive: a call without a known token is refused there (``UNAUTHENTICATED``), before
    gRPC gives it a worker or reads its request, however large."""

    def __init__(self, methods: grpc.GenericRpcHandler, auth: Authenticator) -> None:
        self.methods = methods
        self.auth = auth

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self.methods.service(handler_call_details)
        if handler is None:
            return None
        metadata = handler_call_details.invocation_metadata
        reason = self.auth.refuse(metadata)
        if reason is None:
            method = handler_call_details.method.rsplit("/", 1)[-1]
            if method not in PEER_METHODS and self.auth.reads_only(metadata):
                metrics.SERVER_REFUSED.inc()
                return refusal(grpc.StatusCode.PERMISSION_DENIED, f"a peer's token reads chunks only; {method} refused")
            return handler
        metrics.SERVER_REFUSED.inc()
        return refusal(grpc.StatusCode.UNAUTHENTICATED, reason)


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
