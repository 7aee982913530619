"""The embedded dstack guest-agent simulator in its 0.5 mode (dstack 0.5.11), exercised through the real ``dstack_sdk``
client. The 0.6 mode (the default) is tested in ``test_dstack06_sim.py``.

Everything a verifier relies on is recomputed here rather than trusted: RTMR replay recomputes
v1 runtime digests from payloads, quotes go through dcap-qvl with the simulator's test root, and
GetKey signature chains are checked by public-key recovery.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator

import dcap_qvl
import dstack_sdk
import httpx
import pytest
from eth_keys import keys as eth_keys
from eth_utils import keccak

from app.simulator import DEFAULT_TEST_SECRET, GuestAgentSimulator, SimulatorServer, SimulatorSettings
from app.simulator.server import MAX_SOCKET_PATH

RUNTIME = 0x08000001
NOW = 1_800_000_000


S05 = SimulatorSettings(dstack="0.5")


@pytest.fixture
def simulator(sock_dir, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimulatorServer]:
    """The conftest fixture's simulator, as dstack 0.5."""
    server = SimulatorServer(GuestAgentSimulator(S05), socket_path=sock_dir / "dstack.sock").start()
    monkeypatch.setenv("DSTACK_SIMULATOR_ENDPOINT", server.endpoint)
    try:
        yield server
    finally:
        server.stop()


# ----------------------------------------------------------------------------- helpers
def replay(events: list[dict]) -> list[bytes]:
    """RTMR0-3 from an event log; RTMR3 digests are recomputed from name and payload (v1)."""
    mrs = [bytes(48)] * 4
    for ev in events:
        if ev["imr"] == 3:
            assert ev["event_type"] == RUNTIME
            pre = RUNTIME.to_bytes(4, "little") + b":" + ev["event"].encode() + b":" + bytes.fromhex(ev["event_payload"])
            digest = hashlib.sha384(pre).digest()
            if ev["digest"]:
                assert ev["digest"] == digest.hex()
        else:
            digest = bytes.fromhex(ev["digest"])
        mrs[ev["imr"]] = hashlib.sha384(mrs[ev["imr"]] + digest).digest()
    return mrs


def quote_rtmrs(quote: bytes) -> list[bytes]:
    report = dcap_qvl.parse_quote(quote).report
    return [report.rt_mr0, report.rt_mr1, report.rt_mr2, report.rt_mr3]


def verify(agent: GuestAgentSimulator, quote: bytes, now: int = NOW):
    coll = dcap_qvl.QuoteCollateralV3.from_json(agent.collateral_json())
    return dcap_qvl.verify_with_root_ca(quote, coll, agent.test_root_ca_der, now)


def raw_client(server: SimulatorServer) -> httpx.Client:
    endpoint = server.endpoint
    if endpoint.startswith("http"):
        return httpx.Client(base_url=endpoint)
    return httpx.Client(transport=httpx.HTTPTransport(uds=endpoint), base_url="http://localhost")


@pytest.fixture(params=["unix", "tcp"])
def server(request: pytest.FixtureRequest, simulator: SimulatorServer) -> Iterator[SimulatorServer]:
    """The conftest unix-socket simulator, or the same agent on loopback TCP port 0."""
    if request.param == "unix":
        yield simulator
    else:
        with SimulatorServer(simulator.agent, port=0) as tcp:
            yield tcp


@pytest.fixture
def client(server: SimulatorServer) -> Iterator[dstack_sdk.DstackClient]:
    c = dstack_sdk.DstackClient(server.endpoint, timeout=10)
    # Not ``with DstackClient(...) as c``: SDK 0.5.4's __enter__ returns the *async* client.
    with c:
        yield c


# ----------------------------------------------------------------------------- Info / Version
def test_info_parses_and_is_self_consistent(client: dstack_sdk.DstackClient, server: SimulatorServer) -> None:
    info = client.info()
    compose_hash = hashlib.sha256(info.tcb_info.app_compose.encode()).hexdigest()
    assert info.compose_hash == info.tcb_info.compose_hash == compose_hash
    assert info.app_id == compose_hash[:40]
    assert info.app_name == json.loads(info.tcb_info.app_compose)["name"]
    assert len(bytes.fromhex(info.instance_id)) == 20
    assert json.loads(info.key_provider_info)["name"] == "kms"
    assert json.loads(info.vm_config)["num_gpus"] == 0
    assert "BEGIN CERTIFICATE" in info.app_cert
    # Info's log is unstripped and replays to the RTMRs it reports.
    events = [e.model_dump() for e in info.tcb_info.event_log]
    assert all(e["digest"] for e in events)
    mrs = replay(events)
    assert [info.tcb_info.rtmr0, info.tcb_info.rtmr1, info.tcb_info.rtmr2, info.tcb_info.rtmr3] == [m.hex() for m in mrs]
    names = [e["event"] for e in events if e["imr"] == 3]
    assert names == ["system-preparing", "app-id", "compose-hash", "instance-id", "boot-mr-done",
                     "key-provider", "storage-fs", "system-ready"]


