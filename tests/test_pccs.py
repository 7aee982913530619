"""`cvm-tune collateral` against a loopback PCCS serving REAL stored collateral (never the internet).

The server answers the paths dcap-qvl's ``get_collateral`` asks a PCCS (pckcrl, tcb, qe/identity,
rootcacrl) with the pieces of ``dstack_nearmpc_collateral.json``, in the PCCS wire format (DER CRL,
hex root CRL, ``{"tcbInfo": ..., "signature": ...}`` bodies, URL-encoded issuer-chain headers).
Fetching must give back exactly the stored collateral, which then verifies the quote.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote as urlquote

import pytest

from attestation import parse_collateral
from attestation.errors import QuoteParseError
from attestation.tdx.pccs import PccsError, fetch_collateral

from app.cli import main

from .conftest_data import TESTDATA

QUOTE = TESTDATA / "dstack_nearmpc_quote.bin"
STORED = json.loads((TESTDATA / "dstack_nearmpc_collateral.json").read_text())
NOW = "1787894484"
PATHS = {
    "/sgx/certification/v4/pckcrl?ca=platform&encoding=der",
    "/tdx/certification/v4/tcb?fmspc=B0C06F000000",
    "/tdx/certification/v4/qe/identity?update=standard",
    "/sgx/certification/v4/rootcacrl",
}


def pccs_routes(chain_newline: str = "\n", wrapper_indent: bool = False) -> dict[str, tuple[int, dict, bytes]]:
    def chain(key: str) -> str:
        return urlquote(STORED[key].replace("\n", chain_newline))

    def signed(member: str, raw: str, sig: str) -> bytes:
        if wrapper_indent:  # a pretty-printed wrapper: the inner object must still come out byte-exact
            return f'{{\n  "{member}" : {raw} ,\n  "signature": "{sig.upper()}"\n}}\n'.encode()
        return f'{{"{member}":{raw},"signature":"{sig}"}}'.encode()

    return {
        "/sgx/certification/v4/pckcrl?ca=platform&encoding=der": (
            200, {"SGX-PCK-CRL-Issuer-Chain": chain("pck_crl_issuer_chain")}, bytes.fromhex(STORED["pck_crl"])),
        "/tdx/certification/v4/tcb?fmspc=B0C06F000000": (
            200, {"TCB-Info-Issuer-Chain": chain("tcb_info_issuer_chain")},
            signed("tcbInfo", STORED["tcb_info"], STORED["tcb_info_signature"])),
        "/tdx/certification/v4/qe/identity?update=standard": (
            200, {"SGX-Enclave-Identity-Issuer-Chain": chain("qe_identity_issuer_chain")},
            signed("enclaveIdentity", STORED["qe_identity"], STORED["qe_identity_signature"])),
        "/sgx/certification/v4/rootcacrl": (200, {}, STORED["root_ca_crl"].encode()),
    }


class FakePccs:
    """A loopback PCCS: ``routes`` by path+query, optional failures and delay; records every request."""

    def __init__(self) -> None:
        self.routes = pccs_routes()
        self.fail_first = 0
        self.fail_status = 503
        self.delay = 0.0
        self.requests: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                owner.requests.append(self.path)
                time.sleep(owner.delay)
                if owner.fail_first > 0:
                    owner.fail_first -= 1
                    status, headers, body = owner.fail_status, {}, b"busy"
                else:
                    status, headers, body = owner.routes.get(self.path, (404, {}, b"not found"))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def pccs() -> Iterator[FakePccs]:
    server = FakePccs()
    try:
        yield server
    finally:
        server.close()


def test_fetch_returns_exactly_the_stored_collateral_from_dcap_qvls_paths(pccs: FakePccs) -> None:
    text = fetch_collateral(QUOTE.read_bytes(), pccs_url=pccs.url)
    assert json.loads(text) == STORED
    assert set(pccs.requests) == PATHS and len(pccs.requests) == 4


def test_collateral_command_then_verify_quote(pccs: FakePccs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "collateral.json"
    assert main(["collateral", str(QUOTE), "-o", str(out), "--pccs", pccs.url + "/tdx/certification/v4/"]) == 0
    assert "FMSPC B0C06F000000" in capsys.readouterr().out
    assert main(["verify-quote", str(QUOTE), "--collateral", str(out), "--now", NOW, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "accepted" and doc["tcb_status"] == "UpToDate"


def test_pem_whitespace_and_pretty_json_from_the_pccs_are_normalised(pccs: FakePccs) -> None:
    pccs.routes = pccs_routes(chain_newline="\r\n", wrapper_indent=True)
    coll = json.loads(fetch_collateral(QUOTE.read_bytes(), pccs_url=pccs.url))
    assert coll == STORED  # canonical PEM; tcbInfo / enclaveIdentity byte-exact; signature lower-case


def test_transient_errors_are_retried(pccs: FakePccs) -> None:
    pccs.fail_first = 2
    text = fetch_collateral(QUOTE.read_bytes(), pccs_url=pccs.url, retries=3, backoff=0)
    assert parse_collateral(text).not_before == 1786617938
    assert len(pccs.requests) == 6


def test_persistent_server_error_is_exit_2_after_bounded_retries(pccs: FakePccs, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    pccs.fail_first, pccs.fail_status = 100, 500
    assert main(["collateral", str(QUOTE), "-o", str(tmp_path / "c.json"), "--pccs", pccs.url, "--retries", "1"]) == 2
    err = capsys.readouterr().err
    assert "answered HTTP 500" in err and "pckcrl" in err and "fix: " in err and "Traceback" not in err
    assert len(pccs.requests) == 2 and not (tmp_path / "c.json").exists()


def test_not_found_is_not_retried(pccs: FakePccs) -> None:
    del pccs.routes["/tdx/certification/v4/tcb?fmspc=B0C06F000000"]
    with pytest.raises(PccsError, match=r"tcb\?fmspc=B0C06F000000 answered HTTP 404"):
        fetch_collateral(QUOTE.read_bytes(), pccs_url=pccs.url, retries=3, backoff=0)
    assert len(pccs.requests) == 2


def test_timeout_is_bounded(pccs: FakePccs) -> None:
    pccs.delay = 1.0
    start = time.monotonic()
    with pytest.raises(PccsError, match="cannot fetch"):
        fetch_collateral(QUOTE.read_bytes(), pccs_url=pccs.url, timeout=0.2, retries=1, backoff=0)
    assert time.monotonic() - start < 3


def test_unreachable_pccs_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = main(["collateral", str(QUOTE), "-o", str(tmp_path / "c.json"), "--pccs", f"http://127.0.0.1:{port}",
               "--retries", "0", "--timeout", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot fetch" in err and "ConnectionError" in err


@pytest.mark.parametrize(
    ("path", "answer", "words"),
    [
        ("/tdx/certification/v4/tcb?fmspc=B0C06F000000", (200, {}, b"{}"), "TCB-Info-Issuer-Chain header"),
        ("/tdx/certification/v4/qe/identity?update=standard", None, "'enclaveIdentity'"),
        ("/sgx/certification/v4/pckcrl?ca=platform&encoding=der", None, "did not answer a DER CRL"),
        ("/sgx/certification/v4/rootcacrl", (200, {}, b"zz"), "did not answer a DER CRL"),
        ("/sgx/certification/v4/rootcacrl", (200, {}, b"0" * (2 << 20)), "more than"),
    ],
)
def test_answers_that_are_not_collateral_are_errors(pccs: FakePccs, path: str, answer: tuple | None, words: str) -> None:
    status, headers, body = pccs.routes[path]
    pccs.routes[path] = answer or (status, headers, b"not the expected body")
    with pytest.raises(PccsError, match=words):
        fetch_collateral(QUOTE.read_bytes(), pccs_url=pccs.url, retries=0)


def test_bad_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(QuoteParseError):
        fetch_collateral(b"\x04\x00" * 10, pccs_url="http://127.0.0.1:9")
    assert main(["collateral", str(QUOTE), "-o", str(tmp_path / "c.json"), "--pccs", "ftp://x"]) == 2
    assert "not an http(s) URL" in capsys.readouterr().err
    assert main(["collateral", str(QUOTE), "-o", str(tmp_path / "c.json"), "--timeout", "0"]) == 2
    assert "timeout must be > 0" in capsys.readouterr().err


def test_unwritable_output_is_exit_2(pccs: FakePccs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "no" / "such" / "c.json"
    assert main(["collateral", str(QUOTE), "-o", str(out), "--pccs", pccs.url]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {out}" in err and "fix: choose a writable output path" in err and not out.exists()


def test_verifier_import_stays_offline() -> None:
    """`import attestation` (what verify / verify-quote use) does not load the networked module."""
    import subprocess
    import sys

    code = "import sys, attestation, attestation.verify; print(sorted(m for m in ('requests', 'attestation.tdx.pccs') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert res.stdout.strip() == "[]"


def _dstack_agent(monkeypatch: pytest.MonkeyPatch) -> object:
    from types import SimpleNamespace

    from app.tee import GuestAgent

    agent = GuestAgent(None, endpoint="/nonexistent.sock", mode="dstack")  # type: ignore[arg-type]
    monkeypatch.setattr(agent, "identity", lambda: SimpleNamespace(is_cvm_tune_simulator=False))
    return agent


def test_the_guest_agents_collateral_goes_through_the_edge_and_a_failure_is_raised(
        pccs: FakePccs, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's collateral comes from the same fetch as `cvm-tune collateral`; when the PCCS fails, the caller gets a
    PccsError to report (it says so and exports without collateral), never a silent None."""
    agent = _dstack_agent(monkeypatch)
    assert json.loads(agent.collateral(QUOTE.read_bytes(), pccs_url=pccs.url, timeout_s=10)) == STORED
    pccs.fail_first, pccs.fail_status = 100, 503
    started = time.monotonic()
    with pytest.raises(PccsError, match="answered HTTP 503"):
        agent.collateral(QUOTE.read_bytes(), pccs_url=pccs.url, timeout_s=3)
    assert time.monotonic() - started < 6


def test_a_bundle_without_collateral_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """The export and round bundles get (collateral, why missing): a failed fetch is a reason, never swallowed."""
    from app.tee import GuestAgent
    from attestation.errors import CollateralError

    agent = GuestAgent.__new__(GuestAgent)  # no guest agent needed: only the collateral fetch is exercised
    calls: list[str] = []

    def failing(self: GuestAgent, quote: bytes, *, pccs_url: str, timeout_s: float) -> str:
        calls.append(pccs_url)
        raise CollateralError("PCCS answered 503 three times")

    monkeypatch.setattr(GuestAgent, "collateral", failing)
    assert agent.bundle_collateral(b"q", mode="none", pccs_url="https://pccs.example", timeout_s=1) == (
        None, "tee.collateral is 'none'") and calls == []
    coll, why = agent.bundle_collateral(b"q", mode="auto", pccs_url="https://pccs.example", timeout_s=1)
    assert coll is None and why == "fetching it from https://pccs.example failed: PCCS answered 503 three times"
    monkeypatch.setattr(GuestAgent, "collateral", lambda self, quote, **_k: "{}")
    assert agent.bundle_collateral(b"q", mode="auto", pccs_url="https://pccs.example", timeout_s=1) == ("{}", "")
