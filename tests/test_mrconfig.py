"""MRCONFIGID as dstack computes it (V1, V2 Keccak), on real quotes: NEAR MPC and the simulator fixture carry V1,
the dstack-examples rtmr3-based Phala capture carries all zero (not bound: an explicit outcome, never a silent skip)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from attestation import Policy, parse_collateral, parse_event_log, verify_quote
from attestation import mrconfig as M
from attestation.quote import Quote

from app.deploy import describe_app_compose

from .conftest_data import TESTDATA, load_manifest

DATA = Path(__file__).resolve().parent / "data" / "attestation"


def _events(name: str) -> dict[str, bytes]:
    return {e["event"]: bytes.fromhex(e["event_payload"]) for e in json.loads((DATA / name).read_text()) if e["imr"] == 3}


def test_keccak_is_ethereums_and_v2_layout() -> None:
    """Keccak-256 (not SHA3-256): the empty-input vector; V2 = 02 || keccak(ch || app_id || kind || kp_id) || 00*15."""
    from eth_hash.auto import keccak

    assert keccak(b"").hex() == "c5d2460186f7233c927e7db2dcc703c0e500b653ca82273b7bfad8045d85a470"
    for kind, byte in M.KINDS.items():
        got = M.v2(b"\x22" * 32, b"\x11" * 20, kind, b"\x33" * 32)
        assert got == b"\x02" + keccak(b"\x22" * 32 + b"\x11" * 20 + bytes([byte]) + b"\x33" * 32) + bytes(15)
    assert M.v2(b"\x22" * 32, b"\x11" * 20, "kms", b"\x33" * 32).hex() == (
        "027f2ca741da9d356026ab20ca640abf06198829a128817b091bbc9aec1ed97b60" + "00" * 15)
    assert M.v2(bytes(32), bytes(20), "none", b"").hex() == (
        "024d8a735acc38ab7f01310ca8e6026ed9f86de88141cd83996db741df5291fc0d" + "00" * 15)
    with pytest.raises(ValueError, match="known key provider"):
        M.v2(bytes(32), bytes(20), "sgx", b"")


@pytest.mark.parametrize(("quote", "log"), [("dstack_nearmpc_quote.bin", "dstack_nearmpc_event_log.json"),
                                            ("dstack_simulator_quote.bin", "dstack_simulator_event_log.json")])
def test_real_quotes_carry_v1_and_v2_would_differ(quote: str, log: str) -> None:
    config_id = Quote.from_bytes((DATA / quote).read_bytes()).td.mr_config_id
    ev = _events(log)
    assert config_id == M.v1(ev["compose-hash"])
    status, detail = M.check(config_id, compose_hash=ev["compose-hash"].hex(), app_id=ev["app-id"].hex(), key_provider=ev["key-provider"])
    assert (status, detail.split(" ")[0]) == ("pass", "V1")
    kp = json.loads(ev["key-provider"])
    v2 = M.v2(ev["compose-hash"], ev["app-id"], kp["name"], bytes.fromhex(kp["id"]))
    assert M.check(v2, compose_hash=ev["compose-hash"].hex(), app_id=ev["app-id"].hex(), key_provider=ev["key-provider"])[0] == "pass"
    other = M.check(v2, compose_hash=ev["compose-hash"].hex(), app_id="00" * 20, key_provider=ev["key-provider"])
    assert other[0] == "fail" and "does not match" in other[1]
    assert M.check(config_id, compose_hash="00" * 32, app_id=None, key_provider=None)[0] == "fail"


def test_near_v2_vector() -> None:
    """NEAR MPC's measured values (key provider local-sgx, kind 1) give this V2 (computed; dstack ships no V2 vector)."""
    ev = _events("dstack_nearmpc_event_log.json")
    kp = json.loads(ev["key-provider"])
    assert kp["name"] == "local-sgx"
    assert M.v2(ev["compose-hash"], ev["app-id"], kp["name"], bytes.fromhex(kp["id"])).hex() == (
        "02dad4fc86ccc175ec3e8b73c47d2bb168a093cf4ee8d9106a7355cbc0ed033114" + "00" * 15)


