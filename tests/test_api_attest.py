"""Trust before data: ``cvm-tune api attest`` accepts the training API's own TLS key under the simulator's policy,
and rejects a man in the middle (another certificate in front of the same server) and a policy that does not trust
the simulator's test CA; nothing is written when it rejects."""

from __future__ import annotations

import contextlib
import datetime
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api_drive import Server
from tests.test_api import serving


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(tmp_path_factory.mktemp("api-tls"), tls=True)


def _attest(url: str, policy: Path | None, out: Path) -> tuple[int, str]:
    """``cvm-tune api attest URL [--policy POLICY] --out OUT`` (in this process): (exit code, stdout)."""
    import contextlib
    import io

    from app.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["api", "attest", url, "--out", str(out), *(("--policy", str(policy)) if policy else ())])
    return code, buf.getvalue()


def test_attest_trusts_the_key_the_quote_binds(tls_server: Server, tmp_path: Path) -> None:
    trust = tmp_path / "trust.pem"
    code, out = _attest(tls_server.url, tls_server.out / "simulator-test-policy.yaml", trust)
    assert code == 0 and "trusted: compose-hash" in out, out
    ok = httpx.get(f"{tls_server.url}/api/v1/healthz", verify=ssl.create_default_context(cafile=str(trust)))
    assert ok.json() == {"status": "ok"}
    with pytest.raises(httpx.ConnectError):  # without the attested certificate the SDK's client refuses the server
        httpx.get(f"{tls_server.url}/api/v1/healthz")


def test_attest_rejects_the_default_policy_and_a_bad_nonce(tls_server: Server, tmp_path: Path) -> None:
    trust = tmp_path / "trust.pem"
    code, out = _attest(tls_server.url, None, trust)  # the built-in policy trusts Intel's root, not the simulator's
    assert code == 1 and not trust.exists(), out
    bad = httpx.get(f"{tls_server.url}/api/v1/cvm_tune/attestation", params={"nonce": "zz"}, verify=False)
    assert bad.status_code == 400 and "nonce must be" in bad.json()["detail"]


def test_attest_rejects_a_man_in_the_middle(tls_server: Server, tmp_path: Path) -> None:
    proxy = _Proxy(tls_server.port, tmp_path)
    try:
        trust = tmp_path / "trust.pem"
        code, out = _attest(f"https://127.0.0.1:{proxy.port}", tls_server.out / "simulator-test-policy.yaml", trust)
        assert code == 1 and not trust.exists() and "not the key the server attests" in out, out
        assert "report_data" in out  # the genuine quote binds the server's key, not the one presented here
    finally:
        proxy.close()


