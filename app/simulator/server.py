"""HTTP/1.1 front end of the guest-agent simulator, on a unix socket or loopback TCP.

Speaks what ``dstack_sdk`` 0.5.4 sends (``dstack.md`` §1.2, §9): ``POST /<Method>`` (also
``/prpc/<Method>`` and an ignored ``?json`` query, like the real agent) with a JSON body, and GET
with the arguments as query parameters. Every reply, errors included, has a JSON body because
the SDK calls ``.json()`` on it. A 0.6 agent also serves ``/v0/<Method>`` and ``/v1/<Method>`` and answers any
other path with a non-JSON 404 (how a client probes for v1). Request bodies and query strings are never logged: they carry
report data and event payloads.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import socket
import stat
import sys
import threading
from http.server import BaseHTTPRequestHandler
from socketserver import TCPServer, ThreadingMixIn, UnixStreamServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from app.simulator.agent import GuestAgentSimulator, SimulatorRpcError

logger = logging.getLogger(__name__)

MAX_BODY = 1 << 20  # 1 MiB; the real agent's largest request is far smaller
# sun_path is 108 bytes on Linux and 104 on the BSDs/macOS, including the terminating NUL.
MAX_SOCKET_PATH = (104 if sys.platform == "darwin" or "bsd" in sys.platform else 108) - 1
_METHOD_RE = re.compile(r"^/(?:prpc/)?([A-Za-z][A-Za-z0-9_]{0,63})$")
# dstack 0.6: /v0/<M> aliases the unversioned routes; /v1/<M> is the new guest API (dstack-0.6.md §1, §2.1).
_VERSIONED_RE = re.compile(r"^/(v0|v1)/([A-Za-z][A-Za-z0-9_]{0,63})$")
_POLL_INTERVAL = 0.05  # how fast shutdown() is noticed


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the SDK reuses one connection per client
    server_version = "cvm-tune-dstack-simulator"
    sys_version = ""
    timeout = 60  # idle keep-alive connections are closed after a minute

    server: _ServerMixin  # narrowed for type checkers

    def do_POST(self) -> None:  # noqa: N802 (http.server naming)
        length_header = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding"):
            return self._reply(411, {"error": "chunked bodies are not supported; send Content-Length"}, close=True)
        try:
            length = int(length_header or "0")
        except ValueError:
            return self._reply(400, {"error": "invalid Content-Length"}, close=True)
        if length < 0 or length > MAX_BODY:
            # Do not read the body: close instead, so an oversized upload cannot pin memory.
            return self._reply(413, {"error": f"request body over {MAX_BODY} bytes"}, close=True)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (ValueError, UnicodeDecodeError):
            return self._reply(400, {"error": "request body is not valid JSON"})
        self._call(body)

    def do_GET(self) -> None:  # noqa: N802
        query = parse_qs(urlsplit(self.path).query, keep_blank_values=True)
        self._call({k: v[-1] for k, v in query.items() if k != "json"})

    def _call(self, body: Any) -> None:
        path, agent = urlsplit(self.path).path, self.server.agent
        api = "v0"
        match = _METHOD_RE.match(path)
        versioned = _VERSIONED_RE.match(path) if agent.is_06 and match is None else None
        if versioned is not None:
            api, method = versioned.group(1), versioned.group(2)
        elif match is None:
            if agent.is_06:  # a 0.6 agent answers an unknown mount with a non-JSON 404 (how v1 is probed)
                return self._reply_raw(404, b"Not Found", "text/plain; charset=utf-8")
            return self._reply(404, {"error": "not found"})
        else:
            method = match.group(1)
        try:
            if method == "SimulatorCollateral" and api == "v0":
                # NON-dstack, simulator-only extension: the collateral and test root needed to
                # verify this simulator's quotes. The app asks for it only after Version's rev
                # says cvm-tune-simulator; a real guest agent answers 404 here.
                result = {"collateral": agent.collateral_json(), "root_ca_der": agent.test_root_ca_der.hex()}
            else:
                result = agent.rpc(method, body, api)
        except SimulatorRpcError as exc:
            return self._reply(exc.status, {"error": exc.message})
        except Exception:  # a simulator bug must still produce a JSON answer, not a dropped connection
            logger.exception("dstack simulator: internal error in %s", method)
            return self._reply(500, {"error": "internal simulator error"})
        self._reply(200, result)

    def _reply(self, status: int, payload: dict, *, close: bool = False) -> None:
        self._reply_raw(status, json.dumps(payload).encode(), "application/json", close=close)

    def _reply_raw(self, status: int, data: bytes, content_type: str, *, close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Protocol-level errors (bad request line, unsupported verb) as JSON, never HTML."""
        try:
            self._reply(code, {"error": message or self.responses.get(code, ("error",))[0]}, close=True)
        except OSError:
            self.close_connection = True

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        # Path only: the query string of a GET carries the request arguments.
        path = urlsplit(getattr(self, "path", "")).path  # unset when the request line was malformed
        logger.debug("dstack simulator: %s %s -> %s", self.command, path, code)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        # http.server formats malformed request lines into these messages: drop the arguments.
        logger.debug("dstack simulator: %s", format.split("%", 1)[0].strip() or "request error")

    def address_string(self) -> str:
        return self.client_address[0] if isinstance(self.client_address, tuple) else "unix"


