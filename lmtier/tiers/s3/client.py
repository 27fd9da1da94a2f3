"""The bucket, as the S3 tier talks to it: batches of GET, PUT, HEAD and DELETE requests and
paged listings, on awscrt's S3 client (``awscrt.s3``).

    Bucket(Settings(...))
      .get(names, sizes, limit) -> [Reply]   objects into pooled buffers (ranged GETs past part_size)
      .put(items) -> [Reply]              (name, frame parts, size): multipart past part_size
      .head(names) / .delete(names) -> [Reply]
      .list(prefix, token) -> (objects, next token)     one page of ListObjectsV2
      .requests -> {kind: count}          requests sent, for what a bill counts

Every request of a batch is in flight at once on the client's own event loop (a handful
of threads for all of them, connections pooled and reused); a batch waits for its replies
until its deadline and cancels what is left then. awscrt retries what S3 says to retry
(503 SlowDown, 500, dropped connections) within that deadline. Credentials come from the
AWS chain (environment, shared config and credentials files, web identity, container and
instance metadata) and are only ever handed to awscrt, which signs with them.
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from lmtier import metrics
from lmtier.buffers import BufferPool
from lmtier.errors import ConfigError, TierError

log = logging.getLogger(__name__)

try:
    from awscrt import auth as crt_auth
    from awscrt import http as crt_http
    from awscrt import io as crt_io
    from awscrt import s3 as crt_s3
except ImportError as exc:  # the s3 extra
    raise ModuleNotFoundError("awscrt is not installed", name="awscrt") from exc

MAX_LISTING_BYTES = 16 << 20  # one page of a listing (1,000 keys) is ~300 KiB
MAX_ERROR_BYTES = 64 << 10
SINGLE_PUT_LIMIT = 5 << 30  # S3's largest object in one PUT
TOO_LARGE = "too large"


@dataclass(frozen=True)
class Settings:
    bucket: str
    region: str
    endpoint: str = ""  # scheme://host[:port]; "" is AWS's own for the region
    addressing: str = ""  # "path" or "virtual"; "": virtual on AWS, path elsewhere
    part_size: int = 8 << 20
    timeout: float = 10.0
    connect_timeout: float = 2.0
    threads: int = 2
    throughput_gbps: float = 10.0
    name: str = "s3"

    def host_and_root(self) -> tuple[str, str, bool]:
        """The Host header, the path every object name follows, and whether TLS is on."""
        if self.endpoint:
            parts = urlsplit(self.endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
                raise ConfigError("the endpoint is scheme://host[:port], the scheme http or https")
            host, tls, aws = parts.netloc, parts.scheme == "https", False
        else:
            host, tls, aws = f"s3.{self.region}.amazonaws.com", True, True
        addressing = self.addressing or ("virtual" if aws else "path")
        if addressing not in ("path", "virtual"):
            raise ConfigError(f"addressing is path or virtual, got {self.addressing!r}")
        if addressing == "virtual":
            return f"{self.bucket}.{host}", "/", tls
        return host, f"/{quote(self.bucket, safe='')}/", tls


@dataclass
class Reply:
    """One request's outcome: ``status`` is the HTTP status (0: none came, the connection
    failed, the deadline passed or the request was cancelled), ``body`` what a GET read."""

    status: int = 0
    error: str = ""
    code: str = ""  # S3's error code, when the server said one (SlowDown, NoSuchBucket, ...)
    body: Any = None  # a pooled buffer (GET), bytes (listing), or None
    length: int = 0

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and not self.error

    @property
    def missing(self) -> bool:
        return self.status == 404

    @property
    def throttled(self) -> bool:
        return self.status == 503 or self.code == "SlowDown" or "SLOW_DOWN" in self.error


class _Parts:
    """A frame's parts as one readable stream, without joining them (awscrt reads it)."""

    def __init__(self, parts: Sequence[Any]) -> None:
        self.views = [memoryview(p).cast("B") for p in parts]
        self.total = sum(v.nbytes for v in self.views)
        self.seek(0)

    def readinto(self, m: memoryview) -> int:
        done = 0
        while done < len(m) and self.index < len(self.views):
            view = self.views[self.index]
            n = min(len(m) - done, view.nbytes - self.offset)
            m[done : done + n] = view[self.offset : self.offset + n]
            done += n
            self.offset += n
            if self.offset == view.nbytes:
                self.index, self.offset = self.index + 1, 0
        return done

    def read(self, n: int = -1) -> bytes:  # awscrt asks for read() to exist; it calls readinto
        out = bytearray(self.total if n < 0 else n)
        return bytes(out[: self.readinto(memoryview(out))])

    def seek(self, offset: int, whence: int = 0) -> int:
        if offset != 0 or whence != 0:  # awscrt rewinds a body to send it again
            raise OSError("a frame's parts are read from the start only")
        self.index, self.offset = 0, 0
        return 0


