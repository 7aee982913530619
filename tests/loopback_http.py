"""A loopback HTTP(S) server for the tests of cvm-tune's HTTP callers: every request is answered by a route the test
gives, and recorded as (method, path, headers). It binds 127.0.0.1 only; the ``serve`` fixture (tests/conftest.py)
starts them and stops them after the test."""

from __future__ import annotations

import contextlib
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Route = Callable[[BaseHTTPRequestHandler, threading.Event], None]


class Server:
    """A loopback HTTP(S) server answering every request with ``route``; records (method, path, headers)."""

    def __init__(self, route: Route, tls: ssl.SSLContext | None = None) -> None:
        self.route, self.seen, self.stop = route, [], threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                server.seen.append((self.command, self.path, dict(self.headers)))
                with contextlib.suppress(OSError):
                    server.route(self, server.stop)

            do_GET = do_POST = _any  # noqa: N815

            def log_message(self, *_a: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda *_a: None  # type: ignore[method-assign]  # a refused handshake is expected
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def send(h: BaseHTTPRequestHandler, status: int, body: bytes = b"", **headers: str) -> None:
    h.send_response(status)
    for k, v in {"Content-Length": str(len(body)), **headers}.items():
        h.send_header(k.replace("_", "-"), v)
    h.end_headers()
    h.wfile.write(body)
