"""The one HTTP edge: every request cvm-tune sends (PCCS collateral, the dataset URL, alert webhooks, the bundle
client) goes through an :class:`Edge` and, when it may be repeated, through :func:`retry`.

An :class:`Edge` is one ``requests`` session with the project's rules built in, not offered as options:

* nothing from the environment: no proxy (``HTTP(S)_PROXY``, ``ALL_PROXY``), no ``.netrc`` credentials, no CA bundle
  override (``trust_env`` off); TLS is always verified (certifi's CA bundle, requests' default);
* one host per URL: every URL (the first and each redirect target) passes the caller's ``check``, which parses it
  with ``urllib.parse`` (:func:`check_url`); the request is rebuilt from the parsed parts and a connection to any
  other host or port is refused before it is opened;
* no redirect is followed unless the caller allows some (``redirects=N``); then each target passes ``check`` again,
  and an ``Authorization`` header is dropped when the origin changes;
* bodies are read raw and bounded (``Accept-Encoding: identity``; an encoded body is refused; :meth:`Answer.read_all`
  stops one byte past its limit);
* one overall deadline: a :class:`Watchdog` shuts every socket of the edge down when it passes, so a server that
  drips its headers or body a byte at a time (restarting each per-read timeout) is cut off all the same.

:func:`retry` is the one retry policy: at most ``attempts`` calls; waits ``backoff_s * 2**(n-1)`` capped at ``cap_s``;
a server's ``Retry-After`` is honoured up to that cap; only :class:`Transient` failures are retried (connection
errors, timeouts, a body cut short, HTTP 429 and 5xx); a wait that would pass the deadline is not started.

Failures are :class:`EdgeError` subclasses (never ``OSError``, so a caller can tell them from its own disk errors);
each caller turns them into its own error. ``requests`` is imported only when an edge is opened: importing this
module (``app.config`` does, for :func:`check_url`) loads no HTTP stack.
"""

from __future__ import annotations

import contextlib
import email.utils
import http.client
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
MAX_URL_CHARS = 2048
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_BLOCK = 1 << 16
T = TypeVar("T")
Check = Callable[[str], urllib.parse.SplitResult]


class EdgeError(Exception):
    """A request failed and repeating it would not help (or may not: TLS, a refused answer)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Transient(EdgeError):
    """Worth another attempt: a connection error or timeout (``kind`` names it), or HTTP 429/5xx (``status``)."""

    def __init__(self, reason: str, *, kind: str = "", status: int | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.kind, self.status, self.retry_after = kind, status, retry_after


class DeadlineExceeded(EdgeError):
    """The overall deadline passed (``last``: the failure before it, if any)."""

    def __init__(self, last: EdgeError | None = None) -> None:
        super().__init__("deadline passed" + (f" (last: {last.reason})" if last else ""))
        self.last = last


class GaveUp(EdgeError):
    """Every attempt failed with a :class:`Transient` error; ``last`` is the final one."""

    def __init__(self, attempts: int, last: Transient) -> None:
        super().__init__(f"{last.reason} (after {attempts} attempt(s))")
        self.attempts, self.last = attempts, last


class Redirected(EdgeError):
    """A redirect the caller did not allow (or one more than it allowed, or one without a ``Location``)."""

    def __init__(self, status: int, location: str | None, followed: int) -> None:
        why = f"more than {followed} redirects" if followed else f"HTTP {status} redirect"
        super().__init__(why if location is not None else f"HTTP {status} without a Location header")
        self.status, self.location, self.followed = status, location, followed


class TooLarge(EdgeError):
    """A body longer than the caller's limit."""


def check_url(url: str, what: str, *, plain_http_anywhere: bool = False) -> urllib.parse.SplitResult:
    """Parse a URL cvm-tune will fetch (with ``urllib.parse``; the edge then contacts exactly the host it parsed) and
    check it: ``https://``, or ``http://`` only on loopback (anywhere with ``plain_http_anywhere``, for public signed
    data such as collateral); printable ASCII without spaces or backslashes; no user name or password
    (``http://127.0.0.1:80@example.com/`` contacts example.com).

    Raises:
        ValueError: anything else (the message names ``what``).
    """
    if not isinstance(url, str) or not url.isascii() or not url.isprintable() or " " in url or "\\" in url \
            or len(url) > MAX_URL_CHARS:
        raise ValueError(f"{what} must be one URL of printable ASCII (at most {MAX_URL_CHARS} characters, no spaces "
                         "or backslashes)")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("https", "http"):
        raise ValueError(f"{what} must start with https:// (or http:// on loopback)")
    if "@" in parts.netloc:
        raise ValueError(f"{what} must not carry a user name or password (user@host)")
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:
        raise ValueError(f"{what} has an invalid port") from None
    if not parts.hostname:
        raise ValueError(f"{what} names no host")
    if parts.scheme == "http" and not plain_http_anywhere and parts.hostname not in LOOPBACK_HOSTS:
        raise ValueError(f"{what}: plain http is allowed only on loopback (127.0.0.1, localhost, [::1]); use https")
    return parts


