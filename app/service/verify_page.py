"""The browser verifier (web/dist/verify.html) where the bundles are: ``/verify`` on ``cvm-tune bundles serve``,
and the line ``show`` and ``verify`` print to open it.

``verify.html`` next to this module is the built page (in a checkout a link to ``web/dist/verify.html``; a wheel and
the image carry the file itself). The bundle server answers, behind the same token as ``/v1`` (a browser sends it as
the password of HTTP Basic authentication, any user name, after the 401's challenge):

    GET /verify                                  the page, under its own Content-Security-Policy
    GET /verify/runs                             the exported runs, a link each that opens the page on its bundle
    GET /verify/bundles/<run_id>.tar.gz          the bundle's listed regular files as a gzip tar, streamed
    GET /verify/simulator-test-policy.yaml       the volume's simulator test policy (a simulator run wrote it)

Light to import (``cvm-tune show`` and ``verify`` call :func:`browser_line`); the server's pieces come with it.
"""

from __future__ import annotations

import html
import os
import re
import stat
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

from attestation.bundle.manifest import RUN_ID_PATTERN

from app.errors import StateError
from app.fsutil import open_regular

PAGE = Path(__file__).with_name("verify.html")
PREFIX = "/verify"
POLICY_FILE = "simulator-test-policy.yaml"  # what a simulator run writes next to exports/ (app.export.stage)
REALM = 'Basic realm="cvm-tune bundles"'
RUNS_CSP = "default-src 'none'"  # the run list: links only, no script, no style
COMMON_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}
_META_CSP = re.compile(rb'<meta http-equiv="Content-Security-Policy" content="([^"]+)"')


def page_bytes() -> tuple[bytes, str] | None:
    """The page and the Content-Security-Policy its meta tag declares (its script and style hashes), with
    ``frame-ancestors 'none'`` (which a meta tag cannot set); None when this install has no page."""
    try:
        data = PAGE.read_bytes()
    except OSError:
        return None
    found = _META_CSP.search(data[:4096])
    return (data, found.group(1).decode() + "; frame-ancestors 'none'") if found else None


def verify_url(run_id: str, *, policy: bool, base: str = "") -> str:
    """The address that opens the page on a served bundle (``base``: the server's URL, or nothing for a link)."""
    url = f"{base}{PREFIX}?bundle={PREFIX}/bundles/{quote(run_id)}.tar.gz"
    return url + (f"&policy={PREFIX}/{POLICY_FILE}" if policy else "")


def runs_page(runs: list[dict[str, Any]], policy: bool) -> bytes:
    """The run list: one link per exported run, and the page itself for a bundle on disk."""
    items = "".join(f'<li><a href="{html.escape(verify_url(r["run_id"], policy=policy))}">{html.escape(r["run_id"])}'
                    f"</a> {html.escape(r['kind'])}, {html.escape(str(r['status']))}, "
                    f"{html.escape(str(r['started_at'] or ''))}</li>\n" for r in runs)
    items = items or "<li>no exported bundle yet</li>\n"
    return ("<!doctype html>\n<html lang=en><meta charset=utf-8><title>cvm-tune bundles</title>\n"
            f"<h1>cvm-tune bundles: verify in this browser</h1>\n<ul>\n{items}</ul>\n"
            f'<p><a href="{PREFIX}">The verifier page</a>: drop a bundle folder or archive on it.</p>\n').encode()


def answer(h: Any, rest: list[str], runs: Callable[[Path], list[dict[str, Any]]],
           bundle_files: Callable[[Path], dict[str, int]]) -> None:
    """Answer ``/verify/<rest>`` on the bundle server's handler ``h`` (authenticated already) with its ``runs`` and
    ``bundle_files``: the page, the run list, a bundle as .tar.gz, the policy; 404 for anything else."""
    output: Path = h.server.output
    policy = _regular_size(output / POLICY_FILE)
    if rest == [] and (page := page_bytes()) is not None:
        return h._send(200, page[0], "text/html; charset=utf-8", Content_Security_Policy=page[1])
    if rest == ["runs"]:
        try:
            listed = [r for r in runs(output) if (output / "exports" / r["run_id"]).is_dir()]
        except StateError as exc:  # damaged, or written by a later release
            return h._send(503, f"{exc.message}\n".encode())
        return h._send(200, runs_page(listed, policy is not None), "text/html; charset=utf-8",
                       Content_Security_Policy=RUNS_CSP)
    if rest == [POLICY_FILE] and policy is not None:
        return h._file(output / POLICY_FILE, policy)
    run_id = rest[1].removesuffix(".tar.gz") if len(rest) == 2 and rest[0] == "bundles" else ""
    bundle = output / "exports" / run_id
    if rest[1:] == [f"{run_id}.tar.gz"] and re.fullmatch(RUN_ID_PATTERN, run_id) and bundle.is_dir() \
            and (files := bundle_files(bundle)):
        h.send_response(200)
        h.send_header("Content-Type", "application/gzip")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        return _stream_tar_gz(_Chunked(h.wfile), run_id, bundle, files)
    return h._send(404, b"not found\n")


def _regular_size(path: Path) -> int | None:
    """The size of ``path`` when it is a regular file (never a symlink), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


class _Chunked:
    """A write-only file over an HTTP/1.1 answer with ``Transfer-Encoding: chunked``."""

    def __init__(self, wfile: BinaryIO) -> None:
        self.wfile = wfile

    def write(self, data: bytes) -> int:
        if data:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        return len(data)


def _stream_tar_gz(out: _Chunked, run_id: str, bundle: Path, files: dict[str, int]) -> None:
    """Write ``files`` (relative path -> size, as listed) of ``bundle`` as a gzip tar under the folder ``run_id``,
    then the last chunk. Each is opened as a regular file only; one shorter than listed ends the answer unfinished
    (tarfile refuses it), so a client never reads it as complete."""
    with tarfile.open(fileobj=out, mode="w|gz", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
        for rel, size in files.items():
            info = tarfile.TarInfo(f"{run_id}/{rel}")
            info.size, info.mode = size, 0o644
            with open_regular(bundle / rel) as fh:
                tar.addfile(info, fh)
    out.wfile.write(b"0\r\n\r\n")


def browser_line(bundle: Path, *, policy: bool) -> str | None:
    """How to open the page on ``bundle`` (one line), or None when this install has no page. ``policy``: the
    bundle needs the simulator's test policy."""
    if not PAGE.is_file():
        return None
    served = verify_url(Path(bundle).resolve().name, policy=policy, base="SERVER")
    return (f"in a browser: open {PAGE.resolve().as_uri()} and drop the bundle on it, or {served} "
            "where `cvm-tune bundles serve` serves it")