def test_version_identifies_the_simulator(client: dstack_sdk.DstackClient) -> None:
    version = client.version()
    assert version.version == "0.5.11"
    assert version.rev.startswith("cvm-tune-simulator/")


# ----------------------------------------------------------------------------- GetKey
def test_get_key_deterministic_per_path_and_chain_recovers(client: dstack_sdk.DstackClient,
                                                           server: SimulatorServer) -> None:
    a1, a2, b = client.get_key("cft/a", "signing"), client.get_key("cft/a", "other"), client.get_key("cft/b")
    assert a1.key == a2.key != b.key  # purpose does not change the key, the path does
    assert len(a1.decode_key()) == 32
    app_id = bytes.fromhex(client.info().app_id)
    app_pubs = set()
    for resp, purpose in ((a1, "signing"), (a2, "other"), (b, "")):
        sig0, sig1 = (eth_keys.Signature(s) for s in resp.decode_signature_chain())
        pub_hex = eth_keys.PrivateKey(resp.decode_key()).public_key.to_compressed_bytes().hex()
        h0 = keccak(f"{purpose}:{pub_hex}".encode())
        k_app = sig0.recover_public_key_from_msg_hash(h0)
        assert k_app.verify_msg_hash(h0, sig0)
        app_pubs.add(k_app)
        h1 = keccak(b"dstack-kms-issued:" + app_id + k_app.to_compressed_bytes())
        assert sig1.recover_public_key_from_msg_hash(h1) == server.agent.kms_k256_public_key
    assert len(app_pubs) == 1  # one app key signs every path


def test_get_key_ed25519_and_bad_algorithm(client: dstack_sdk.DstackClient, server: SimulatorServer) -> None:
    ed = client.get_key("p", "x", algorithm="ed25519")
    assert ed.key == client.get_key("p").key  # same bytes as the secp256k1 key (dstack #605)
    with raw_client(server) as http:
        r = http.post("/GetKey", json={"path": "p", "purpose": "", "algorithm": "rsa"})
    assert r.status_code == 400 and "error" in r.json()


def test_sign_and_verify_round_trip(client: dstack_sdk.DstackClient) -> None:
    for alg, data in (("secp256k1", b"hello"), ("ed25519", b"hello"), ("secp256k1_prehashed", bytes(32))):
        signed = client.sign(alg, data)
        assert len(signed.signature_chain) == 3
        assert client.verify(alg, data, signed.decode_signature(), signed.decode_public_key()).valid
        assert not client.verify(alg, b"x" * len(data), signed.decode_signature(), signed.decode_public_key()).valid


# ----------------------------------------------------------------------------- GetQuote
def test_quote_verifies_under_test_root_only(client: dstack_sdk.DstackClient, server: SimulatorServer) -> None:
    rd = bytes(range(64))
    resp = client.get_quote(rd)
    quote = resp.decode_quote()
    for now in (NOW, int(time.time())):
        report = verify(server.agent, quote, now)
        assert report.status == "UpToDate" and report.advisory_ids == []
    assert quote[568:632] == rd and resp.report_data == rd.hex()
    coll = dcap_qvl.QuoteCollateralV3.from_json(server.agent.collateral_json())
    with pytest.raises(ValueError):
        dcap_qvl.verify(quote, coll, NOW)  # Intel's root must never accept a simulator quote


def test_short_report_data_is_right_padded(client: dstack_sdk.DstackClient, server: SimulatorServer) -> None:
    quote = client.get_quote(b"12345").decode_quote()
    assert quote[568:632] == b"12345" + bytes(59)
    assert verify(server.agent, quote).status == "UpToDate"


