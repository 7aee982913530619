"""Getting bundles out of the CVM: a read-only HTTP server over the output volume, and its client.

In a dstack CVM nothing but the gateway reaches a container (``https://<app-id>-<port>.<gateway domain>``), and
logs stay private (``public_logs: false``). ``cvm-tune bundles serve`` (the ``bundles`` service of
docker-compose.yaml: output volume mounted read-only, no guest-agent socket) answers:

    GET /v1/runs                      [{run_id, kind, status, started_at, exported, promoted}] from the run database
                                      (state/runs.sqlite): runs (kind run) and the training API's saves (kind api)
    GET /v1/promoted                  {"run_id", "files"} of the bundle exports/PROMOTED names (continual retraining)
    GET /v1/bundles/<run_id>          {"files": {path: size}} of exports/<run_id>/
    GET /v1/bundles/<run_id>/<path>   one file of that bundle
    GET /verify, /verify/runs, …      the browser verifier on these bundles (:mod:`app.service.verify_page`)

Every request carries ``Authorization: Bearer <token>`` (a browser: HTTP Basic, the token as the password). The
server holds no secret: it compares SHA-256(token) with ``CVM_TUNE_BUNDLES_TOKEN_SHA256``, a value in the measured
compose file. Unlike an encrypted env var, the host cannot swap it without changing the compose-hash (dstack.md
§5.4). Outside a CVM, ``bundles serve --token-file FILE`` takes the hash of the token in FILE instead. A bundle
needs no secrecy to be *checked* (``cvm-tune verify`` trusts nothing the transport says); the token keeps the adapter
to its operator.

The client (``cvm-tune bundles list``/``fetch``) goes through the HTTP edge (:mod:`attestation.io.http_edge`): it sends
the token only to the host its URL names (https, or http on loopback; no user name in the URL, no redirect followed,
no proxy), retries network errors, 429 and 5xx a bounded number of times, reads bounded answers under an overall
deadline, checks every name and size the server lists, and writes a fetched bundle complete or not at all. A bad
answer is a ``StateError``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
import stat
import threading
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

from attestation.bundle.manifest import RUN_ID_PATTERN
from attestation.io.http_edge import Answer, DeadlineExceeded, Edge, EdgeError, GaveUp, Redirected, budget_s, retry
from attestation.io.safe_yaml import parse_json

from app.config import check_url
from app.errors import ConfigError, StateError
from app.fsutil import open_regular, staged_dir
from app.service import verify_page as P
from app.service.api_saves import api_saves
from app.state import run_list

TOKEN_ENV = "CVM_TUNE_BUNDLES_TOKEN_SHA256"
_RUN_ID = re.compile(RUN_ID_PATTERN)
_CHUNK = 1 << 20
MAX_ANSWER_BYTES = 16 << 20  # a run list or a bundle listing: a few KB
MAX_RUNS = 100_000
MAX_FILES = 10_000
MAX_FILE_BYTES = 1 << 40  # a merged model's shard is a few GB
MAX_TOKEN_CHARS = 1000
RETRIES = 2  # the client's retries per request (network errors, 429, 5xx), through the HTTP edge
BACKOFF_S = 1.0
BACKOFF_CAP_S = 30.0
MIN_RATE_BPS = 64 << 10  # a file may take its size at this rate, on top of the timeouts, before it is cut off
T = TypeVar("T")


def token_sha256(token: str) -> str:
    """What the compose pins (``CVM_TUNE_BUNDLES_TOKEN_SHA256``) and the server compares a bearer token to."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(path: Path) -> str:
    """Write a fresh random token to ``path`` (mode 0600, never overwritten); return its SHA-256 (hex).

    The file holds the token alone, without a newline, so the hash is also ``sha256sum`` of the file. (Files of
    earlier releases end with a newline; :func:`read_token` strips it, and the hash pinned for them stays valid.)

    Raises:
        ConfigError: ``path`` exists or cannot be created.
    """
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot create {path}: {exc.strerror}", fix="choose a new file name (tokens are never overwritten)") from exc
    with os.fdopen(fd, "w") as fh:
        fh.write(token)
    return token_sha256(token)


