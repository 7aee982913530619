"""Getting bundles out of the CVM: a read-only HTTP server over the output volume, and its client.

In a dstack CVM nothing but the gateway reaches a container (``https://<app-id>-<port>.<gateway domain>``), and
logs stay private (``public_logs: false``). ``cvm-tune bundles serve`` (the ``bundles`` service of
docker-compose.yaml: output volume mounted read-only, no guest-agent socket) answers:

    GET /v1/runs                      [{run_id, status, started_at, exported, promoted}] from runs/*/state.json
    GET /v1/promoted                  {"run_id", "files"} of the bundle exports/PROMOTED names (continual retraining)
    GET /v1/bundles/<run_id>          {"files": {path: size}} of exports/<run_id>/
    GET /v1/bundles/<run_id>/<path>   one file of that bundle

Every request carries ``Authorization: Bearer <token>``. The server holds no secret: it compares SHA-256(token)
with ``CVM_TUNE_BUNDLES_TOKEN_SHA256``, a value in the measured compose file. Unlike an encrypted env var, the
host cannot swap it without changing the compose-hash (dstack.md §5.4). A bundle needs no secrecy to be
*checked* (``cvm-tune verify`` trusts nothing the transport says); the token keeps the adapter to its operator.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import stat
import threading
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from attestation.bundle import RUN_ID_PATTERN

from app.errors import ConfigError, StateError

TOKEN_ENV = "CVM_TUNE_BUNDLES_TOKEN_SHA256"
_RUN_ID = re.compile(RUN_ID_PATTERN)
_CHUNK = 1 << 20


def token_sha256(token: str) -> str:
    """What the compose pins (``CVM_TUNE_BUNDLES_TOKEN_SHA256``) and the server compares a bearer token to."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(path: Path) -> str:
    """Write a fresh random token to ``path`` (mode 0600, never overwritten); return its SHA-256 (hex).

    Raises:
        ConfigError: ``path`` exists or cannot be created.
    """
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot create {path}: {exc.strerror}", fix="choose a new file name (tokens are never overwritten)") from exc
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return token_sha256(token)


def read_token(path: Path) -> str:
    """The token in ``path`` (first line, stripped)."""
    try:
        return path.read_text().strip().splitlines()[0]
    except (OSError, IndexError) as exc:
        raise ConfigError(f"cannot read a token from {path}") from exc


def bundle_files(root: Path) -> dict[str, int]:
    """Relative path -> size of every regular file of a bundle (symlinks and specials are never served)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        for name in filenames:
            full = Path(dirpath) / name
            st = os.lstat(full)
            if stat.S_ISREG(st.st_mode):
                out[full.relative_to(root).as_posix()] = st.st_size
    return dict(sorted(out.items()))


def runs(output: Path) -> list[dict[str, Any]]:
    """One line per run directory: id, status, start time and whether its bundle is exported."""
    out = []
    promoted = _promoted(output)
    for state in sorted((output / "runs").glob("*/state.json")):
        try:
            s = json.loads(state.read_text())
        except (OSError, ValueError):
            continue
        run_id = state.parent.name
        out.append({"run_id": run_id, "status": s.get("status"), "started_at": s.get("started_at"),
                    "exported": (output / "exports" / run_id / "manifest.json").is_file(),
                    "promoted": run_id == promoted})
    return out


def _promoted(output: Path) -> str | None:
    """The run id ``exports/PROMOTED`` names, when it is a well-formed one."""
    try:
        text = (output / "exports" / "PROMOTED").read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if _RUN_ID.fullmatch(text) else None


class _Handler(BaseHTTPRequestHandler):
    server: BundleServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        auth = self.headers.get("Authorization", "")
        given = token_sha256(auth.removeprefix("Bearer "))
        if not auth.startswith("Bearer ") or not hmac.compare_digest(given, self.server.token_sha256):
            return self._json(401, {"error": "missing or wrong bearer token"})
        parts = [urllib.parse.unquote(p) for p in urllib.parse.urlsplit(self.path).path.strip("/").split("/")]
        if parts == ["v1", "runs"]:
            return self._json(200, runs(self.server.output))
        if parts == ["v1", "promoted"] and (promoted := _promoted(self.server.output)) is not None:
            parts = ["v1", "bundles", promoted]
        if len(parts) >= 3 and parts[:2] == ["v1", "bundles"] and _RUN_ID.fullmatch(parts[2]):
            bundle = self.server.output / "exports" / parts[2]
            files = bundle_files(bundle) if bundle.is_dir() else {}
            if len(parts) == 3 and files:
                return self._json(200, {"run_id": parts[2], "files": files})
            rel = "/".join(parts[3:])
            if rel in files:  # only a listed regular file: no traversal, no symlink
                return self._file(bundle / rel, files[rel])
        return self._json(404, {"error": "not found"})

    def _json(self, code: int, body: Any) -> None:
        data = json.dumps(body, indent=1).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _file(self, path: Path, size: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size))
        self.end_headers()
        with open(path, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                self.wfile.write(chunk)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server signature)
        pass  # no request log: paths name runs, nothing else is worth keeping


class BundleServer(ThreadingHTTPServer):
    """``serve_forever()`` in the foreground, or ``start()``/``stop()`` around a test."""

    daemon_threads = True

    def __init__(self, output: Path, token_sha256: str, *, host: str = "0.0.0.0", port: int = 8000) -> None:
        if not re.fullmatch(r"[0-9a-f]{64}", token_sha256 or ""):
            raise ConfigError(f"{TOKEN_ENV} must be the SHA-256 (64 lowercase hex) of the bundle token",
                              fix="run `cvm-tune bundles token FILE` and put the printed hash in docker-compose.yaml")
        super().__init__((host, port), _Handler)
        self.output = output
        self.token_sha256 = token_sha256
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> BundleServer:
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def _get(url: str, token: str, timeout: float) -> bytes:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return bytes(resp.read())
    except urllib.error.HTTPError as exc:
        raise StateError(f"{url}: HTTP {exc.code}", fix="check the URL, the run id and the token file") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise StateError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}", fix="check the gateway URL") from exc


def list_runs(base_url: str, token: str, *, timeout: float = 60.0) -> list[dict[str, Any]]:
    """The server's run list."""
    return list(json.loads(_get(f"{base_url.rstrip('/')}/v1/runs", token, timeout)))


def fetch(base_url: str, run_id: str, dest: Path, token: str, *, timeout: float = 60.0) -> Path:
    """Download bundle ``run_id`` into ``dest/run_id`` (which must not exist) and return that directory.

    Raises:
        StateError: transport error, or the destination exists.
        ConfigError: a run id or file name the server should never have sent.
    """
    if not _RUN_ID.fullmatch(run_id):
        raise ConfigError(f"run id {run_id!r} is not allowed")
    base = f"{base_url.rstrip('/')}/v1/bundles/{run_id}"
    listing = json.loads(_get(base, token, timeout))
    out = dest / run_id
    if out.exists():
        raise StateError(f"{out} already exists", fix="fetch into an empty directory")
    for rel in listing["files"]:
        if rel.startswith("/") or ".." in rel.split("/"):
            raise ConfigError(f"the server listed an unsafe path {rel!r}")
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(_get(f"{base}/{urllib.parse.quote(rel)}", token, timeout))
    return out
