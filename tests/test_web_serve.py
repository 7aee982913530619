"""The browser verifier where the bundles are: ``cvm-tune bundles serve`` answers ``/verify`` (the page),
``/verify/runs`` (a link per run), ``/verify/bundles/<run_id>.tar.gz`` and ``/verify/simulator-test-policy.yaml``
behind the bundle token, which a browser sends as the password of HTTP Basic authentication. The HTTP side is checked
with http.client (the challenge, wrong tokens, traversal, headers, the archive byte for byte); the page, opened in
headless Chromium on the server with the token in its URL, must accept the demo bundle with the verdict of
``cvm-tune verify --json``. The page ships in the package: a wheel built as the image builds it carries it.
"""

from __future__ import annotations

import base64
import http.client
import io
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlparse

import pytest

from app.service import verify_page as P
from app.service.bundles import BundleServer, bundle_files, token_sha256
from tests.test_web_verify import NOW, REPO, WEB, drive, python_verdict, same_checks, web_copy  # noqa: F401
from tests.test_web_verify import pytestmark as needs_browser

TOKEN = "serve-test-token"
POLICY = "/verify/simulator-test-policy.yaml"


@pytest.fixture(scope="module")
def server(demo_bundle: tuple[Path, Path]) -> Iterator[BundleServer]:
    """The bundle server over the demo run's output volume (read only), on loopback."""
    s = BundleServer(demo_bundle[0].parent.parent, token_sha256(TOKEN), host="127.0.0.1", port=0).start()
    yield s
    s.stop()