def serve_token_sha256(token_file: Path | None, pinned: str | None) -> str:
    """The token hash ``bundles serve`` compares bearer tokens to: the SHA-256 of the token in ``token_file``
    (a local server), or ``pinned`` (``CVM_TUNE_BUNDLES_TOKEN_SHA256``, set by the measured compose); both may be
    given only when they agree.

    Raises:
        ConfigError: neither is given, the file holds no token, or the file's token is not the one pinned.
    """
    if token_file is None:
        if not pinned:
            raise ConfigError(f"the bundle server needs a token: --token-file FILE, or {TOKEN_ENV} (the compose sets it)",
                              fix="write one with `cvm-tune bundles token FILE` and pass --token-file FILE")
        return pinned
    digest = token_sha256(read_token(token_file))
    if pinned and pinned != digest:
        raise ConfigError(f"the token in {token_file} is not the one {TOKEN_ENV} pins ({pinned[:12]}…)",
                          fix=f"pass the token file the compose pins, or unset {TOKEN_ENV}")
    return digest


def read_token(path: Path) -> str:
    """The token in ``path`` (first line, stripped): printable ASCII without spaces, as ``new_token`` writes it.

    Raises:
        ConfigError: unreadable, not a regular file, empty or not such a token.
    """
    try:
        with open_regular(path) as fh:
            token = fh.read(MAX_TOKEN_CHARS + 2).decode("ascii").strip().splitlines()[0]
    except (OSError, ValueError, IndexError):
        raise ConfigError(f"cannot read a token from {path}", fix="pass the file `cvm-tune bundles token` wrote") from None
    if not 0 < len(token) <= MAX_TOKEN_CHARS or not token.isprintable() or " " in token:
        raise ConfigError(f"{path} does not hold a bundle token (one line of printable ASCII, no spaces)",
                          fix="pass the file `cvm-tune bundles token` wrote")
    return token


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
    """One line per run of the run database and per save of the training API (read-only), by run id: id, ``kind``
    (``run``: nightly or ad hoc; ``api``: a training-API checkpoint, status ``saved``), status, start (save) time,
    whether its bundle is exported and whether it is the one exports/PROMOTED names."""
    found = [{**r, "kind": "run"} for r in run_list(output, promoted=_promoted(output))]
    found += [{"run_id": a["run_id"], "kind": "api", "status": "saved", "started_at": a["saved_at"],
               "exported": a["exported"], "promoted": False} for a in api_saves(output)]
    return sorted(found, key=lambda r: r["run_id"])


