"""What cvm-tune does when the other end of a URL is hostile: the bundle client (`bundles list`/`fetch`) against a
server that redirects, answers garbage or never stops; the dataset URL source against userinfo tricks, redirects to
plain http, a server that drips bytes, and a disk that fills up. Every server here is a loopback server started by
the test; every request loop is bounded."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.errors import ConfigError, DataError, StateError
from tests.loopback_http import Route, Server, send
from tests.netguard import guard

TOKEN = "t0ken-for-tests"
def _json(h: BaseHTTPRequestHandler, doc: Any) -> None:
    send(h, 200, json.dumps(doc).encode(), Content_Type="application/json")


def _token_file(tmp_path: Path) -> Path:
    path = tmp_path / "bundles.token"
    path.write_text(TOKEN + "\n")
    return path


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    from app.cli import main

    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


# ---------------------------------------------------------------- bundles list / fetch


def test_the_bundle_token_never_follows_a_redirect(serve: Callable[[Route], Server], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A 302 to another origin: refused, and the other origin sees no request at all (so never the token)."""
    elsewhere = serve(lambda h, _s: _json(h, []))
    redirector = serve(lambda h, _s: send(h, 302, Location=elsewhere.url + h.path))
    with pytest.raises(StateError, match="redirected"):
        from app.service.bundles import list_runs

        list_runs(redirector.url, TOKEN)
    code, err = _cli(capsys, "bundles", "fetch", redirector.url, "run-1", "--token-file", str(_token_file(tmp_path)),
                     "-o", str(tmp_path / "out"))
    assert code == 7 and "redirected (HTTP 302)" in err and "never sent to another address" in err
    assert elsewhere.seen == [] and len(redirector.seen) == 2
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("url", ["http://127.0.0.1:80@example.com/", "http://example.com/", "ftp://127.0.0.1/",
                                 "https://user:pw@gateway.example/"])