def get(server: BundleServer, path: str, auth: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """GET ``path`` with ``Authorization: auth``: (status, headers, body)."""
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    try:
        conn.request("GET", path, headers={"Authorization": auth} if auth else {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def basic(password: str, user: str = "anyone") -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def members(archive: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


# --- HTTP -------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/verify", "/verify/runs", "/verify/bundles/x.tar.gz", POLICY])
def test_a_page_request_without_the_token_gets_the_basic_challenge(server: BundleServer, path: str) -> None:
    code, headers, _ = get(server, path)
    assert code == 401 and headers["WWW-Authenticate"] == 'Basic realm="cvm-tune bundles"'
    assert headers["X-Content-Type-Options"] == "nosniff" and headers["Cache-Control"] == "no-store"
    assert "WWW-Authenticate" not in get(server, "/v1/runs")[1], "the API answers a bearer client, not a browser"


@pytest.mark.parametrize("auth", [basic("wrong-token"), basic(TOKEN + "x"), "Basic !!!", f"Basic {TOKEN}",
                                  basic(TOKEN).lower(), f"Bearer {TOKEN[:-1]}", TOKEN])
def test_a_wrong_token_is_refused(server: BundleServer, auth: str) -> None:
    assert get(server, "/verify", auth)[0] == 401 and get(server, "/v1/runs", auth)[0] == 401


def test_the_page_comes_with_its_own_csp_and_the_security_headers(server: BundleServer) -> None:
    code, headers, body = get(server, "/verify", basic(TOKEN, user=""))
    page = (WEB / "dist" / "verify.html").read_bytes()
    meta = page.decode().split('http-equiv="Content-Security-Policy" content="', 1)[1].split('"', 1)[0]
    assert code == 200 and body == page and headers["Content-Type"] == "text/html; charset=utf-8"
    assert headers["Content-Security-Policy"] == meta + "; frame-ancestors 'none'"
    assert headers["X-Content-Type-Options"] == "nosniff" and headers["Referrer-Policy"] == "no-referrer"
    assert headers["Cache-Control"] == "no-store"
    assert get(server, "/verify", f"Bearer {TOKEN}")[2] == page, "the bearer token works too"
    assert get(server, "/v1/runs", basic(TOKEN))[0] == 200, "and Basic works on the API"


def test_the_run_list_links_each_bundle_with_the_policy(server: BundleServer, demo_bundle: tuple[Path, Path]) -> None:
    code, headers, body = get(server, "/verify/runs", basic(TOKEN))
    run_id = demo_bundle[0].name
    assert code == 200 and headers["Content-Security-Policy"] == "default-src 'none'"
    assert headers["Referrer-Policy"] == "no-referrer" and b"<script" not in body.lower()
    assert f'href="/verify?bundle=/verify/bundles/{run_id}.tar.gz&amp;policy={POLICY}"'.encode() in body


def test_the_policy_is_the_volumes(server: BundleServer, demo_bundle: tuple[Path, Path]) -> None:
    code, headers, body = get(server, POLICY, basic(TOKEN))
    assert code == 200 and body == demo_bundle[1].read_bytes() and headers["X-Content-Type-Options"] == "nosniff"


def test_the_archive_holds_the_listed_files_byte_for_byte(server: BundleServer, demo_bundle: tuple[Path, Path]) -> None:
    bundle = demo_bundle[0]
    code, headers, body = get(server, f"/verify/bundles/{bundle.name}.tar.gz", basic(TOKEN))
    assert code == 200 and headers["Content-Type"] == "application/gzip" and headers["Cache-Control"] == "no-store"
    want = {f"{bundle.name}/{rel}": (bundle / rel).read_bytes() for rel in bundle_files(bundle)}
    assert len(want) > 10 and members(body) == want


@pytest.mark.parametrize("path", ["/verify/bundles/..%2F..%2Fstate.tar.gz", "/verify/bundles/...tar.gz",
                                  "/verify/bundles/%2e%2e.tar.gz", "/verify/bundles/../exports.tar.gz",
                                  "/verify/bundles/nope.tar.gz", "/verify/bundles/RUN", "/verify/bundles/RUN.tar",
                                  "/verify/bundles/RUN.tar.gz/manifest.json", "/verify/../v1/runs",
                                  "/verify/state/runs.sqlite", "/verify/exports/RUN/manifest.json", "/verify/x"])
def test_nothing_else_is_served(server: BundleServer, demo_bundle: tuple[Path, Path], path: str) -> None:
    code, headers, _ = get(server, path.replace("RUN", demo_bundle[0].name), basic(TOKEN))
    assert code == 404 and headers["X-Content-Type-Options"] == "nosniff"


def test_no_symlink_and_no_policy_leave_the_volume(demo_bundle: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(demo_bundle[0].parent.parent, out, symlinks=True)
    bundle = out / "exports" / demo_bundle[0].name
    (tmp_path / "secret").write_text("not in the bundle")
    (bundle / "leak.txt").symlink_to(tmp_path / "secret")
    (bundle / "report" / "leak").symlink_to(tmp_path)
    (out / "simulator-test-policy.yaml").unlink()
    (out / "simulator-test-policy.yaml").symlink_to(demo_bundle[1])
    s = BundleServer(out, token_sha256(TOKEN), host="127.0.0.1", port=0).start()
    try:
        archive = members(get(s, f"/verify/bundles/{bundle.name}.tar.gz", basic(TOKEN))[2])
        assert sorted(archive) == sorted(f"{bundle.name}/{rel}" for rel in bundle_files(bundle))
        assert not any("leak" in name for name in archive)
        assert get(s, POLICY, basic(TOKEN))[0] == 404
        assert b"&amp;policy=" not in get(s, "/verify/runs", basic(TOKEN))[2]
    finally:
        s.stop()


# --- in the browser ---------------------------------------------------------------------------------------------------


@needs_browser
def test_the_served_page_accepts_the_served_bundle(server: BundleServer, demo_bundle: tuple[Path, Path],
                                                   web_copy: Path) -> None:  # noqa: F811
    """One click from the run list: the browser sends the token (here in the URL, as a browser does after the
    prompt) with the page's same-origin fetches, and the page's verdict is ``cvm-tune verify``'s."""
    host, port = server.server_address[:2]
    link = P.verify_url(demo_bundle[0].name, policy=True)
    (page,) = drive(web_copy, [{"url": f"http://user:{quote(TOKEN)}@{host!s}:{port}{link}&now={NOW}"}])
    assert page["body_verdict"] == "accepted", page["errors"]
    py, _ = python_verdict(demo_bundle[0], demo_bundle[1])
    same_checks(page, py, "served by cvm-tune bundles serve")
    assert {urlparse(r).path for r in page["requests"]} == {"/verify", f"/verify/bundles/{demo_bundle[0].name}.tar.gz",
                                                          POLICY}, "the page, the bundle and the policy, nothing else"


# --- shipped with the package -----------------------------------------------------------------------------------------


def test_the_package_carries_the_built_page(tmp_path: Path) -> None:
    """app/service/verify.html is web/dist/verify.html (a link, one source); a wheel built from what the Dockerfile's
    build stage copies (the build context .dockerignore leaves) holds the page itself."""
    assert P.PAGE.resolve() == (WEB / "dist" / "verify.html").resolve()
    assert '"service/verify.html"' in (REPO / "pyproject.toml").read_text()
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    assert ignored.index("!web/dist/verify.html") > ignored.index("web/*"), "the page stays in the build context"
    build = (REPO / "Dockerfile").read_text().split("\nFROM ")[1]
    src = tmp_path / "src"
    for line in re.findall(r"^COPY (?!--from)(.+)$", build, flags=re.M):
        *sources, dest = line.split()
        for rel in sources:
            target = src / dest / (Path(rel).name if dest.endswith("/") and not rel.endswith("/") else "")
            if rel.endswith("/"):
                shutil.copytree(REPO / rel, src / dest, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(REPO / rel, target)
    assert (src / "app" / "service" / "verify.html").is_symlink()
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert wheel.returncode == 0, wheel.stderr[-2000:]
    with zipfile.ZipFile(next((tmp_path / "dist").glob("*.whl"))) as whl:
        assert whl.read("app/service/verify.html") == (WEB / "dist" / "verify.html").read_bytes()