def _authorized(auth: str, pinned: str) -> bool:
    """``Bearer TOKEN``, or (from a browser) ``Basic`` with the token as the password and any user name."""
    scheme, _, value = auth.partition(" ")
    if scheme == "Basic":
        try:
            value = base64.b64decode(value, validate=True).decode().partition(":")[2]
        except ValueError:  # binascii.Error and UnicodeDecodeError are ValueErrors
            return False
    return scheme in ("Bearer", "Basic") and hmac.compare_digest(token_sha256(value), pinned)


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
    _page = False  # answering /verify…: the page's security headers go on every answer

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        path = urllib.parse.urlsplit(self.path).path
        self._page = path == P.PREFIX or path.startswith(P.PREFIX + "/")
        if not _authorized(self.headers.get("Authorization", ""), self.server.token_sha256):
            if self._page:  # a browser asks for the token (the password; any user name), then sends it on each fetch
                return self._send(401, b"the bundle token, please (any user name)\n", WWW_Authenticate=P.REALM)
            return self._json(401, {"error": "missing or wrong bearer token"})
        parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
        if self._page:
            return P.answer(self, parts[1:], runs, bundle_files)
        if parts == ["v1", "runs"]:
            try:
                return self._json(200, runs(self.server.output))
            except StateError as exc:  # damaged, or written by a later release
                return self._json(503, {"error": exc.message})
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

    def _send(self, code: int, data: bytes, kind: str = "text/plain; charset=utf-8", **headers: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(data)

    def _json(self, code: int, body: Any) -> None:
        self._send(code, json.dumps(body, indent=1).encode(), "application/json")

    def end_headers(self) -> None:
        if self._page:
            for name, value in P.COMMON_HEADERS.items():
                self.send_header(name, value)
        super().end_headers()

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


def _bad_answer(what: str) -> StateError:
    return StateError(f"the bundle server's {what}", fix="check the URL: it must be a cvm-tune bundle server "
                      "(cvm-tune bundles serve), nothing else")


def _check(url: str) -> urllib.parse.SplitResult:
    try:
        return check_url(url, "the bundle server URL")
    except ValueError as exc:
        raise ConfigError(str(exc), fix="pass the gateway URL, https://<app-id>-8000.<gateway domain>") from None


def _get(url: str, token: str, timeout: float, deadline_s: float, consume: Callable[[Answer], T]) -> T:
    """A GET with the bearer token through the HTTP edge, to exactly the host ``url`` names (never redirected, never a
    proxy's choice), retried on network errors, 429 and 5xx; ``consume`` reads the 2xx answer (again on a retry)."""

    def attempt(_n: int) -> T:
        with edge.request("GET", url, check=_check, headers={"Authorization": f"Bearer {token}"}) as r:
            if not 200 <= r.status < 300:
                raise StateError(f"{url}: HTTP {r.status}", fix="check the URL, the run id and the token file")
            return consume(r)

    try:
        with Edge(deadline_s=deadline_s, timeout_s=timeout) as edge:
            return retry(attempt, attempts=RETRIES + 1, backoff_s=BACKOFF_S, cap_s=BACKOFF_CAP_S,
                         deadline=edge.deadline)
    except Redirected as exc:
        where = str(exc.location or "?")[:200]
        raise StateError(f"{url}: the server redirected (HTTP {exc.status}) to {where!r}; the bundle token is never "
                         "sent to another address", fix="pass the final URL yourself if you trust it") from None
    except GaveUp as exc:
        what = f"{url}: HTTP {exc.last.status}" if exc.last.status else f"cannot reach {url}: {exc.last.kind}"
        raise StateError(f"{what} (after {exc.attempts} attempts)", fix="check the gateway URL") from None
    except DeadlineExceeded:
        raise StateError(f"{url}: no complete answer within {deadline_s:g} s", fix="check the gateway URL and the "
                         "link; a server that sends slower than that is cut off") from None
    except EdgeError as exc:
        raise StateError(f"{url}: {exc.reason}", fix="check the gateway URL") from None


def _get_json(url: str, token: str, timeout: float, what: str) -> object:
    deadline_s = budget_s(requests=1, attempts=RETRIES + 1, timeout_s=timeout, backoff_s=BACKOFF_S,
                          cap_s=BACKOFF_CAP_S)
    raw = _get(url, token, timeout, deadline_s, lambda r: r.read_at_most(MAX_ANSWER_BYTES + 1))
    return parse_json(raw, what, _bad_answer, max_bytes=MAX_ANSWER_BYTES)


def _download(url: str, token: str, timeout: float, target: Path, size: int) -> None:
    """Stream one file to ``target``: exactly the ``size`` bytes the listing announced, never more; a retry starts
    the file over. The deadline allows ``MIN_RATE_BPS`` for the announced size on top of the timeouts."""
    deadline_s = budget_s(requests=1, attempts=RETRIES + 1, timeout_s=timeout, backoff_s=BACKOFF_S,
                          cap_s=BACKOFF_CAP_S) + size / MIN_RATE_BPS

    def consume(r: Answer) -> int:
        fh.seek(0)
        fh.truncate()
        got = 0
        while chunk := r.read(min(_CHUNK, size - got + 1)):
            got += len(chunk)
            if got > size:
                raise _bad_answer(f"file {target.name} is longer than the {size} bytes it listed")
            fh.write(chunk)
        return got

    with open(target, "xb") as fh:
        got = _get(url, token, timeout, deadline_s, consume)
    if got != size:
        raise _bad_answer(f"file {target.name} ended after {got} of the {size} bytes it listed")


def _safe_rel(rel: object) -> str:
    """A listed file name: a relative path of plain components, printable, no NUL, no backslash."""
    if not isinstance(rel, str) or not 0 < len(rel) <= 1000 or not rel.isprintable() or "\\" in rel \
            or any(part in ("", ".", "..") for part in rel.split("/")):
        raise _bad_answer(f"listing names an unsafe path {str(rel)[:100]!r}")
    return rel


def list_runs(base_url: str, token: str, *, timeout: float = 60.0) -> list[dict[str, Any]]:
    """The server's run list: ``run_id`` (a safe run id), ``kind`` (``run`` or ``api``; ``run`` from a server of
    an earlier release), ``status``, ``started_at`` (short printable text or None), ``exported``, ``promoted``
    (booleans).

    Raises:
        ConfigError: a URL that is not https (or http on loopback), or that carries a user name.
        StateError: the server cannot be reached, answers an HTTP error or a redirect, or not a run list.
    """
    doc = _get_json(f"{base_url.rstrip('/')}/v1/runs", token, timeout, "run list")
    if not isinstance(doc, list) or len(doc) > MAX_RUNS:
        raise _bad_answer(f"run list is not a list of at most {MAX_RUNS} runs")
    out = []
    for r in doc:
        if not isinstance(r, dict) or not isinstance(r.get("run_id"), str) or not _RUN_ID.fullmatch(r["run_id"]):
            raise _bad_answer("run list holds an entry without a valid run_id")
        text = {k: r.get(k) if isinstance(r.get(k), str) and r[k].isprintable() else None
                for k in ("status", "started_at")}
        out.append({"run_id": r["run_id"], "kind": "api" if r.get("kind") == "api" else "run",
                    **{k: v[:40] if v else v for k, v in text.items()},
                    "exported": r.get("exported") is True, "promoted": r.get("promoted") is True})
    return out


def fetch(base_url: str, run_id: str, dest: Path, token: str, *, timeout: float = 60.0) -> Path:
    """Download bundle ``run_id`` into ``dest/run_id`` (which must not exist) and return that directory. The
    directory appears complete or not at all.

    Raises:
        ConfigError: a run id that is not one, or a URL that is not https (or http on loopback).
        StateError: transport error, a redirect, an answer that is not a bundle listing or not the files it listed
            (unsafe names, sizes), or the destination exists or cannot be written.
    """
    if not _RUN_ID.fullmatch(run_id):
        raise ConfigError(f"run id {run_id!r} is not allowed")
    base = f"{base_url.rstrip('/')}/v1/bundles/{run_id}"
    listing = _get_json(base, token, timeout, "bundle listing")
    files = listing.get("files") if isinstance(listing, dict) else None
    if not isinstance(files, dict) or len(files) > MAX_FILES:
        raise _bad_answer(f"bundle listing has no files map of at most {MAX_FILES} entries")
    sizes = {_safe_rel(rel): size for rel, size in files.items()}
    if any(type(n) is not int or not 0 <= n <= MAX_FILE_BYTES for n in sizes.values()):
        raise _bad_answer(f"bundle listing gives a size that is not an integer from 0 to {MAX_FILE_BYTES}")
    out = dest / run_id
    if out.exists():
        raise StateError(f"{out} already exists", fix="fetch into an empty directory")
    try:
        with staged_dir(out) as stage:
            for rel, size in sizes.items():
                target = stage / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                _download(f"{base}/{urllib.parse.quote(rel)}", token, timeout, target, size)
    except OSError as exc:
        raise StateError(f"cannot write the bundle into {dest}: {exc.strerror or type(exc).__name__}",
                         fix="check free space and permissions there; nothing was kept") from None
    return out