def test_event_log_replays_to_quote_rtmrs(client: dstack_sdk.DstackClient) -> None:
    resp = client.get_quote(b"replay")
    events = json.loads(resp.event_log)
    assert all(e["digest"] == "" for e in events if e["imr"] == 3)  # stripped like OS >= 0.5.6
    assert all(e["event_payload"] == "" for e in events if e["imr"] < 3)
    assert replay(events) == quote_rtmrs(resp.decode_quote())


def test_emit_event_extends_rtmr3(client: dstack_sdk.DstackClient, server: SimulatorServer) -> None:
    before = client.get_quote(b"a").decode_quote()
    client.emit_event("cft.run.start", b'{"run":1}')
    resp = client.get_quote(b"a")
    after = resp.decode_quote()
    assert quote_rtmrs(after)[3] != quote_rtmrs(before)[3]
    assert quote_rtmrs(after)[:3] == quote_rtmrs(before)[:3]
    events = json.loads(resp.event_log)
    assert (events[-1]["event"], events[-1]["event_payload"]) == ("cft.run.start", b'{"run":1}'.hex())
    assert replay(events) == quote_rtmrs(after)
    assert verify(server.agent, after).status == "UpToDate"
    assert server.agent.event_log[-1]["digest"]  # the agent's own copy keeps digests


def test_compose_hash_in_mrconfigid(client: dstack_sdk.DstackClient) -> None:
    info = client.info()
    quote = client.get_quote(b"c").decode_quote()
    mr_config_id = dcap_qvl.parse_quote(quote).report.mr_config_id
    assert mr_config_id[0] == 1 and mr_config_id[33:] == bytes(15)
    assert mr_config_id[1:33].hex() == info.compose_hash == hashlib.sha256(info.tcb_info.app_compose.encode()).hexdigest()
    compose_event = next(e for e in info.tcb_info.event_log if e.event == "compose-hash")
    assert compose_event.event_payload == info.compose_hash


def test_flipped_quote_byte_is_rejected(simulator: SimulatorServer) -> None:
    quote = bytes.fromhex(simulator.agent.get_quote(b"flip")["quote"])
    for offset in (184, 520, 568, 700):
        tampered = bytearray(quote)
        tampered[offset] ^= 1
        with pytest.raises(ValueError):
            verify(simulator.agent, bytes(tampered))


# ----------------------------------------------------------------------------- modes and errors
@pytest.mark.parametrize("mode", ["noop", "reject"])
def test_emit_event_modes(mode: str) -> None:
    agent = GuestAgentSimulator(SimulatorSettings(dstack="0.5", emit_event=mode))
    with SimulatorServer(agent, port=0) as srv:
        c = dstack_sdk.DstackClient(srv.endpoint)
        rtmr3 = quote_rtmrs(c.get_quote(b"m").decode_quote())[3]
        if mode == "noop":
            c.emit_event("ignored", b"x")
        else:
            with pytest.raises(httpx.HTTPStatusError) as err:
                c.emit_event("refused", b"x")
            assert err.value.response.status_code == 400 and "error" in err.value.response.json()
        assert quote_rtmrs(c.get_quote(b"m").decode_quote())[3] == rtmr3
        assert len(agent.event_log) == 32


def test_unstripped_mode_keeps_digests() -> None:
    agent = GuestAgentSimulator(SimulatorSettings(dstack="0.5", strip_event_log=False))
    resp = agent.get_quote(b"u")
    assert json.loads(resp["event_log"]) == agent.event_log


def test_http_errors_are_json(server: SimulatorServer) -> None:
    with raw_client(server) as http:
        r = http.post("/GetQuote", json={"report_data": "00" * 65})
        assert r.status_code == 400 and "error" in r.json()
        r = http.post("/NoSuchMethod", json={})
        assert r.status_code == 404 and "error" in r.json()
        for name in ("", "a:b"):
            r = http.post("/EmitEvent", json={"event": name, "payload": "00"})
            assert r.status_code == 400 and "error" in r.json()
        r = http.post("/GetQuote", json={"report_data": "zz"})
        assert r.status_code == 400
        r = http.post("/prpc/Version?json", content=b"{}")
        assert r.status_code == 200 and r.json()["rev"].startswith("cvm-tune-simulator/")
        r = http.post("/EmitEvent", json={"event": "ok", "payload": ""})
        assert r.status_code == 200 and r.json() == {}