class _TcpHandler(_Handler):
    # Headers and body go out in two writes; without TCP_NODELAY the client's delayed ACK adds
    # ~40 ms to every call. (Unix sockets have no Nagle, and the option does not exist there.)
    disable_nagle_algorithm = True


class _ServerMixin(ThreadingMixIn):
    """Thread per connection; remembers open connections so ``stop`` can cut keep-alives."""

    daemon_threads = True
    agent: GuestAgentSimulator

    def init_tracking(self, agent: GuestAgentSimulator) -> None:
        self.agent = agent
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)  # type: ignore[misc]

    def close_connections(self) -> None:
        with self._conns_lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the peer


class _UnixServer(_ServerMixin, UnixStreamServer):
    pass


class _TcpServer(_ServerMixin, TCPServer):
    # TCPServer, not HTTPServer: HTTPServer.server_bind calls getfqdn(), which can stall on DNS.
    allow_reuse_address = True


class _Tcp6Server(_TcpServer):
    address_family = socket.AF_INET6


class SimulatorServer:
    """Serve a :class:`GuestAgentSimulator` on a unix socket or a loopback TCP port.

    Use as a context manager (``with SimulatorServer(agent, socket_path=p) as srv:``), or call
    :meth:`start` / :meth:`stop`; :meth:`serve_forever` runs in the foreground for the CLI.
    """

    def __init__(
        self,
        agent: GuestAgentSimulator,
        *,
        socket_path: str | os.PathLike | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> None:
        """Validate the address; nothing is bound until :meth:`start` / :meth:`serve_forever`.

        Args:
            agent: the simulator to serve.
            socket_path: a unix socket path (the SDK treats any non-URL endpoint as one).
            host: loopback address for TCP; ``127.0.0.1`` or ``::1`` (never a routable address:
                the simulator hands out keys to anyone who can connect).
            port: TCP port; ``0`` picks a free one.

        Raises:
            ValueError: both or neither of socket_path / port, a non-loopback host, a port out of
                range, or a socket path longer than the OS allows.
        """
        if (socket_path is None) == (port is None):
            raise ValueError("give exactly one of socket_path or port")
        self.agent = agent
        self._socket_path = os.fspath(socket_path) if socket_path is not None else None
        self._host, self._port = host, port
        if self._socket_path is not None:
            if len(os.fsencode(self._socket_path)) > MAX_SOCKET_PATH:
                raise ValueError(
                    f"unix socket path is {len(os.fsencode(self._socket_path))} bytes; the OS limit is "
                    f"{MAX_SOCKET_PATH}: use a shorter path (e.g. under /tmp)"
                )
        else:
            try:
                loopback = ipaddress.ip_address(host).is_loopback
            except ValueError:
                loopback = False
            if not loopback:
                raise ValueError(f"refusing to bind the simulator to {host!r}: use 127.0.0.1 or ::1")
            if not 0 <= int(port) <= 65535:  # type: ignore[arg-type]
                raise ValueError(f"port {port} out of range")
        self._server: _UnixServer | _TcpServer | None = None
        self._thread: threading.Thread | None = None  # our daemon thread (start)
        self._loop: threading.Thread | None = None  # whichever thread runs serve_forever
        self._socket_id: tuple[int, int] | None = None

    @property
    def endpoint(self) -> str:
        """What ``DSTACK_SIMULATOR_ENDPOINT`` / ``DstackClient(endpoint)`` take.

        Raises:
            RuntimeError: a TCP server asked before it is bound (the port is not known yet).
        """
        if self._socket_path is not None:
            return self._socket_path
        if self._server is None:
            raise RuntimeError("the simulator server is not started")
        port = self._server.server_address[1]
        return f"http://[{self._host}]:{port}" if ":" in self._host else f"http://{self._host}:{port}"

    def _bind(self) -> _UnixServer | _TcpServer:
        if self._server is not None:
            raise RuntimeError("the simulator server is already running")
        server: _UnixServer | _TcpServer
        if self._socket_path is not None:
            _clear_stale_socket(self._socket_path)
            server = _UnixServer(self._socket_path, _Handler, bind_and_activate=True)
            os.chmod(self._socket_path, 0o600)  # keys are handed to whoever can connect
            st = os.stat(self._socket_path)
            self._socket_id = (st.st_dev, st.st_ino)
        else:
            cls = _Tcp6Server if ":" in self._host else _TcpServer
            server = cls((self._host, self._port), _TcpHandler, bind_and_activate=True)
        server.init_tracking(self.agent)
        self._server = server
        return server

    def start(self) -> SimulatorServer:
        """Bind and serve in a daemon thread; returns ``self``.

        Raises:
            ValueError: the socket path is occupied by something that is not a stale socket.
            OSError: binding failed (port in use, missing directory).
        """
        server = self._bind()
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": _POLL_INTERVAL},
            name="dstack-simulator", daemon=True,
        )
        self._loop = self._thread
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in the foreground until :meth:`stop` (from another thread) or Ctrl-C.

        After :meth:`start` this just waits for the background thread (the CLI prints the bound
        endpoint between the two calls).
        """
        background = self._thread
        if background is not None:
            try:
                while background.is_alive():
                    background.join(0.5)  # a timed join keeps Ctrl-C deliverable
            except KeyboardInterrupt:
                pass
            finally:
                self.stop()
            return
        server = self._bind()
        self._loop = threading.current_thread()
        try:
            server.serve_forever(poll_interval=_POLL_INTERVAL)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop serving, close open connections and remove the socket file (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        loop, self._loop = self._loop, None
        if loop is not None and loop is not threading.current_thread():
            server.shutdown()  # returns once serve_forever has left its loop
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        server.server_close()
        server.close_connections()
        if self._socket_path is not None and self._socket_id is not None:
            try:
                st = os.lstat(self._socket_path)
                if (st.st_dev, st.st_ino) == self._socket_id:  # never delete someone else's socket
                    os.unlink(self._socket_path)
            except FileNotFoundError:
                pass
            self._socket_id = None

    def __enter__(self) -> SimulatorServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _clear_stale_socket(path: str) -> None:
    """Remove a leftover socket nobody listens on; refuse anything else at ``path``.

    Raises:
        ValueError: ``path`` is a regular file, directory, symlink etc., or a live socket.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ValueError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # stale: left behind by a process that died without stop()
        return
    finally:
        probe.close()
    raise ValueError(f"{path} is a live socket: another guest agent or simulator is serving it")