# --- retry ----------------------------------------------------------------------------------------------------


def backoff_wait(retry_number: int, backoff_s: float, cap_s: float, retry_after: float | None = None) -> float:
    """The wait before retry ``retry_number`` (1 for the first retry): exponential, raised to the server's
    ``Retry-After`` when that is longer, never more than ``cap_s``."""
    wait = backoff_s * 2 ** (retry_number - 1)
    if retry_after is not None:
        wait = max(wait, retry_after)
    return max(0.0, min(wait, cap_s))


def retry(call: Callable[[int], T], *, attempts: int, backoff_s: float, cap_s: float, deadline: float | None = None,
          sleep: Callable[[float], None] = time.sleep,
          on_failure: Callable[[int, Transient], None] | None = None) -> T:
    """``call(attempt)`` (attempt 0, 1, ...) until it returns, at most ``attempts`` times; only :class:`Transient`
    errors are retried, any other exception goes straight through. ``deadline`` (``time.monotonic()`` value): no wait
    is started that would end past it. ``on_failure(attempt, error)`` hears every retryable failure (to log it).

    Raises:
        GaveUp: every attempt failed with a retryable error.
        DeadlineExceeded: the next wait would pass the deadline.
    """
    last: Transient | None = None
    for attempt in range(max(attempts, 1)):
        if last is not None:
            wait = backoff_wait(attempt, backoff_s, cap_s, last.retry_after)
            if deadline is not None and time.monotonic() + wait >= deadline:
                raise DeadlineExceeded(last)
            sleep(wait)
        try:
            return call(attempt)
        except Transient as exc:
            last = exc
            if on_failure is not None:
                on_failure(attempt, exc)
    raise GaveUp(max(attempts, 1), last)  # type: ignore[arg-type]  # the loop ran at least once