def test_emit_event_colon_rejected_through_sdk(client: dstack_sdk.DstackClient) -> None:
    with pytest.raises(httpx.HTTPStatusError) as err:
        client.emit_event("a:b", b"c")
    assert err.value.response.status_code == 400


def test_collateral_extension_route(server: SimulatorServer) -> None:
    with raw_client(server) as http:
        body = http.post("/SimulatorCollateral", json={}).json()
    assert bytes.fromhex(body["root_ca_der"]) == server.agent.test_root_ca_der
    quote = bytes.fromhex(server.agent.get_quote(b"ext")["quote"])
    coll = dcap_qvl.QuoteCollateralV3.from_json(body["collateral"])
    assert dcap_qvl.verify_with_root_ca(quote, coll, server.agent.test_root_ca_der, NOW).status == "UpToDate"


def test_concurrent_emits_keep_replay_consistent() -> None:
    agent = GuestAgentSimulator(S05)
    threads = [threading.Thread(target=lambda i=i: [agent.emit_event(f"t{i}", bytes([j])) for j in range(10)])
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    resp = agent.get_quote(b"c")
    assert replay(json.loads(resp["event_log"])) == quote_rtmrs(bytes.fromhex(resp["quote"]))


# ----------------------------------------------------------------------------- determinism
def test_same_secret_same_bytes_different_secret_different_root() -> None:
    a, b = GuestAgentSimulator(S05), GuestAgentSimulator(SimulatorSettings(dstack="0.5", secret=DEFAULT_TEST_SECRET))
    assert a.test_root_ca_der == b.test_root_ca_der
    assert a.get_quote(b"same") == b.get_quote(b"same")
    assert a.collateral_json() == b.collateral_json()
    assert a.get_key("k", "p", "") == b.get_key("k", "p", "")
    other = GuestAgentSimulator(SimulatorSettings(dstack="0.5", secret=bytes(32)))
    assert other.test_root_ca_der != a.test_root_ca_der
    assert b"TEST" in a.test_root_ca_der


def test_custom_app_compose_changes_identity() -> None:
    text = '{"name":"other","runner":"docker-compose","storage_fs":"ext4"}'
    agent = GuestAgentSimulator(SimulatorSettings(dstack="0.5", app_compose=text))
    info = agent.info()
    assert info["compose_hash"] == hashlib.sha256(text.encode()).hexdigest() and info["app_name"] == "other"
    assert verify(agent, bytes.fromhex(agent.get_quote(b"x")["quote"])).status == "UpToDate"
    with pytest.raises(ValueError):
        SimulatorSettings(dstack="0.5", secret=b"short")


# ----------------------------------------------------------------------------- server hygiene
def test_server_address_checks(tmp_path) -> None:
    agent = GuestAgentSimulator(S05)
    with pytest.raises(ValueError, match="OS limit"):
        SimulatorServer(agent, socket_path=str(tmp_path / ("x" * (MAX_SOCKET_PATH + 1))))
    with pytest.raises(ValueError):
        SimulatorServer(agent, host="0.0.0.0", port=0)
    with pytest.raises(ValueError):
        SimulatorServer(agent)
    regular = tmp_path / "file.sock"
    regular.write_text("not a socket")
    with pytest.raises(ValueError, match="not a socket"):
        SimulatorServer(agent, socket_path=regular).start()
    assert regular.read_text() == "not a socket"


def test_stale_socket_is_replaced_and_removed_on_stop(tmp_path) -> None:
    path = tmp_path / "s.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens: a crashed agent's leftover
    with SimulatorServer(GuestAgentSimulator(S05), socket_path=path) as srv:
        with pytest.raises(ValueError, match="live socket"):
            SimulatorServer(srv.agent, socket_path=path).start()
        assert dstack_sdk.DstackClient(srv.endpoint).version().version == "0.5.11"
    assert not os.path.exists(path)


def test_serve_forever_after_start_returns_on_stop(tmp_path) -> None:
    # The CLI's sequence: start() (to print the endpoint), then serve_forever() until stopped.
    srv = SimulatorServer(GuestAgentSimulator(S05), socket_path=tmp_path / "cli.sock").start()
    waiter = threading.Thread(target=srv.serve_forever)
    waiter.start()
    assert dstack_sdk.DstackClient(srv.endpoint).version().rev.startswith("cvm-tune-simulator/")
    srv.stop()
    waiter.join(timeout=5)
    assert not waiter.is_alive() and not (tmp_path / "cli.sock").exists()