def test_the_bundle_client_refuses_urls_that_would_contact_another_host(url: str, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with guard() as attempts:
        code, err = _cli(capsys, "bundles", "list", url, "--token-file", str(_token_file(tmp_path)))
    assert code == 2 and "error: the bundle server URL" in err and attempts == []


@pytest.mark.parametrize(("runs", "listing", "want"), [
    (b"<html>not json</html>", None, "run list is not valid JSON"),
    (b'{"runs": []}', None, "run list is not a list"),
    (b'[{"run_id": 5, "status": "exported"}]', None, "without a valid run_id"),
    (b'[{"run_id": "../../etc"}]', None, "without a valid run_id"),
    (None, b'["manifest.json"]', "bundle listing has no files map"),
    (None, b'{"files": {"7": 1, "ok": "x"}}', "size that is not an integer"),
    (None, b'{"files": {"a\\u0000b": 1}}', "unsafe path 'a\\x00b'"),
    (None, b'{"files": {"../escape": 1}}', "unsafe path"),
    (None, b'{"files": {"/etc/passwd": 1}}', "unsafe path"),
    (None, b'{"files": {"a\\\\..\\\\b": 1}}', "unsafe path"),
    (None, b'{"files": {"manifest.json": 4}}', "longer than the 4 bytes it listed"),
    (None, b'{"files": {"manifest.json": 400}}', "ended after 10 of the 400 bytes"),
    (None, b'{"files": {"a": ' + b"9" * 5000 + b'}}', "not valid JSON"),  # an integer too long to convert
    (None, b'{"files": {"a": 1e999}}', "size that is not an integer"),
])
def test_the_bundle_client_refuses_malformed_answers_and_writes_nothing(
        serve: Callable[[Route], Server], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        runs: bytes | None, listing: bytes | None, want: str) -> None:
    def route(h: BaseHTTPRequestHandler, _s: threading.Event) -> None:
        if h.path == "/v1/runs":
            send(h, 200, runs or b"[]")
        elif h.path == "/v1/bundles/run-1":
            send(h, 200, listing or b"{}")
        else:
            send(h, 200, b"0123456789")  # every file: 10 bytes

    server = serve(route)
    token, out = str(_token_file(tmp_path)), tmp_path / "out"
    out.mkdir()
    argv = ("bundles", "list", server.url, "--token-file", token) if runs else \
        ("bundles", "fetch", server.url, "run-1", "--token-file", token, "-o", str(out))
    code, err = _cli(capsys, *argv)
    assert code == 7 and want in err, err
    assert list(out.iterdir()) == []


def test_an_endless_answer_is_read_only_up_to_the_bound(serve: Callable[[Route], Server], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from app.service.bundles import MAX_ANSWER_BYTES

    def endless(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.end_headers()  # no length: the body ends when the connection does
        h.wfile.write(b"[" + b" " * 65536)
        for _ in range(4 * MAX_ANSWER_BYTES // 65536):  # bounded: 4x the client's limit
            if stop.is_set():
                return
            h.wfile.write(b" " * 65536)

    server = serve(endless)
    started = time.monotonic()
    code, err = _cli(capsys, "bundles", "list", server.url, "--token-file", str(_token_file(tmp_path)))
    assert code == 7 and f"run list is larger than {MAX_ANSWER_BYTES} bytes" in err
    assert time.monotonic() - started < 30


def test_a_bundle_is_fetched_whole_and_a_bad_token_file_is_an_input_error(serve: Callable[[Route], Server],
                                                                        tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    files = {"manifest.json": b"{}", "adapter/adapter_model.safetensors": b"x" * 3000}

    def route(h: BaseHTTPRequestHandler, _s: threading.Event) -> None:
        if h.headers.get("Authorization") != f"Bearer {TOKEN}":
            return send(h, 401)
        if h.path == "/v1/bundles/run-1":
            return _json(h, {"run_id": "run-1", "files": {k: len(v) for k, v in files.items()}})
        send(h, 200, files[h.path.removeprefix("/v1/bundles/run-1/").replace("%2F", "/")])

    server = serve(route)
    code, _ = _cli(capsys, "bundles", "fetch", server.url, "run-1", "--token-file", str(_token_file(tmp_path)),
                   "-o", str(tmp_path))
    assert code == 0
    assert {p.relative_to(tmp_path / "run-1").as_posix(): p.read_bytes()
            for p in (tmp_path / "run-1").rglob("*") if p.is_file()} == files
    bad = tmp_path / "bad.token"
    bad.write_bytes(b"\xff\xfe not ascii")
    code, err = _cli(capsys, "bundles", "list", server.url, "--token-file", str(bad))
    assert code == 2 and "cannot read a token" in err


# ---------------------------------------------------------------- dataset.url


def _dataset(url: str) -> dict[str, Any]:
    return {"source": "url", "url": url, "dataset_id": "tickets", "owner_public_key": "ab" * 32,
            "key": {"source": "file", "file": "/nonexistent.key"}}


REFUSED_URLS = [
    "http://127.0.0.1:80@example.com/tickets.cvmds",  # contacts example.com
    "http://localhost:80@example.com/x", "http://[::1]@example.com/x", "https://owner:secret@owner.example/x",
    "http://example.com/x", "http://127.0.0.1.example.com/x", "http://127.0.0.1:99999/x", "file:///etc/passwd",
    "https://owner.example/a b", "https://owner.example\\@evil.example/x", "https://ownér.example/x", "https:///x",
]


def test_dataset_url_must_contact_the_host_it_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Parsed once (urllib.parse), the host that will be contacted checked: https, or http on loopback; no
    userinfo, which would make http://127.0.0.1:80@example.com/ contact example.com."""
    from app.config import DatasetSettings, load_config

    for i, url in enumerate(REFUSED_URLS):
        path = tmp_path / f"c{i}.yaml"
        path.write_text(yaml.safe_dump({"dataset": _dataset(url)}))
        with pytest.raises(ConfigError, match="dataset.url"):
            load_config(path)
        code, err = _cli(capsys, "validate-config", str(path))
        assert code == 2 and "dataset.url" in err, url
    for url in ("https://owner.example/tickets/current.cvmds", "http://127.0.0.1:8080/x", "http://localhost/x",
                "http://[::1]:9/x?v=1"):
        assert DatasetSettings.model_validate(_dataset(url)).url == url


def _download(url: str, inbox: Path, **kw: Any) -> Path:
    from app.dataset.sources import download

    inbox.mkdir(parents=True, exist_ok=True)
    args = {"dataset_id": "tickets", "owner_public_key": b"\0" * 32, "timeout_s": 5.0, "retries": 0,
            "backoff_s": 0.0, "max_bytes": 1 << 20, **kw}
    return download(url, inbox, **args)


def test_a_redirect_to_plain_http_elsewhere_is_not_followed(serve: Callable[[Route], Server], tmp_path: Path) -> None:
    server = serve(lambda h, _s: send(h, 302, Location="http://example.com/tickets.cvmds"))
    with guard(allow_loopback=True) as attempts, pytest.raises(DataError, match="plain http is allowed only on loopback"):
        _download(server.url + "/current.cvmds", tmp_path / "inbox")
    assert attempts == [] and len(server.seen) == 1
    assert list((tmp_path / "inbox").iterdir()) == []


def _drip_body(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
    h.send_response(200)
    h.send_header("Content-Length", "100000")
    h.send_header("ETag", '"v1"')
    h.end_headers()
    for _ in range(600):  # one byte every 0.05 s: each read's timeout restarts, the download never ends
        if stop.wait(0.05):
            return
        h.wfile.write(b"x")
        h.wfile.flush()


def _drip_headers(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
    for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"y" * 600:
        if stop.wait(0.05):
            return
        h.wfile.write(bytes([byte]))
        h.wfile.flush()


@pytest.mark.parametrize("drip", [_drip_body, _drip_headers])
def test_a_dripping_server_is_cut_off_at_the_deadline(serve: Callable[[Route], Server], tmp_path: Path,
                                                      drip: Route) -> None:
    server = serve(drip)
    started = time.monotonic()
    with pytest.raises(DataError, match=r"did not finish within dataset.download.deadline_s \(1.5 s"):
        _download(server.url + "/current.cvmds", tmp_path / "inbox", deadline_s=1.5, retries=3, backoff_s=0.1)
    assert 1.4 < time.monotonic() - started < 6
    assert not list((tmp_path / "inbox").glob("*.cvmds"))


def test_the_deadline_is_a_download_setting() -> None:
    from app.config import DownloadSettings

    assert DownloadSettings().deadline_s == 7200.0
    assert DownloadSettings(deadline_s=5).deadline_s == 5.0
    with pytest.raises(ValueError):
        DownloadSettings(deadline_s=0)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) to fail a write with ENOSPC")
def test_a_full_disk_while_downloading_is_a_state_error_and_leaves_no_partial_file(
        serve: Callable[[Route], Server], tmp_path: Path) -> None:
    from app.dataset.sources import PART, PART_META

    body = b"z" * 200_000
    server = serve(lambda h, _s: send(h, 200, body, ETag='"v1"'))
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / PART).symlink_to("/dev/full")  # every write to the partial download fails with ENOSPC
    with pytest.raises(StateError, match="cannot write the dataset download") as info:
        _download(server.url + "/current.cvmds", inbox)
    assert info.value.exit_code == 7
    assert not (inbox / PART).exists() and not (inbox / PART).is_symlink() and not (inbox / PART_META).exists()
    assert list(inbox.iterdir()) == []


# ---------------------------------------------------------------- the one HTTP edge, seen from each caller


def test_the_bundle_client_retries_a_busy_server_then_fetches(serve: Callable[[Route], Server],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import app.service.bundles as bundles

    monkeypatch.setattr(bundles, "BACKOFF_S", 0.01)
    answers = iter([(503, b"busy"), (429, b"slow down")])
    server = serve(lambda h, _s: send(h, *next(answers, (200, b'[{"run_id": "run-1"}]')), Retry_After="0"))
    assert [r["run_id"] for r in bundles.list_runs(server.url, TOKEN)] == ["run-1"]
    assert len(server.seen) == 3 and {h.get("Authorization") for _m, _p, h in server.seen} == {f"Bearer {TOKEN}"}
    down = serve(lambda h, _s: send(h, 503, b"busy"))
    with pytest.raises(StateError, match=r"HTTP 503 \(after 3 attempts\)"):
        bundles.list_runs(down.url, TOKEN)
    assert len(down.seen) == bundles.RETRIES + 1


def test_an_alert_is_never_redirected_nor_sent_over_plain_http_elsewhere(serve: Callable[[Route], Server],
                                                                        tmp_path: Path) -> None:
    from app import alerts
    from app.config import AlertSettings

    elsewhere = serve(lambda h, _s: send(h, 200))
    redirector = serve(lambda h, _s: send(h, 307, Location=elsewhere.url + "/hook"))
    settings = AlertSettings(retries=2)
    assert not alerts.send(settings, {"event": "failed"}, output=tmp_path, env={"CVM_TUNE_ALERT_WEBHOOK":
                                                                                redirector.url + "/hook"})
    assert len(redirector.seen) == 1 and elsewhere.seen == []
    with guard() as attempts:
        assert not alerts.send(settings, {"event": "failed"}, output=tmp_path,
                               env={"CVM_TUNE_ALERT_WEBHOOK": "http://alerts.example/hook?token=x"})
    assert attempts == []


def test_the_dataset_download_honours_retry_after_within_its_cap(serve: Callable[[Route], Server],
                                                                 tmp_path: Path) -> None:
    server = serve(lambda h, _s: send(h, 503, b"busy", Retry_After="86400"))
    waits: list[float] = []
    with pytest.raises(DataError, match=r"after 3 attempt\(s\): HTTP 503"):
        _download(server.url + "/current.cvmds", tmp_path / "inbox", retries=2, backoff_s=1.0, sleep=waits.append)
    from app.dataset.sources import MAX_BACKOFF_S

    assert waits == [MAX_BACKOFF_S, MAX_BACKOFF_S] and len(server.seen) == 3
    assert list((tmp_path / "inbox").iterdir()) == []