def budget_s(*, requests: int, attempts: int, timeout_s: float, backoff_s: float, cap_s: float) -> float:
    """A default overall deadline: ``requests`` requests, each retried ``attempts`` times with every attempt taking
    its connect and read timeouts in full, plus the back-off waits between them."""
    waits = sum(backoff_wait(n, backoff_s, cap_s) for n in range(1, attempts))
    return requests * (attempts * 2 * timeout_s + waits)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date); ``None`` when absent or malformed."""
    if not value or len(value) > 100:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(int(value[:12]))
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - time.time()) if when.tzinfo else None


# --- the edge -------------------------------------------------------------------------------------------------


class Watchdog:
    """One overall deadline for sockets: when it passes, every socket it watches is shut down, which ends any read
    or write blocked on it (a server dripping a byte at a time restarts each per-read timeout, not this).
    ``fired`` says it did. Use as a context manager, or call :meth:`close`."""

    def __init__(self, deadline: float) -> None:
        self.deadline, self.fired = deadline, False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(deadline - time.monotonic(), 0.0), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            if self.fired:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            else:
                self._socks.append(sock.dup())  # the same connection: shutting it down ends any read on it

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            for s in self._socks:
                s.close()
            self._socks.clear()


def _session(guard: Watchdog, admit: Callable[[str, int | None], None]) -> Any:
    import requests
    from requests.adapters import HTTPAdapter
    from urllib3.connection import HTTPConnection, HTTPSConnection
    from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

    class Watched:
        def _new_conn(self) -> socket.socket:
            admit(self._dns_host, self.port)  # type: ignore[attr-defined]
            sock: socket.socket = super()._new_conn()  # type: ignore[misc]
            guard.watch(sock)
            return sock

    pools = {"http": type("EdgeHTTPPool", (HTTPConnectionPool,),
                          {"ConnectionCls": type("EdgeHTTPConnection", (Watched, HTTPConnection), {})}),
             "https": type("EdgeHTTPSPool", (HTTPSConnectionPool,),
                           {"ConnectionCls": type("EdgeHTTPSConnection", (Watched, HTTPSConnection), {})})}

    class Adapter(HTTPAdapter):
        def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
            super().init_poolmanager(*args, **kwargs)
            self.poolmanager.pool_classes_by_scheme = pools

    session = requests.Session()
    session.trust_env = False  # no proxy, netrc or CA bundle from the environment
    session.verify = True
    session.headers = requests.structures.CaseInsensitiveDict(
        {"User-Agent": "cvm-tune", "Accept-Encoding": "identity", "Accept": "*/*"})
    for prefix in ("http://", "https://"):
        session.mount(prefix, Adapter(max_retries=0))
    return session


def _target(parts: urllib.parse.SplitResult) -> tuple[str, str, int]:
    """(URL rebuilt from the parsed parts, host, port): what is sent is exactly what the check saw."""
    host = (parts.hostname or "").rstrip(".").lower()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, "")), host, port


def _line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:300]


class Edge:
    """One session under one overall deadline (``deadline_s`` from now); ``timeout_s`` bounds each connect and
    each read. Use as a context manager."""

    def __init__(self, *, deadline_s: float, timeout_s: float) -> None:
        self.deadline = time.monotonic() + deadline_s
        self.timeout_s = timeout_s
        self._guard = Watchdog(self.deadline)
        self._pinned = ("", 0)  # the one host and port a connection may go to (set per request from its URL)
        self._session = _session(self._guard, self._admit)

    def __enter__(self) -> Edge:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._session.close()
        self._guard.close()

    def _admit(self, host: str, port: int | None) -> None:
        if (host.strip("[]").rstrip(".").lower(), port) != self._pinned:
            raise EdgeError(f"refused a connection to {host}:{port}, not the host the URL check parsed")

    def request(self, method: str, url: str, *, check: Check, headers: Mapping[str, str] | None = None,
                json: Any = None, redirects: int = 0) -> Answer:
        """Send one request and return the answer (any status but 429/5xx and unfollowed redirects), body unread.

        ``check`` parses and vets each URL (its exception goes through as is); up to ``redirects`` redirects are
        followed, each target checked again.

        Raises:
            Transient: a connection error or timeout, or HTTP 429/5xx (with its ``Retry-After``).
            Redirected: a redirect that was not allowed.
            DeadlineExceeded: the deadline passed before or while waiting for the answer.
            EdgeError: TLS failure, an encoded body, or another request error.
        """
        sent = dict(headers or {})
        origin = None
        for hop in range(redirects + 1):
            parts = check(url)
            target, host, port = _target(parts)
            if origin is not None and origin != (parts.scheme, host, port):
                sent = {k: v for k, v in sent.items() if k.lower() != "authorization"}
            origin = (parts.scheme, host, port)
            remaining = self.deadline - time.monotonic()
            if remaining <= 0 or self._guard.fired:
                raise DeadlineExceeded
            self._pinned = (host, port)
            try:
                resp = self._session.request(method, target, headers=sent, json=json, allow_redirects=False,
                                             stream=True, timeout=(min(self.timeout_s, remaining), self.timeout_s))
            except Exception as exc:  # noqa: BLE001 - every requests/urllib3/socket failure becomes an EdgeError
                raise self._failure(exc) from None
            status = resp.status_code
            if status in REDIRECT_STATUSES:
                location = resp.headers.get("Location")
                resp.close()
                if location is None or hop == redirects:
                    raise Redirected(status, location, redirects)
                url = urllib.parse.urljoin(url, location)
                continue
            if status == 429 or status >= 500:
                retry_after = parse_retry_after(resp.headers.get("Retry-After"))
                resp.close()
                raise Transient(f"HTTP {status}", status=status, retry_after=retry_after)
            encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
            if encoding != "identity":
                resp.close()
                raise EdgeError(f"the server sent a {encoding[:40]!r}-encoded body, not the plain one asked for")
            return Answer(self, resp, target)
        raise AssertionError("unreachable")  # pragma: no cover

    def _failure(self, exc: BaseException) -> EdgeError:
        if isinstance(exc, EdgeError):
            return exc
        if self._guard.fired:
            return DeadlineExceeded(Transient(type(exc).__name__, kind=type(exc).__name__))
        import requests
        import urllib3

        kind = type(exc).__name__
        if isinstance(exc, requests.exceptions.SSLError):
            return EdgeError(f"TLS: {kind}: {_line(exc)}")
        if isinstance(exc, (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
                            urllib3.exceptions.HTTPError, http.client.HTTPException, OSError)):
            return Transient(f"{kind}: {_line(exc)}", kind=kind)
        return EdgeError(f"{kind}: {_line(exc)}")


class Answer:
    """A response whose body has not been read: ``status``, ``headers`` (case-insensitive), ``url`` (as sent)."""

    def __init__(self, edge: Edge, resp: Any, url: str) -> None:
        self._edge, self._resp = edge, resp
        self.status: int = resp.status_code
        self.headers: Mapping[str, str] = resp.headers
        self.url = url

    def __enter__(self) -> Answer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._resp.close()

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes of the body (``b""`` at its end).

        Raises:
            Transient: the connection failed or closed before the announced length.
            DeadlineExceeded: the deadline passed.
        """
        try:
            data: bytes = self._resp.raw.read(n, decode_content=False)
        except Exception as exc:  # noqa: BLE001 - see Edge._failure
            raise self._edge._failure(exc) from None
        if self._edge._guard.fired:
            raise DeadlineExceeded
        return data

    def read_at_most(self, limit: int) -> bytes:
        """The body, or its first ``limit`` bytes when it is longer (nothing past that is read)."""
        chunks, got = [], 0
        while got < limit and (block := self.read(min(_BLOCK, limit - got))):
            chunks.append(block)
            got += len(block)
        return b"".join(chunks)

    def read_all(self, max_bytes: int) -> bytes:
        """The whole body.

        Raises:
            TooLarge: more than ``max_bytes`` (at most one byte more is read).
        """
        body = self.read_at_most(max_bytes + 1)
        if len(body) > max_bytes:
            raise TooLarge(f"answered more than {max_bytes} bytes")
        return body
