"""The standard gRPC health service (``grpc.health.v1.Health``), answered by lmtier itself.

    Health()                         statuses by service name; "" is the whole server
      .set(service, status)          SERVING / NOT_SERVING, wakes watchers
      .handler() -> GenericRpcHandler   Check and Watch, for grpc.server
    check(channel, timeout) -> int | None    a client's Check; None when nothing answers

Kubernetes ``grpc`` probes, Envoy and ``grpc-health-probe`` speak this protocol. Its
messages are one field each (``HealthCheckRequest.service``, ``HealthCheckResponse.status``),
so they are encoded here by hand rather than taken from grpcio-health-checking: that
package pins a grpcio and a protobuf as new as itself, and pip would move an engine's own
grpcio and protobuf to install it beside lmtier. Checked against grpcio-health-checking's
own client in tests/test_grpc_tier_faults.py.

Check answers at once, without a token (probes carry none) and for any caller: it says
only whether the server is ready. Watch holds a worker thread for as long as the watcher
stays, so at most ``max_watchers`` watch at once; more are refused (RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc

from lmtier.errors import FormatError
from lmtier.transport.pieces import read_varint, varint

SERVICE_NAME = "grpc.health.v1.Health"
UNKNOWN, SERVING, NOT_SERVING, SERVICE_UNKNOWN = 0, 1, 2, 3
MAX_NAME = 1024  # longest service name a request may ask about
MALFORMED = object()  # what a request that is no HealthCheckRequest deserializes to
WATCH_POLL_S = 1.0  # how often a watcher notices that its caller went away


def encode_request(service: str) -> bytes:
    """``HealthCheckRequest(service=service)`` on the wire."""
    name = service.encode()
    return b"\x0a" + varint(len(name)) + name if name else b""


def parse_request(data: bytes) -> str:
    """``HealthCheckRequest.service`` from its wire bytes (unknown fields skipped, as
    protobuf does)."""
    service, at = "", 0
    while at < len(data):
        tag, at = read_varint(data, at)
        field, kind = tag >> 3, tag & 7
        if kind == 0:
            _, at = read_varint(data, at)
        elif kind == 1 or kind == 5:
            at += 8 if kind == 1 else 4
        elif kind == 2:
            length, at = read_varint(data, at)
            if field == 1:
                if length > MAX_NAME:
                    raise FormatError(f"service name longer than {MAX_NAME} bytes")
                service = data[at : at + length].decode("utf-8", errors="strict")
            at += length
        else:
            raise FormatError(f"wire type {kind} is not used by this message")
        if at > len(data):
            raise FormatError("a field runs past the end of the message")
    return service


def encode_response(status: int) -> bytes:
    """``HealthCheckResponse(status=status)`` on the wire (a zero status is no field)."""
    return b"\x08" + varint(status) if status else b""


def parse_response(data: bytes) -> int:
    """``HealthCheckResponse.status`` from its wire bytes."""
    status, at = UNKNOWN, 0
    while at < len(data):
        tag, at = read_varint(data, at)
        if tag & 7 != 0:
            raise FormatError("not a HealthCheckResponse")
        value, at = read_varint(data, at)
        if tag >> 3 == 1:
            status = value
    return status


class Health:
    """Check and Watch, answered without credentials (probes have none). Both are
    registered request-streaming, like the cache service's methods: the wait for a
    request is watched (``watchdog``: cancelled after its stall timeout) and at most
    ``max_waiting`` calls wait for theirs at once (more: RESOURCE_EXHAUSTED), so calls
    that send their headers and nothing more cannot hold the server's workers."""

    def __init__(self, max_watchers: int = 4, max_waiting: int = 4, watchdog: Any = None) -> None:
        self._statuses: dict[str, int] = {}
        self._changed = threading.Condition()
        self._watchers = threading.BoundedSemaphore(max_watchers)
        self._waiting = threading.BoundedSemaphore(max_waiting)
        self._watchdog = watchdog

    def set(self, service: str, status: int) -> None:
        with self._changed:
            self._statuses[service] = status
            self._changed.notify_all()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Check": grpc.stream_unary_rpc_method_handler(self._check, response_serializer=encode_response),
                "Watch": grpc.stream_stream_rpc_method_handler(self._watch, response_serializer=encode_response),
            },
        )

    def _read(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> str:
        """The call's one request, waited for under the watchdog, in one of the few slots."""
        if not self._waiting.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many health calls waiting for their request")
        try:
            if self._watchdog is not None:
                with self._watchdog.watch(context) as watch, watch.waiting():
                    raw = next(requests, None)
            else:
                raw = next(requests, None)
        finally:
            self._waiting.release()
        service = MALFORMED if raw is None else _request(raw)
        if service is MALFORMED:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not a grpc.health.v1.HealthCheckRequest")
        return service  # type: ignore[return-value]

    def _check(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> int:
        service = self._read(requests, context)
        with self._changed:
            status = self._statuses.get(service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {service!r}")
        return status

    def _watch(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[int]:
        service = self._read(requests, context)
        if not self._watchers.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many health watchers; use Check")
        try:
            last = None
            while context.is_active():
                with self._changed:
                    status = self._statuses.get(service, SERVICE_UNKNOWN)
                    if status == last:
                        self._changed.wait(WATCH_POLL_S)
                        continue
                last = status
                yield status
        finally:
            self._watchers.release()


def _request(data: bytes) -> str | object:
    """The service asked about, or ``MALFORMED`` (gRPC takes a None from a deserializer
    for its own failure: INTERNAL, where bad input deserves INVALID_ARGUMENT)."""
    try:
        return parse_request(data)
    except (FormatError, UnicodeDecodeError):
        return MALFORMED


def check(channel: grpc.Channel, timeout: float = 1.0, service: str = "") -> int | None:
    """The server's status for ``service`` through a Check call; None when it does not
    answer (down, not a gRPC server, the service unknown)."""
    call = channel.unary_unary(
        f"/{SERVICE_NAME}/Check",
        request_serializer=encode_request,
        response_deserializer=parse_response,
    )
    try:
        return call(service, timeout=timeout)
    except grpc.RpcError:
        return None
