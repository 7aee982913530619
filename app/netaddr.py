"""An address a server is about to listen on, checked before anything slow starts (a model load, a guest agent).

``bundles serve`` and ``api serve`` call :func:`require_free_address` first: an address in use, not of this machine,
or refused to this user is one line and a usage exit (2), not a traceback or a failure after a minute of loading.
"""

from __future__ import annotations

import errno
import socket

from app.errors import ConfigError


def require_free_address(host: str, port: int, option: str) -> None:
    """Bind ``host:port`` once, as the server will (``SO_REUSEADDR``, as uvicorn and ``http.server`` set it), and let
    go. Port 0 (any free port) always binds.

    Raises:
        ConfigError: the host does not resolve, is not an address of this machine, the port is in use or refused.
    """
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                 flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"{option} {shown}: {host!r} does not resolve ({exc})",
                          fix=f"give an address of this machine, e.g. {option} 127.0.0.1") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"{shown} is already in use by another process",
                                  fix=f"stop that process, or choose another port ({option})") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"{shown}: {host} is not an address of this machine",
                                  fix=f"give one of its addresses ({option}), e.g. 127.0.0.1") from None
            if exc.errno == errno.EACCES:
                raise ConfigError(f"{shown}: binding port {port} is not allowed to this user",
                                  fix=f"choose a port above 1023 ({option})") from None
            raise ConfigError(f"cannot listen on {shown}: {exc.strerror or exc}",
                              fix=f"choose another address or port ({option})") from None
