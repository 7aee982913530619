"""A socket guard for tests: any attempt to reach the network is recorded and refused.

``with guard() as attempts: ...`` patches ``socket.socket.connect``/``connect_ex``,
``socket.create_connection`` and ``socket.getaddrinfo``: unix-domain sockets (the dstack guest agent,
the embedded simulator) pass; everything else raises ``OSError`` and is appended to ``attempts`` as
``(function, address)``, so a library that swallows the error is still caught by asserting
``attempts == []``. Loopback TCP is refused too unless ``allow_loopback`` (the multi-GPU rendezvous
uses it). Limits: code that opens sockets outside Python's ``socket`` module (C or Rust extensions)
is not seen.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

_LOOPBACK = ("127.0.0.1", "::1", "localhost")


@contextlib.contextmanager
def guard(*, allow_loopback: bool = False) -> Iterator[list[tuple[str, str]]]:
    """Refuse and record non-unix connections while the block runs."""
    attempts: list[tuple[str, str]] = []
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_create, real_getaddrinfo = socket.create_connection, socket.getaddrinfo

    def allowed(family: int, address: Any) -> bool:
        if family == getattr(socket, "AF_UNIX", None):
            return True
        host = address[0] if isinstance(address, tuple) and address else address
        return allow_loopback and host in _LOOPBACK

    def refuse(what: str, address: Any) -> OSError:
        attempts.append((what, repr(address)))
        return OSError(f"network access blocked by the test socket guard: {what} {address!r}")

    def connect(self: socket.socket, address: Any) -> Any:
        if not allowed(self.family, address):
            raise refuse("connect", address)
        return real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> Any:
        if not allowed(self.family, address):
            raise refuse("connect_ex", address)
        return real_connect_ex(self, address)

    def create_connection(address: Any, *args: Any, **kwargs: Any) -> Any:
        if not allowed(socket.AF_INET, address):
            raise refuse("create_connection", address)
        return real_create(address, *args, **kwargs)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if not (allow_loopback and host in _LOOPBACK):
            raise refuse("getaddrinfo", host)
        return real_getaddrinfo(host, *args, **kwargs)

    socket.socket.connect, socket.socket.connect_ex = connect, connect_ex  # type: ignore[method-assign]
    socket.create_connection, socket.getaddrinfo = create_connection, getaddrinfo  # type: ignore[assignment]
    try:
        yield attempts
    finally:
        socket.socket.connect, socket.socket.connect_ex = real_connect, real_connect_ex  # type: ignore[method-assign]
        socket.create_connection, socket.getaddrinfo = real_create, real_getaddrinfo  # type: ignore[assignment]
