"""The simulator's dstack 0.6 mode (the default): routes, EmitEvent's 400, Attest in both encodings, v1 GetKey with
the reference's vectors, 0.6's RTMR3 order, MRCONFIGID v1/v3 and KMS key epochs (``dstack-0.6.md`` §1-§5)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import dcap_qvl
import dstack_sdk
import httpx
import msgpack
import pytest
from eth_keys import keys as eth_keys
from eth_utils import keccak

from app.simulator import GuestAgentSimulator, SimulatorRpcError, SimulatorServer, SimulatorSettings
from app.simulator import v06
from app.simulator.agent import _ratls_hkdf

SAMPLES = Path(__file__).parent / "data" / "dstack-0.6"
ROOT = bytes.fromhex("1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b")
COMPOSE = json.loads((Path(__file__).parents[1] / "app/simulator/fixtures/app-compose.json").read_text())
ORDER_06 = ["system-preparing", "app-id", "compose-hash", "gpu-policy-hash", "instance-id", "boot-mr-done",
            "os-image-hash", "key-provider", "app-epoch", "storage-fs", "system-ready"]


@pytest.fixture(scope="module")
def sim06() -> GuestAgentSimulator:
    return GuestAgentSimulator()


def http(server: SimulatorServer) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=server.endpoint), base_url="http://localhost")


def replay3(events: list[dict]) -> bytes:
    mr = bytes(48)
    for ev in events:
        if ev["imr"] == 3:
            mr = hashlib.sha384(mr + v06.runtime_digest(ev["event"], bytes.fromhex(ev["event_payload"]),
                                                        ev.get("version", 1))).digest()
    return mr


# ------------------------------------------------------------------------------------------------ vectors
@pytest.mark.parametrize(("domain", "alg", "key", "pub"), [
    ("", "secp256k1", "59f60584ce6fd2a3a31997256db9d77322463fc8a6b1520110401bcb1ee92387",
     "0377c7fb050db181d392266a3cee9adb2901c6d665f11bac68be5457f577ba4908"),
    ("", "ed25519", "b023493030669cf22e9cafa6a464d4cf3ae4edfe5474ec796710f21ea011946d",
     "a3dc149fd5b765eab2eb7d3174fa939e39386898f10b15b7b146f6f1358ecf2a"),
    ("storage-encryption", "secp256k1", "5510330f86902ddae38c6d89c93a8408019332c17a429e1abd01c4a28d1544a6",
     "03d962450a41748021c8b02787ac36ce642ff0ae25f4c55019eb527e1112cfd764"),
    ("storage-encryption", "ed25519", "3c4c3ece12fa99ccb93fc0090877f80e70545fdd971e2ac93d3398c4684538d3",
     "2380c4a33a60b60613fa43866421e5b96eb8dcde211317200fd0d41e7e491288"),
    ("a/b/c", "secp256k1", "7f0973449298085d2d36a3b4c4d3243c100ba1981ffa885fe9e9dee883e69538",
     "02e9b1a61b6d70aa9b241753828c316bf90e33e77b2e113f9ba75a8b6dc3cde5c1"),
    ("6b003a6579", "ed25519", "42da8bf0b479ed125c370e3b91f982735bf08ff592abbd586985affa43ee96a1",
     "c833107822b003ff5675b33b90b151d4315c3ab9162b17d876e8dffde41abf9b"),
])
def test_v1_kdf_reference_vectors(domain: str, alg: str, key: str, pub: str) -> None:
    raw_domain = bytes.fromhex(domain) if domain == "6b003a6579" else domain.encode()
    assert v06.v1_key(ROOT, alg, raw_domain) == (bytes.fromhex(key), bytes.fromhex(pub))


def test_v1_link0_vector_and_v0_contrast() -> None:
    key, pub = v06.v1_key(ROOT, "secp256k1", b"storage-encryption")
    link0 = eth_keys.PrivateKey(ROOT).sign_msg_hash(v06.v1_claim("secp256k1", b"storage-encryption", pub)).to_bytes()
    assert link0.hex() == ("5b6193729ce7976ec67863f21692d4b98c69832698aae8e001a7d33a6f818b6e46ca950725b6e90e8ca9bcf394"
                           "abd03ce264bf9b7eec1e91693247f9dd53c26901")
    v0 = _ratls_hkdf(ROOT, b"storage-encryption")
    assert v0.hex() == "faa3a89eab70d8296e07745f5f67ae377764f62e3f00744ba8ac064c0a13c4d2" != key.hex()
    test = _ratls_hkdf(ROOT, b"test")  # v0 vector, path "test", purpose "signing"
    assert test.hex().startswith("52786aa1") and test.hex().endswith("b5379e")
    pub0 = eth_keys.PrivateKey(test).public_key.to_compressed_bytes().hex()
    sig = eth_keys.PrivateKey(ROOT).sign_msg_hash(keccak(f"signing:{pub0}".encode())).to_bytes().hex()
    assert sig.startswith("c8a3dcf0") and sig.endswith("5a3876b01")


def test_runtime_digest_vectors() -> None:
    assert v06.runtime_digest("app-id", bytes.fromhex("deadbeef")).hex() == (
        "67b4be4efed0893cfa2bb1d35dca209ad8348b4c97f980807bcde8b9a0f26398dd0923d6eccb5aa2096d98046da8740f")
    assert v06.v2_preimage("compose-hash", b"\xab\xcd") == b'{"name":"compose-hash","payload":"abcd","type":134217729}'
    assert v06.runtime_digest("compose-hash", b"\xab\xcd", 2).hex() == (
        "9dde1673f544faa94b921825209593ddde08d0baf9cd6990175dffaf3081f1bb10311d56de189491feb33842a050ad7b")
    assert v06.runtime_digest("", b"", 2).hex() == (
        "7d65b81202e4e4a23a637731e0a701ff5cb75d0bba75a94a8761fbb036eb5b46ff988258a81cf9c783edbe720c162cc7")
    assert v06.v2_preimage("\b\f\n\r\t\x01", b"").startswith(b'{"name":"\\b\\f\\n\\r\\t\\u0001"')
    assert v06.EMPTY_GPU_POLICY_HASH.hex() == "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"


def test_encoders_reproduce_the_shared_sample_byte_for_byte() -> None:
    v1 = bytes.fromhex(json.loads((SAMPLES / "tdx-lite-v1-attest.json").read_text())["attestation"])
    v0 = bytes.fromhex(json.loads((SAMPLES / "tdx-lite-v0-attest.rebuilt.json").read_text())["attestation"])
    events = json.loads((SAMPLES / "tdx-lite-v1-attest.event_log.json").read_text())
    quote = (SAMPLES / "tdx-lite-v1-attest.quote.bin").read_bytes()
    config = msgpack.unpackb(v1, raw=False)["stack"]["data"]["config"]
    assert v06.encode_v1(quote, events, b"\x42" * 64, config) == v1
    assert v06.encode_v0(quote, events, b"\x42" * 64, config) == v0


# ------------------------------------------------------------------------------------------------ routes
def test_routes_emit_event_and_probe(simulator: SimulatorServer) -> None:
    c = http(simulator)
    assert c.post("/v1/Version", json={}).json()["version"] == "0.6.7"
    assert c.post("/v0/Version", json={}).json() == c.post("/Version", json={}).json()
    r = c.post("/EmitEvent", json={"event": "x", "payload": "00"})
    assert (r.status_code, r.json()) == (400, {"error": v06.EMIT_EVENT_REMOVED})
    assert c.post("/v0/EmitEvent", json={"event": "x", "payload": ""}).status_code == 400
    r = c.post("/v1/EmitEvent", json={})
    assert (r.status_code, r.json()) == (404, {"error": "Service not found: EmitEvent"})
    r = c.post("/v2/Version", json={})
    assert r.status_code == 404 and r.headers["content-type"].startswith("text/plain")
    sdk = dstack_sdk.DstackClient(simulator.endpoint)
    with pytest.raises(httpx.HTTPStatusError):
        sdk.emit_event("cvm-tune.run", b"x")
    assert sdk.get_quote(b"r").decode_quote()  # the SDK's GetQuote still works on 0.6
    info = c.post("/v1/Info", json={}).json()
    assert info["app_id"] == simulator.agent.app_id.hex() and "tcb_info" not in info and "app_cert" not in info


def test_05_mode_keeps_no_v1(sock_dir: Path) -> None:
    with SimulatorServer(GuestAgentSimulator(SimulatorSettings(dstack="0.5")), socket_path=sock_dir / "a.sock") as s:
        r = http(s).post("/v1/Version", json={})
        assert (r.status_code, r.json()) == (404, {"error": "not found"})
        assert http(s).post("/Attest", json={"report_data": ""}).status_code == 400


# ------------------------------------------------------------------------------------------------ Attest / RTMR3
def test_rtmr3_order_attest_v0_and_quote_verify(sim06: GuestAgentSimulator) -> None:
    assert [e["event"] for e in sim06.event_log if e["imr"] == 3] == ORDER_06
    blob = bytes.fromhex(sim06.attest(b"\x07" * 64)["attestation"])
    assert blob[:2] == b"\x00\x00"  # SCALE V0: no V2 event
    quote = bytes.fromhex(sim06.get_quote(b"\x07" * 64)["quote"])
    qlen = int.from_bytes(blob[2:4], "little") >> 2
    assert blob[4 : 4 + 48] == quote[:48]  # same header as GetQuote's quote (signatures differ by nothing else)
    report = dcap_qvl.parse_quote(quote).report
    assert report.rt_mr3 == replay3(sim06.event_log) and qlen == len(quote)
    coll = dcap_qvl.QuoteCollateralV3.from_json(sim06.collateral_json())
    assert dcap_qvl.verify_with_root_ca(quote, coll, sim06.test_root_ca_der, 1_800_000_000).status
    assert bytes(report.mr_config_id)[:1] == b"\x01" and sim06.mr_config is None
    v1 = msgpack.unpackb(bytes.fromhex(sim06.rpc("Attest", {"report_data": "07"}, "v1")["attestation"]), raw=False)
    assert v1["version"] == 1 and v1["stack"]["data"]["report_data"] == [7] + [0] * 63


def test_event_log_v2_init_scripts_and_gpu_policy() -> None:
    compose = {**COMPOSE, "event_log_version": 2, "init_script": ["echo a", "echo b"],
               "requirements": {"gpu_policy": {"attest_gpu": True}}}
    sim = GuestAgentSimulator(SimulatorSettings(app_compose=json.dumps(compose)))
    names = [e["event"] for e in sim.event_log if e["imr"] == 3]
    assert names[3:6] == ["init-script-hash", "init-script-hash", "gpu-policy-hash"]
    gpu = next(e for e in sim.event_log if e["event"] == "gpu-policy-hash")
    assert gpu["event_payload"] == hashlib.sha256(b'{"attest_gpu":true}').hexdigest()
    for ev in (e for e in sim.event_log if e["imr"] == 3):
        assert ev["version"] == 2
        assert bytes.fromhex(ev["preimage"]) == v06.v2_preimage(ev["event"], bytes.fromhex(ev["event_payload"]))
    doc = msgpack.unpackb(bytes.fromhex(sim.attest(b"")["attestation"]), raw=False)  # a V2 event: MessagePack V1
    assert doc["platform"]["data"]["event_log"][-1]["preimage"]
    stripped = json.loads(sim.get_quote(b"")["event_log"])
    assert all(e["digest"] == "" and e["preimage"] for e in stripped if e["imr"] == 3)
    assert dcap_qvl.parse_quote(bytes.fromhex(sim.get_quote(b"")["quote"])).report.rt_mr3 == replay3(stripped)


def test_mr_config_v3_with_key_provider_id(sim06: GuestAgentSimulator) -> None:
    kms_id = json.loads(sim06.key_provider_info)["id"]
    sim = GuestAgentSimulator(SimulatorSettings(app_compose=json.dumps({**COMPOSE, "key_provider_id": kms_id})))
    doc = json.loads(sim.mr_config)
    assert doc == {"version": 3, "app_id": sim.app_id.hex(), "compose_hash": sim.compose_hash.hex(),
                   "key_provider": "kms", "key_provider_id": kms_id}
    assert json.loads(sim.vm_config)["mr_config"] == sim.mr_config
    expected = b"\x03" + hashlib.sha256(b"dstack-mr-config-v3:\x00" + sim.mr_config.encode()).digest() + bytes(15)
    assert bytes(dcap_qvl.parse_quote(bytes.fromhex(sim.get_quote(b"")["quote"])).report.mr_config_id) == expected
    old = GuestAgentSimulator(SimulatorSettings(dstack="0.5", app_compose=json.dumps({**COMPOSE, "key_provider_id": kms_id})))
    assert bytes(dcap_qvl.parse_quote(bytes.fromhex(old.get_quote(b"")["quote"])).report.mr_config_id)[:1] == b"\x02"


def test_attest_gpu_and_boottime_evidence(sim06: GuestAgentSimulator) -> None:
    assert sim06.rpc("AttestGpu", {"nonce": "00" * 32}, "v1") == {"bundles": []}
    with pytest.raises(SimulatorRpcError, match="32 bytes"):
        sim06.rpc("AttestGpu", {"nonce": "00" * 31}, "v1")
    answer = sim06.rpc("Attest", {"report_data": "", "include_boottime_gpu_evidence": True}, "v1")
    assert answer["boottime_gpu_evidence"] == []


# ------------------------------------------------------------------------------------------------ keys / epochs
def test_v1_get_key_chain_recovers_to_the_kms(sim06: GuestAgentSimulator) -> None:
    got = sim06.rpc("GetKey", {"domain": "a\x00b", "algorithm": "secp256k1"}, "v1")
    pub = bytes.fromhex(got["public_key"])
    assert eth_keys.PrivateKey(bytes.fromhex(got["key"])).public_key.to_compressed_bytes() == pub
    link0, link1 = (eth_keys.Signature(bytes.fromhex(s)) for s in got["signature_chain"])
    app_root = link0.recover_public_key_from_msg_hash(v06.v1_claim("secp256k1", b"a\x00b", pub))
    issued = b"dstack-kms-issued:" + sim06.app_id + app_root.to_compressed_bytes()
    assert link1.recover_public_key_from_msg_hash(keccak(issued)) == sim06.kms_k256_public_key
    assert got["key"] != sim06.get_key("a\x00b", "", "secp256k1")["key"]  # v1 keys are never v0 keys
    with pytest.raises(SimulatorRpcError):
        sim06.rpc("GetKey", {"domain": "x", "algorithm": "k256"}, "v1")


def test_get_key_epochs_select_report_and_refuse_newer() -> None:
    old, new = GuestAgentSimulator(), GuestAgentSimulator(SimulatorSettings(root_epoch=1, app_epoch=2))
    now = new.get_key("p", "u", "")
    assert (now["root_epoch"], now["app_epoch"]) == (1, 2) and now["key"] != old.get_key("p", "u", "")["key"]
    back = new.rpc("GetKey", {"path": "p", "purpose": "u", "root_epoch": 0, "app_epoch": 0})
    assert back["key"] == old.get_key("p", "u", "")["key"] and (back["root_epoch"], back["app_epoch"]) == (0, 0)
    assert new.rpc("GetKey", {"path": "p", "root_epoch": 1, "app_epoch": 0})["key"] not in (now["key"], back["key"])
    with pytest.raises(SimulatorRpcError, match="newer than the current app epoch"):
        new.rpc("GetKey", {"path": "p", "app_epoch": 3})
    with pytest.raises(SimulatorRpcError, match="unsigned"):
        new.rpc("GetKey", {"path": "p", "root_epoch": -1})
    app_epoch = next(e for e in new.event_log if e["event"] == "app-epoch")
    assert json.loads(bytes.fromhex(app_epoch["event_payload"])) == {"app_epoch": 2, "root_epoch": 1}


def test_05_ignores_selectors_and_reports_no_epochs() -> None:
    sim05 = GuestAgentSimulator(SimulatorSettings(dstack="0.5", root_epoch=1))
    got = sim05.rpc("GetKey", {"path": "p", "purpose": "u", "root_epoch": 0, "app_epoch": 0})
    assert "root_epoch" not in got
    assert got["key"] == GuestAgentSimulator(SimulatorSettings(root_epoch=1)).get_key("p", "u", "")["key"]
    at_zero = GuestAgentSimulator(SimulatorSettings(dstack="0.5")).get_key("p", "u", "")["key"]
    assert at_zero == GuestAgentSimulator().get_key("p", "u", "")["key"]  # 0.5 -> 0.6 keeps every v0 key


def test_rotate_hook_moves_forward_and_reboots() -> None:
    sim = GuestAgentSimulator()
    before = sim.get_key("p", "", "")["key"]
    sim.rotate(app_epoch=1)
    assert sim.get_key("p", "", "")["key"] != before and sim.epochs == (0, 1)
    assert sim.rpc("GetKey", {"path": "p", "app_epoch": 0})["key"] == before
    assert [e["event"] for e in sim.event_log if e["imr"] == 3] == ORDER_06
    assert dcap_qvl.parse_quote(bytes.fromhex(sim.get_quote(b"")["quote"])).report.rt_mr3 == replay3(sim.event_log)
    with pytest.raises(ValueError, match="forward"):
        sim.rotate(app_epoch=0)


def test_settings_and_cli_validate_epochs() -> None:
    from app.cli import main

    with pytest.raises(ValueError):
        SimulatorSettings(root_epoch=-1)
    with pytest.raises(ValueError):
        SimulatorSettings(dstack="0.7")  # type: ignore[arg-type]
    assert main(["simulator", "--dstack", "0.6", "--root-epoch", "-1", "--write-policy", "/dev/null"]) == 2