def test_zero_is_not_bound_and_said_so() -> None:
    report = json.loads((DATA / "dstackexamples_rtmr3_report.json").read_text())
    config_id = Quote.from_bytes(bytes.fromhex(report["quote"])).td.mr_config_id
    assert config_id == bytes(48)
    status, detail = M.check(config_id, compose_hash="06768e6d" + "00" * 28, app_id=None, key_provider=None)
    assert status == "skip" and "all zero" in detail and "binds nothing" in detail
    for bad, why in ((b"\x03" + bytes(47), "V3"), (b"\x07" + bytes(47), "unknown")):
        assert M.check(bad, compose_hash="00" * 32, app_id=None, key_provider=None)[0] == "fail"
        assert why in M.check(bad, compose_hash="00" * 32, app_id=None, key_provider=None)[1]


def test_verifier_checks_mrconfigid_when_the_policy_pins_compose_hashes() -> None:
    entry = next(e for e in load_manifest() if e["quote"] == "dstack_nearmpc_quote.bin" and e["event_log"])
    raw = (TESTDATA / entry["quote"]).read_bytes()
    coll = parse_collateral((TESTDATA / entry["collateral"]).read_bytes())
    events = parse_event_log((TESTDATA / entry["event_log"]).read_text())
    ch = _events("dstack_nearmpc_event_log.json")["compose-hash"].hex()
    base = dict(name="t", allowed_tcb_statuses=(entry["expected_status"],), allowed_app_events=("mpc-image-digest",))
    checks = {c.name: c for c in verify_quote(raw, policy=Policy(**base), now=entry["now"], collateral=coll, events=events).checks}
    assert "policy.mr_config_id" not in checks, "no compose-hash pinned: nothing to compare MRCONFIGID with"
    f = verify_quote(raw, policy=Policy(**base, compose_hashes=(ch,)), now=entry["now"], collateral=coll, events=events)
    checks = {c.name: c for c in f.checks}
    assert checks["policy.mr_config_id"].status == "pass" and checks["policy.mr_config_id"].detail.startswith("V1 carries")
    assert [c.name for c in f.checks if c.status == "fail"] == []


def test_compose_hash_command_says_which_mrconfigid_applies() -> None:
    tcb = json.loads((DATA / "dstack_nearmpc_tcb_info.json").read_text())
    out = describe_app_compose(tcb["app_compose"].encode(), pinned_app_id=None)
    assert out["mr_config_id"] == M.v1(bytes.fromhex(tcb["compose_hash"])).hex() and out["mr_config_id_version"] == "V1"
    assert "use_mrconfigid" in out["mr_config_id_note"] and "all zero" in out["mr_config_id_note"]
    doc = json.loads(tcb["app_compose"])
    kp_id = "6b5ed02e549a1c30aaa8e3171a045f1f449b0017353ef595e78e39c348c98d01"
    raw = json.dumps({**doc, "key_provider_id": kp_id}, indent=4).encode()
    out = describe_app_compose(raw, pinned_app_id=None)
    digest = out["compose_hash"]
    assert out["mr_config_id_version"] == "V2"
    assert out["mr_config_id"] == M.v2(bytes.fromhex(digest), bytes.fromhex(digest[:40]), "local", bytes.fromhex(kp_id)).hex()
    kms = json.dumps({**doc, "kms_enabled": True, "key_provider_id": kp_id}).encode()
    assert describe_app_compose(kms, pinned_app_id=None)["mr_config_id"] is None, "V2 with KMS needs the deployment's app id"
    assert describe_app_compose(kms, pinned_app_id="0x" + "ab" * 20)["mr_config_id"] == M.v2(
        bytes.fromhex(hashlib.sha256(kms).hexdigest()), b"\xab" * 20, "kms", bytes.fromhex(kp_id)).hex()