class _Proxy:
    """Terminates TLS with a certificate of its own and relays every byte to the real server over TLS."""

    def __init__(self, upstream: int, tmp: Path) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cvm-tune training API")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
                .sign(key, hashes.SHA256()))
        (tmp / "mitm.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
        (tmp / "mitm.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(tmp / "mitm.pem", tmp / "mitm.key")
        self.up = ssl.create_default_context()
        self.up.check_hostname, self.up.verify_mode = False, ssl.CERT_NONE
        self.upstream = upstream
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(raw,), daemon=True).start()

    def _relay(self, raw: socket.socket) -> None:
        """One thread per connection, each TLS socket read and written from it alone (OpenSSL objects are not to
        be shared between threads), polling both sides with a short timeout."""
        try:
            client = self.ctx.wrap_socket(raw, server_side=True)
            server = self.up.wrap_socket(socket.create_connection(("127.0.0.1", self.upstream)))
        except OSError:
            raw.close()
            return
        for s in (client, server):
            s.settimeout(0.1)
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                for a, b in ((client, server), (server, client)):
                    try:
                        data = a.recv(65536)
                    except (TimeoutError, ssl.SSLWantReadError):
                        continue
                    if not data:
                        return
                    b.sendall(data)
        except OSError:
            return
        finally:
            for s in (client, server):
                with contextlib.suppress(OSError):
                    s.close()

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize(("url", "why"), [("https://user@127.0.0.1:8443", "must not carry a user name"),
                                          ("http://203.0.113.5:8443", "plain http is allowed only on loopback"),
                                          ("ftp://127.0.0.1", "must start with https://")])
def test_attest_refuses_a_bad_url_before_connecting(url: str, why: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The project's one URL rule (no user name, https or loopback http): exit 2, nothing written."""
    trust = tmp_path / "trust.pem"
    assert _attest(url, None, trust)[0] == 2 and not trust.exists()
    assert why in capsys.readouterr().err


def test_attest_refuses_a_deeply_nested_document(serve: Any, tmp_path: Path) -> None:
    """An answer nested past the bounded parser's depth is an input error (exit 2), never an internal error."""
    from tests.loopback_http import send

    deep = b"[" * 100_000 + b"]" * 100_000
    server = serve(lambda h, _s: send(h, 200, deep, Content_Type="application/json"))
    trust = tmp_path / "trust.pem"
    assert _attest(server.url, None, trust)[0] == 2 and not trust.exists()


def test_attest_rejects_a_config_id_that_binds_another_compose(serve: Any, tmp_path: Path) -> None:
    """A genuinely signed quote whose MRCONFIGID carries another compose-hash than the event log's (a VMM that booted
    another app-compose) is rejected, as the bundle verifier's ``compose.hash`` step rejects it; nothing is written.
    The same document with the right MRCONFIGID is trusted, so the rejection is the binding's alone."""
    import urllib.parse

    from attestation.compose.app_compose import mr_config_id_v1
    from attestation.policy import policy_file_text, simulator_policy

    from app.api.http.tls import SCHEMA, report_data
    from app.simulator.agent import GuestAgentSimulator
    from tests.loopback_http import send

    sim = GuestAgentSimulator()
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_file_text(simulator_policy(sim.test_root_ca_der)))
    good = sim._body_template

    def answer(h: Any, _s: Any) -> None:
        nonce = bytes.fromhex(urllib.parse.parse_qs(urllib.parse.urlsplit(h.path).query)["nonce"][0])
        q = sim.get_quote(report_data(nonce, b""))
        doc = {"schema": SCHEMA, "nonce": nonce.hex(), "tls_spki_sha256": None, "certificate_pem": None,
               "quote": q["quote"], "event_log": q["event_log"], "app_compose": sim.app_compose,
               "collateral": sim.collateral_json()}
        send(h, 200, json.dumps(doc).encode(), Content_Type="application/json")

    server = serve(answer)
    trust = tmp_path / "trust.pem"
    code, out = _attest(server.url, policy, trust)
    assert code == 0 and "trusted (plain HTTP on loopback" in out, out
    body = bytearray(good)
    body[232:280] = bytes.fromhex(mr_config_id_v1("ab" * 32))
    sim._body_template = bytes(body)
    code, out = _attest(server.url, policy, trust)
    assert code == 1 and "MRCONFIGID v1 does not carry the compose-hash" in out and not trust.exists(), out
    assert "ACCEPTED" in out  # the quote itself verifies: only the compose binding fails


def test_the_server_says_when_a_client_refuses_its_certificate(tls_server: Server) -> None:
    """An SDK without SSL_CERT_FILE retries for minutes without a word; the server names the refusal and the fix."""
    import socket
    import ssl
    import time

    host, port = tls_server.url.removeprefix("https://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with pytest.raises(ssl.SSLCertVerificationError):
            ssl.create_default_context().wrap_socket(raw, server_hostname=host)  # the system's roots: not trusted
    deadline = time.monotonic() + 20
    while "refused this server's certificate" not in tls_server.log.read_text():
        assert time.monotonic() < deadline, tls_server.log.read_text()[-2000:]
        time.sleep(0.1)
    line = next(x for x in tls_server.log.read_text().splitlines() if "refused this server's certificate" in x)
    assert "cvm-tune api attest https://127.0.0.1:" in line and "SSL_CERT_FILE" in line


def test_attest_checks_a_v3_config_id_against_its_document(serve: Any, tmp_path: Path) -> None:
    """dstack 0.6 sets MRCONFIGID v3 when the app-compose names a ``key_provider_id``: the document's ``vm_config``
    carries the MrConfigV3 document it is the hash of, and attest checks it against the measured boot events as
    ``verify-quote`` does; without the document (or with another one) nothing binds the compose-hash: rejected."""
    import urllib.parse

    from attestation.policy import policy_file_text, simulator_policy

    from app.api.http.tls import SCHEMA, report_data
    from app.simulator import SimulatorSettings
    from app.simulator.agent import GuestAgentSimulator
    from tests.loopback_http import send

    compose = json.loads(GuestAgentSimulator().app_compose)
    kms_id = json.loads(GuestAgentSimulator().key_provider_info)["id"]
    sim = GuestAgentSimulator(SimulatorSettings(app_compose=json.dumps({**compose, "key_provider_id": kms_id})))
    assert sim.mr_config is not None
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_file_text(simulator_policy(sim.test_root_ca_der)))
    vm_config: list[Any] = [None]

    def answer(h: Any, _s: Any) -> None:
        nonce = bytes.fromhex(urllib.parse.parse_qs(urllib.parse.urlsplit(h.path).query)["nonce"][0])
        q = sim.get_quote(report_data(nonce, b""))
        doc = {"schema": SCHEMA, "nonce": nonce.hex(), "tls_spki_sha256": None, "certificate_pem": None,
               "quote": q["quote"], "event_log": q["event_log"], "app_compose": sim.app_compose,
               "collateral": sim.collateral_json(), **({"vm_config": vm_config[0]} if vm_config[0] else {})}
        send(h, 200, json.dumps(doc).encode(), Content_Type="application/json")

    server = serve(answer)
    trust = tmp_path / "trust.pem"
    vm_config[0] = sim.vm_config
    code, out = _attest(server.url, policy, trust)
    assert code == 0 and "trusted (plain HTTP on loopback" in out, out
    trust.unlink(missing_ok=True)
    vm_config[0] = None
    code, out = _attest(server.url, policy, trust)
    assert code == 1 and "MRCONFIGID v3 binds a MrConfigV3 document and none was given" in out and not trust.exists(), out
    vm_config[0] = json.dumps({**json.loads(sim.vm_config), "mr_config": sim.mr_config.replace('"kms"', '"none"')})
    code, out = _attest(server.url, policy, trust)
    assert code == 1 and "MRCONFIGID v3 is not SHA-256" in out and not trust.exists(), out


def test_the_servers_own_document_carries_the_v3_config_and_attest_trusts_it(sock_dir: Path, tmp_path: Path) -> None:
    """Under a dstack 0.6 agent whose app-compose names a key provider, the server's attestation document carries
    the MrConfigV3 document (``mr_config``) its quote's MRCONFIGID v3 is the hash of: ``api attest``'s check binds
    the compose-hash with it."""
    from types import SimpleNamespace

    from attestation.compose.app_compose import check_mr_config_id

    from app.api.http.attest import _mr_config
    from app.api.http.tls import attestation
    from app.config import TeeSettings
    from app.simulator import SimulatorServer, SimulatorSettings
    from app.simulator.agent import GuestAgentSimulator
    from app.tee import open_guest_agent
    from attestation.policy import simulator_policy
    from attestation.tdx.inputs import event_log_from_json
    from attestation.verify import quote_verdict

    compose = json.loads(GuestAgentSimulator().app_compose)
    kms_id = json.loads(GuestAgentSimulator().key_provider_info)["id"]
    sim = GuestAgentSimulator(SimulatorSettings(app_compose=json.dumps({**compose, "key_provider_id": kms_id})))
    with SimulatorServer(sim, socket_path=sock_dir / "a.sock") as srv, \
            open_guest_agent(TeeSettings(mode="dstack", endpoint=srv.endpoint)) as agent:
        doc = attestation(SimpleNamespace(agent=agent, ident=agent.identity()), None, "ab" * 16, lambda _q: None)
    assert doc["mr_config"] == sim.mr_config
    events = event_log_from_json(doc["event_log"], source="attestation event_log")
    found = quote_verdict(bytes.fromhex(doc["quote"]), policy=simulator_policy(sim.test_root_ca_der),
                          now=int(time.time()), collateral=None, events=events).findings
    assert found.quote is not None and found.boot is not None and found.quote.td.mr_config_id[0] == 3  # v3
    boot = found.boot
    bound, how = check_mr_config_id(found.quote.td.mr_config_id, boot.hex("compose-hash"), boot.hex("app-id"),
                                    boot.values.get("key-provider"), boot=boot, mr_config=_mr_config(doc))
    assert bound, how
    assert not check_mr_config_id(found.quote.td.mr_config_id, boot.hex("compose-hash"), boot.hex("app-id"),
                                  boot.values.get("key-provider"), boot=boot, mr_config=None)[0]  # it needs it