class Bucket:
    def __init__(self, settings: Settings, buffers: BufferPool) -> None:
        self.settings = settings
        self.host, self.root, tls = settings.host_and_root()
        self.buffers = buffers
        self._lock = threading.Lock()
        self.name = settings.name
        self.multipart = True  # PUTs past part_size in parts; off for a server whose multipart is not S3's
        self.page_keys = 1000  # objects per page of a listing (S3's most)
        self.requests = {"get": 0, "put": 0, "head": 0, "delete": 0, "list": 0}
        self._loop = crt_io.EventLoopGroup(settings.threads)
        bootstrap = crt_io.ClientBootstrap(self._loop, crt_io.DefaultHostResolver(self._loop))
        extra = {}
        if "connect_timeout_ms" in inspect.signature(crt_s3.S3Client).parameters:  # awscrt 0.38 and later
            extra["connect_timeout_ms"] = max(1, int(settings.connect_timeout * 1000))
        self._client = crt_s3.S3Client(
            bootstrap=bootstrap,
            region=settings.region,
            tls_mode=crt_s3.S3RequestTlsMode.ENABLED if tls else crt_s3.S3RequestTlsMode.DISABLED,
            credential_provider=crt_auth.AwsCredentialsProvider.new_default_chain(bootstrap),
            part_size=settings.part_size,
            multipart_upload_threshold=settings.part_size,
            throughput_target_gbps=settings.throughput_gbps,
            **extra,
        )

    def count(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.requests[kind] += n
        metrics.OBJECT_REQUESTS.labels(self.name, kind).inc(n)

    def object_path(self, name: str) -> str:
        return self.root + quote(name, safe="/-_.~")

    # -- batches ------------------------------------------------------------------------
    def get(self, names: Sequence[str], sizes: Sequence[int], limit: int, deadline: float = 0.0) -> list[Reply]:
        """Each object into a pooled buffer of at least its expected size (grown if the
        object is larger, up to ``limit`` bytes: a larger one is cut off, its reply says
        "too large"); a reply that is not ``ok`` has its buffer released already."""
        replies = [Reply() for _ in names]

        def send(i: int) -> Any:
            reply = replies[i]
            reply.body = self.buffers.acquire(max(1, min(sizes[i], limit)))
            started: list[Any] = []

            def on_body(chunk: bytes, offset: int, **_: Any) -> None:
                if reply.error:  # given up on (the deadline, too large): its buffer is no longer written
                    return
                end = offset + len(chunk)
                if end > limit:  # not a chunk this tier wrote, or a server gone wrong: stop reading it
                    reply.error = TOO_LARGE
                    if started:
                        started[0].cancel()
                    return
                if end > len(reply.body):  # larger than expected: a bigger buffer, the bytes so far kept
                    bigger = self.buffers.acquire(max(end, 2 * len(reply.body)))
                    bigger[: reply.length] = reply.body[: reply.length]
                    self.buffers.release(reply.body)
                    reply.body = bigger
                reply.body[offset:end] = chunk
                reply.length = max(reply.length, end)

            started.append(self._send("get", "GET", names[i], reply, on_body=on_body))
            return started[0]

        self._run(len(names), send, replies, deadline)
        part = self.settings.part_size
        self.count("get", sum(max(0, -(-r.length // part) - 1) for r in replies if r.ok))  # ranged GETs past the first
        for reply in replies:
            if not reply.ok and reply.body is not None:
                if reply.error != "timeout":  # a cancelled request's buffer is left to the collector
                    self.buffers.release(reply.body)
                reply.body = None
        return replies

    def put(self, items: Sequence[tuple[str, Sequence[Any], int]], deadline: float = 0.0) -> list[Reply]:
        replies = [Reply() for _ in items]

        def send(i: int) -> Any:
            name, parts, size = items[i]
            body = _Parts(parts)
            return self._send("put", "PUT", name, replies[i], body=body, length=size)

        self._run(len(items), send, replies, deadline)
        if self.multipart:  # a multipart upload: its parts, its start and its end
            part = self.settings.part_size
            self.count("put", sum(-(-size // part) + 1 for _, _, size in items if size > part))
        if self.multipart and any(r.error == "AWS_ERROR_S3_MISSING_UPLOAD_ID" for r in replies):
            # The server's answer to CreateMultipartUpload is not S3's (rclone 1.75 names its
            # root InitiateMultipartUpload): whole-object PUTs from now on, these sent again.
            log.warning("s3 tier %s: the server's multipart uploads are not S3's; sending whole objects", self.name)
            self.multipart = False
            again = [i for i, r in enumerate(replies) if r.error == "AWS_ERROR_S3_MISSING_UPLOAD_ID"]
            for i, reply in zip(again, self.put([items[i] for i in again], deadline), strict=True):
                replies[i] = reply
        return replies

    def head(self, names: Sequence[str], deadline: float = 0.0) -> list[Reply]:
        replies = [Reply() for _ in names]
        self._run(len(names), lambda i: self._send("head", "HEAD", names[i], replies[i]), replies, deadline)
        return replies

    def delete(self, names: Sequence[str], deadline: float = 0.0) -> list[Reply]:
        replies = [Reply() for _ in names]
        self._run(len(names), lambda i: self._send("delete", "DELETE", names[i], replies[i]), replies, deadline)
        return replies

    def list(self, prefix: str, token: str = "", after: str = "") -> tuple[list[tuple[str, int, float]], str]:
        """One page of the objects under ``prefix`` (from the first after ``after``, or from
        the page ``token`` names): (name, size, last modified as a Unix time), and the token
        of the next page ("" when this was the last). A bucket with nothing under the prefix
        yet is an empty page; a bucket that does not exist is an error."""
        query = f"?list-type=2&max-keys={self.page_keys}&prefix={quote(prefix, safe='')}"
        if token:
            query += f"&continuation-token={quote(token, safe='')}"
        elif after:
            query += f"&start-after={quote(after, safe='')}"
        reply = Reply(body=bytearray())

        def on_body(chunk: bytes, offset: int, **_: Any) -> None:
            if len(reply.body) + len(chunk) > MAX_LISTING_BYTES:
                reply.error = "listing page too large"
                return
            reply.body += chunk

        path = self.root.rstrip("/") or "/"
        self._run(1, lambda _: self._send("list", "GET", "", reply, on_body=on_body, path=path + query), [reply])
        if reply.missing and reply.code != "NoSuchBucket":  # SeaweedFS: nothing under the prefix yet
            return [], ""
        if not reply.ok:
            why = reply.code or reply.status or reply.error
            raise TierError(f"s3 tier {self.settings.name}: listing failed ({why})")
        return _parse_listing(bytes(reply.body))

    # -- one request --------------------------------------------------------------------
    def _send(
        self,
        kind: str,
        method: str,
        name: str,
        reply: Reply,
        *,
        body: _Parts | None = None,
        length: int = 0,
        on_body: Any = None,
        path: str = "",
    ) -> Any:
        headers = [("host", self.host)]
        if body is not None:
            headers.append(("content-length", str(length)))
        request = crt_http.HttpRequest(method, path or self.object_path(name), crt_http.HttpHeaders(headers), body)

        def on_done(error: Exception | None = None, status_code: int | None = None, error_body: Any = None, **_: Any):
            if reply.error in ("timeout", TOO_LARGE):  # cancelled by us: that is what it says
                return
            reply.status = status_code or 0
            if error is not None:
                reply.error = getattr(error, "name", "") or type(error).__name__
                if error_body:  # S3's error code (<Code>SlowDown</Code>), never the rest of the body
                    found = _CODE.search(bytes(error_body[:MAX_ERROR_BYTES]))
                    reply.code = found.group(1).decode("ascii", "replace") if found else ""

        def on_headers(status_code: int = 0, headers: Any = (), **_: Any) -> None:
            for k, v in headers:
                if k.lower() == "content-length" and v.isdigit():
                    reply.length = int(v)

        kinds = {"GET": crt_s3.S3RequestType.GET_OBJECT, "PUT": crt_s3.S3RequestType.PUT_OBJECT}
        request_type = kinds.get(method) if kind in ("get", "put") else crt_s3.S3RequestType.DEFAULT
        operation = {"head": "HeadObject", "delete": "DeleteObject", "list": "ListObjectsV2"}.get(kind)
        client = self._client
        if client is None:
            raise TierError(f"s3 tier {self.name} is closed")
        self.count(kind)
        return client.make_request(
            type=request_type,
            request=request,
            operation_name=operation,
            on_headers=on_headers if kind == "head" else None,
            on_body=on_body,
            on_done=on_done,
            multipart_upload_threshold=self.settings.part_size if self.multipart else SINGLE_PUT_LIMIT,
        )

    def _run(self, n: int, send: Any, replies: list[Reply], deadline: float = 0.0) -> None:
        """Send ``n`` requests, then wait for them until ``deadline`` (``time.monotonic()``;
        0: ``timeout`` from now); those still out then are cancelled, their replies say so,
        and none of their callbacks writes into what the caller keeps."""
        deadline = deadline or time.monotonic() + self.settings.timeout
        started: list[Any] = []
        for i in range(n):
            try:
                started.append(send(i))
            except TierError:
                replies[i].error = "closed"
                started.append(None)
            except Exception as exc:  # awscrt refused the request (bad input)
                replies[i].error = f"{type(exc).__name__}: {exc}"[:200]
                started.append(None)
        for i, request in enumerate(started):
            if request is None:
                continue
            try:
                request.finished_future.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:  # marked first: its callbacks then write nothing more
                replies[i].error = "timeout"
                replies[i].status = 0
                request.cancel()  # not waited for: what it read into is left to the collector
            except Exception:  # the reply says what failed (on_done)
                pass

    def close(self) -> None:
        self._client = None  # awscrt shuts its client down when the last reference goes


_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_CODE = re.compile(rb"<Code>([A-Za-z0-9.]{1,64})</Code>")


def _parse_listing(body: bytes) -> tuple[list[tuple[str, int, float]], str]:
    from datetime import datetime

    try:
        root = ET.fromstring(body)
    except ET.ParseError as exc:
        raise TierError(f"listing is not XML: {exc}") from exc
    ns = _NS if root.tag.startswith(_NS) else ""
    objects = []
    for item in root.iter(f"{ns}Contents"):
        name = item.findtext(f"{ns}Key") or ""
        try:
            size = int(item.findtext(f"{ns}Size") or 0)
            stamp = (item.findtext(f"{ns}LastModified") or "").replace("Z", "+00:00")
            modified = datetime.fromisoformat(stamp).timestamp() if stamp else 0.0
        except ValueError:
            continue
        objects.append((name, size, modified))
    truncated = (root.findtext(f"{ns}IsTruncated") or "").lower() == "true"
    token = root.findtext(f"{ns}NextContinuationToken") or ""
    return objects, token if truncated else ""
