"""A reference prefill/decode proxy: what the routers do (vLLM's disaggregated proxies,
llm-d's sidecar, Dynamo's frontend), small enough to read, for the demo and the tests.

    python -m lmtier.demo.pd_proxy --prefill http://P:8100 --decode http://D:8200 --port 8000 \\
        [--forward-params]

For every ``POST /v1/completions`` or ``/v1/chat/completions``:

1. The prefill instance gets a copy of the request with ``max_tokens=1`` (and
   ``max_completion_tokens=1``), ``stream: false``, ``min_tokens`` and
   ``stream_options`` removed; with ``--forward-params`` also vLLM's NIXL-style
   ``kv_transfer_params`` (``do_remote_decode: true``, the rest null), as vLLM's toy proxy,
   Dynamo and llm-d's NIXL modes send. The proxy reads its answer to the end.
2. The decode instance gets the original request, with (``--forward-params``) the
   prefill's ``kv_transfer_params`` put in verbatim, or (without: llm-d's shared-storage
   mode, vLLM's ``disagg_proxy_demo``) nothing added: it finds the KV by its prompt. Its
   answer, streamed or not, is the client's.

A prefill that fails is logged and the decode instance still answers (it computes the
prompt itself). Other paths (``/v1/models``, ``/health``, ``/metrics``) go to the decode
instance. Standard library only; one thread per client connection.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("lmtier.pd_proxy")
GENERATE = ("/v1/completions", "/v1/chat/completions")
NIXL_REQUEST = {  # what a router that forwards parameters asks the prefill instance for
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
MAX_BODY = 64 << 20
CLIENT_TIMEOUT_S = 60
TIMEOUT_S = 600


def prefill_body(body: dict[str, Any], forward: bool) -> dict[str, Any]:
    """The prefill instance's copy of a request."""
    first = dict(body)
    first["max_tokens"] = 1
    if "max_completion_tokens" in first or "messages" in first:
        first["max_completion_tokens"] = 1
    first["stream"] = False
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        first.pop(key, None)
    if forward:
        own = body.get("kv_transfer_params")
        first["kv_transfer_params"] = {**NIXL_REQUEST, **(own if isinstance(own, dict) else {})}
    return first


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode instance's request: the client's, with the prefill's parameters (the
    client's own lmtier switches, such as ``"load": false``, kept beside the hand-off)."""
    if not params:
        return body
    own = body.get("kv_transfer_params")
    own = own if isinstance(own, dict) else {}
    merged = {**own, **params}
    switches = own.get("lmtier")
    if isinstance(switches, dict) and isinstance(params.get("lmtier"), dict):
        merged["lmtier"] = {**params["lmtier"], **{k: v for k, v in switches.items() if k in ("load", "save")}}
    return {**body, "kv_transfer_params": merged}


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away is the client's business (no traceback on stderr);
        anything else is logged with its traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            log.debug("client %s went away: %s", client_address, error)
        else:
            log.warning("a request from %s failed", client_address, exc_info=True)


class PDProxy:
    """The proxy on ``host:port`` (0: a free port) in a background thread."""

    def __init__(self, prefill: str, decode: str, *, forward: bool, host: str = "127.0.0.1", port: int = 0):
        self.prefill, self.decode, self.forward = prefill.rstrip("/"), decode.rstrip("/"), forward
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = CLIENT_TIMEOUT_S  # a client that stops sending loses its connection

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug(fmt, *args)

            def do_GET(self) -> None:
                proxy._relay(self, proxy.decode + self.path, None)

            def do_POST(self) -> None:
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if length < 0:
                    self.send_error(400, "a Content-Length of 0 or more is required")
                    return
                if length > MAX_BODY:
                    self.send_error(413, "request body too large")
                    return
                raw = self.rfile.read(length)
                if self.path not in GENERATE:
                    proxy._relay(self, proxy.decode + self.path, raw)
                    return
                try:
                    body = json.loads(raw)
                    if not isinstance(body, dict):
                        raise ValueError("not a JSON object")
                except ValueError as exc:
                    self.send_error(400, f"the request body is not a JSON object: {exc}")
                    return
                params = proxy._prefill(self.path, body, self.headers.get("X-Request-Id") or str(uuid.uuid4()))
                proxy._relay(self, proxy.decode + self.path, json.dumps(decode_body(body, params)).encode())

        self.server = _Server((host, port), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self.prefills = 0  # answered by the prefill instance
        self.failed_prefills = 0
        self._thread = threading.Thread(target=self.server.serve_forever, name="pd-proxy", daemon=True)
        self._thread.start()

    def _prefill(self, path: str, body: dict[str, Any], request_id: str) -> dict[str, Any] | None:
        """Ask the prefill instance; its ``kv_transfer_params`` when parameters are forwarded."""
        data = json.dumps(prefill_body(body, self.forward)).encode()
        request = urllib.request.Request(
            self.prefill + path, data=data, headers={"Content-Type": "application/json", "X-Request-Id": request_id}
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
                reply = json.loads(answer.read())
        except (OSError, ValueError) as exc:
            self.failed_prefills += 1
            log.warning("prefill instance failed (%s): the decode instance computes the prompt", exc)
            return None
        self.prefills += 1
        params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
        return params if self.forward and isinstance(params, dict) else None

    def _relay(self, handler: BaseHTTPRequestHandler, url: str, data: bytes | None) -> None:
        """Send the request to ``url`` and copy its answer (status, type, body: streamed
        as it comes) back to the client."""
        headers = {"Content-Type": handler.headers.get("Content-Type") or "application/json"}
        request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data is not None else "GET")
        try:
            answer = urllib.request.urlopen(request, timeout=TIMEOUT_S)
        except urllib.error.HTTPError as exc:
            answer = exc
        except OSError as exc:
            handler.send_error(502, f"decode instance unreachable: {exc}")
            return
        with answer:
            handler.send_response(answer.status)
            handler.send_header("Content-Type", answer.headers.get("Content-Type") or "application/json")
            handler.send_header("Transfer-Encoding", "chunked")
            handler.end_headers()
            while piece := answer.read1(65536) if hasattr(answer, "read1") else answer.read(65536):
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                handler.wfile.flush()
            handler.wfile.write(b"0\r\n\r\n")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> PDProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="the prefill instance's base URL")
    parser.add_argument("--decode", required=True, help="the decode instance's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--forward-params", action="store_true", help="forward the prefill's kv_transfer_params to the decode instance"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s [%(name)s] %(message)s")
    proxy = PDProxy(args.prefill, args.decode, forward=args.forward_params, host=args.host, port=args.port)
    log.info("prefill/decode proxy on %s: prefill %s, decode %s", proxy.url, proxy.prefill, proxy.decode)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        proxy.close()


if __name__ == "__main__":
    main()
