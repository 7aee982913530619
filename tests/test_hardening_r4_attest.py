"""`cvm-tune api attest` against servers that answer in other ways than uvicorn does: `Connection: close` and
HTTP/1.0 answers are read as any other; the whole exchange runs under one deadline (a body dripped a byte at a time
is cut off there); an answer over the document limit is "too large"; the SSL_CERT_FILE hint names the trust file by
its absolute path. Each server is a loopback TLS server of this test, presenting a certificate of its own that the
simulator's quote binds."""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import ssl
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.api.http.attest import MAX_DOC
from app.errors import ConfigError

Route = Callable[[Any, Any], None]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A self-signed ECDSA certificate for 127.0.0.1, its server context and the SHA-256 of its key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from app.api.http.tls import spki_sha256

    tmp = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cvm-tune training API")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
    (tmp / "cert.pem").write_bytes(pem)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp / "cert.pem", tmp / "key.pem")
    return {"ctx": ctx, "spki": spki_sha256(pem)}


@pytest.fixture(scope="module")
def sim() -> Any:
    from app.simulator.agent import GuestAgentSimulator

    return GuestAgentSimulator()


@pytest.fixture
def policy(sim: Any, tmp_path: Path) -> Path:
    from attestation.policy import policy_file_text, simulator_policy

    path = tmp_path / "policy.yaml"
    path.write_text(policy_file_text(simulator_policy(sim.test_root_ca_der)))
    return path


def _document(sim: Any, tls: dict[str, Any], path: str) -> bytes:
    """The attestation document a training API would answer, its quote binding ``tls``'s key and the nonce."""
    from app.api.http.tls import SCHEMA, report_data

    nonce = bytes.fromhex(urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)["nonce"][0])
    q = sim.get_quote(report_data(nonce, tls["spki"]))
    return json.dumps({"schema": SCHEMA, "nonce": nonce.hex(), "tls_spki_sha256": tls["spki"].hex(),
                       "certificate_pem": None, "quote": q["quote"], "event_log": q["event_log"],
                       "app_compose": sim.app_compose, "collateral": sim.collateral_json()}).encode()


def _raw(h: Any, head: bytes, body: bytes) -> None:
    """Write an answer byte for byte, then close the connection."""
    h.close_connection = True
    h.wfile.write(head + b"\r\n\r\n" + body)
    h.wfile.flush()


def _attest(url: str, policy: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from app.cli import main

    code = main(["api", "attest", url, "--out", str(out), "--policy", str(policy)])
    out_text, err = capsys.readouterr()
    assert "Traceback" not in err and "internal error" not in err, err
    return code, out_text, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("style", ["connection-close", "http/1.0", "http/1.0-no-length"])
def test_a_connection_close_or_http10_answer_is_trusted(serve: Any, tls: dict[str, Any], sim: Any, policy: Path,
                                                        tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        style: str) -> None:
    def answer(h: Any, _stop: Any) -> None:
        body = _document(sim, tls, h.path)
        length = b"" if style.endswith("no-length") else b"\r\nContent-Length: %d" % len(body)
        status = b"HTTP/1.1 200 OK" if style == "connection-close" else b"HTTP/1.0 200 OK"
        _raw(h, status + b"\r\nContent-Type: application/json\r\nConnection: close" + length, body)

    server = serve(answer, tls["ctx"])
    trust = tmp_path / "trust.pem"
    code, out, _ = _attest(server.url, policy, trust, capsys)
    assert code == 0 and "trusted: compose-hash" in out and trust.is_file(), out


def test_the_ssl_cert_file_hint_is_an_absolute_path(serve: Any, tls: dict[str, Any], sim: Any, policy: Path,
                                                    tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.loopback_http import send

    server = serve(lambda h, _s: send(h, 200, _document(sim, tls, h.path), Content_Type="application/json"),
                   tls["ctx"])
    monkeypatch.chdir(tmp_path)
    code, out, _ = _attest(server.url, policy, Path("trust.pem"), capsys)
    assert code == 0, out
    assert f"export SSL_CERT_FILE={tmp_path / 'trust.pem'} " in out, out


@pytest.mark.timeout(60)
def test_a_dripped_body_stops_at_the_overall_deadline(serve: Any, tls: dict[str, Any], sim: Any, policy: Path,
                                                      tmp_path: Path) -> None:
    from app.api.http.attest import attest

    def drip(h: Any, stop: Any) -> None:
        body = _document(sim, tls, h.path)
        h.close_connection = True
        h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        for byte in body[:40]:  # a byte every 0.3 s: each read's own timeout never passes
            if stop.wait(0.3):
                return
            h.wfile.write(bytes([byte]))
            h.wfile.flush()

    server = serve(drip, tls["ctx"])
    trust = tmp_path / "trust.pem"
    start = time.monotonic()
    with pytest.raises(ConfigError, match="did not finish within 2 s") as exc:
        attest(server.url, policy_file=policy, out=trust, timeout=2.0)
    assert time.monotonic() - start < 4, "the exchange must stop at its deadline"
    assert exc.value.fix and not trust.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("length", [True, False], ids=["content-length", "until-close"])
def test_an_answer_over_the_limit_is_too_large(serve: Any, tls: dict[str, Any], tmp_path: Path, policy: Path,
                                               capsys: pytest.CaptureFixture[str], length: bool) -> None:
    big = b" " * (9 << 20)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close"
    server = serve(lambda h, _s: _raw(h, head + (b"\r\nContent-Length: %d" % len(big) if length else b""), big),
                   tls["ctx"])
    trust = tmp_path / "trust.pem"
    code, _, err = _attest(server.url, policy, trust, capsys)
    assert code == 2 and not trust.exists()
    assert "too large" in err and f"more than {MAX_DOC} bytes" in err and "HTTP 200" not in err, err
