"""A small read-only HTTP server for operators: `/metrics` on every role, job pages on trainers.

Routes are exact paths or `prefix/` paths mapped to handlers that return `Reply`s; only GET and
HEAD are served (405 otherwise), an unknown path is 404, a malformed query is 400 (`BadQuery`).
Requests are served by a small pool of threads (`WORKERS`; a burst queues instead of spawning a
thread per request that would fight the role for the GIL), one request per connection, with a
socket timeout so a slow client can't hold a thread. Handlers read state through the role's own
accessors and never hold a lock the role's main loop waits on. Bound to loopback unless configured.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, TypeAlias, cast
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)
MAX_QUERY = 1024   # characters; longer queries are malformed here
WORKERS = 4        # threads serving requests
SOCKET_TIMEOUT_S = 10.0


@dataclass
class Reply:
    """What a route answers."""

    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


class BadQuery(ValueError):
    """A query string a route can't use (answered 400)."""


Query = dict[str, str]
Handler = Callable[[str, str], Reply]   # (path, raw query string) -> reply
Request: TypeAlias = socket.socket | tuple[bytes, socket.socket]   # socketserver's request type


def not_found(what: str = "not found") -> Reply:
    """A 404 reply whose body is `what` and a newline."""
    return Reply(404, f"{what}\n".encode())


def parse_query(raw: str, allowed: set[str]) -> Query:
    """`a=1&b=2` -> {"a": "1", "b": "2"}; unknown keys, repeated keys or garbage raise BadQuery."""
    if len(raw) > MAX_QUERY:
        raise BadQuery("query too long")
    try:
        parsed = parse_qs(raw, keep_blank_values=True, strict_parsing=bool(raw), max_num_fields=16)
    except ValueError as exc:
        raise BadQuery(f"malformed query: {exc}") from exc
    unknown = set(parsed) - allowed
    if unknown:
        raise BadQuery(f"unknown query parameter(s): {', '.join(sorted(unknown))}")
    if any(len(v) > 1 for v in parsed.values()):
        raise BadQuery("repeated query parameter")
    return {k: v[0] for k, v in parsed.items()}


def int_param(query: Query, name: str, default: int, lo: int, hi: int) -> int:
    """An integer query parameter in [lo, hi] (BadQuery otherwise)."""
    raw = query.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not lo <= int(raw) <= hi:
        raise BadQuery(f"{name} must be an integer in [{lo}, {hi}]")
    return int(raw)


class Routes:
    """Exact paths and `prefix/` paths to handlers (longest prefix wins)."""

    def __init__(self) -> None:
        self.exact: dict[str, Handler] = {}
        self.prefixes: dict[str, Handler] = {}

    def add(self, path: str, handler: Handler) -> None:
        """Route `path` to `handler`: exactly, or every path under it if it ends in `/`."""
        (self.prefixes if path.endswith("/") and path != "/" else self.exact)[path] = handler

    def handle(self, target: str) -> Reply:
        """The reply to request target `target` (path and query): 404 if unrouted, 400 on BadQuery."""
        parts = urlsplit(target)
        handler = self.exact.get(parts.path)
        if handler is None:
            for prefix in sorted(self.prefixes, key=len, reverse=True):
                if parts.path.startswith(prefix):
                    handler = self.prefixes[prefix]
                    break
        if handler is None:
            return not_found()
        try:
            return handler(parts.path, parts.query)
        except BadQuery as exc:
            return Reply(400, f"{exc}\n".encode())


class _Handler(BaseHTTPRequestHandler):
    server: OpsServer
    protocol_version = "HTTP/1.0"   # one request per connection: an idle keep-alive can't pin a worker
    timeout = SOCKET_TIMEOUT_S

    def do_GET(self) -> None:
        self._answer(head=False)

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def _refuse(self) -> None:
        self._send(Reply(405, b"read-only: GET and HEAD only\n", headers={"Allow": "GET, HEAD"}), head=False)

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

    def _answer(self, head: bool) -> None:
        try:
            reply = self.server.routes.handle(self.path)
        except Exception:
            log.exception("ops page %s failed", self.path)
            reply = Reply(500, b"internal error\n")
        self._send(reply, head)

    def _send(self, reply: Reply, head: bool) -> None:
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        for k, v in reply.headers.items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(reply.body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("ops http %s: " + format, self.client_address[0], *args)


class OpsServer(HTTPServer):
    """The HTTP server of one role (start with `start_ops_server`)."""

    request_queue_size = 256

    def __init__(self, host: str, port: int, routes: Routes) -> None:
        super().__init__((host, port), _Handler)
        self.routes = routes
        self.pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="ops-http")
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.5},
                                       name="ops-http", daemon=True)

    def process_request(self, request: Request, client_address: Any) -> None:
        """Hand the connection to the thread pool (instead of serving it on the accept thread)."""
        self.pool.submit(self._serve_one, request, client_address)

    def _serve_one(self, request: Request, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - a broken connection: log it, keep serving
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)

    @property
    def port(self) -> int:
        """The bound TCP port (the real one when configured as 0)."""
        return int(self.server_address[1])

    def url(self, path: str = "/") -> str:
        """The http:// URL of `path` on this server (127.0.0.1 when bound to all interfaces)."""
        host = cast(str, self.server_address[0])  # typeshed allows bytes; an AF_INET server has str
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.port}{path}"

    def close(self) -> None:
        """Stop serving, drop queued requests and close the listening socket."""
        self.shutdown()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.server_close()


def start_ops_server(host: str, port: int, routes: Routes) -> OpsServer:
    """Serve `routes` on host:port (0: any free port) in a daemon thread."""
    server = OpsServer(host, port, routes)
    server.thread.start()
    return server
