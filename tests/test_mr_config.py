"""MRCONFIGID as dstack's VMM sets it (v1 / v2 / zero), printed by compose-hash and checked by the verifier."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from Crypto.Hash import keccak

from attestation.compose import app_compose as C
from attestation.tdx.dcap import parse_collateral
from attestation.tdx.eventlog import parse_event_log
from attestation.policy import Policy
from attestation.verify import verify_quote

DATA = Path(__file__).resolve().parent / "data" / "attestation"
NEAR_QUOTE = (DATA / "dstack_nearmpc_quote.bin").read_bytes()
NEAR_EVENTS = {e["event"]: e["event_payload"] for e in json.loads((DATA / "dstack_nearmpc_event_log.json").read_text())
               if e["imr"] == 3}
KMS_EVENT = json.dumps({"name": "kms", "id": "3059301306072a8648ce3d020106082a8648ce3d03010703420004" + "11" * 64}).encode()


def _v2_by_hand(compose_hash: str, app_id: str, kind_byte: int, kp_id: str) -> bytes:
    """``dstack-types/src/mr_config.rs`` written out with pycryptodome's Keccak-256 (not the code under test's)."""
    k = keccak.new(digest_bits=256)
    k.update(bytes.fromhex(compose_hash) + bytes.fromhex(app_id) + bytes([kind_byte]) + bytes.fromhex(kp_id))
    return b"\x02" + k.digest() + bytes(15)


def test_real_quote_carries_v1() -> None:
    compose_hash = NEAR_EVENTS["compose-hash"]
    config_id = NEAR_QUOTE[232:280]  # TD report body offset 184
    ok, how = C.check_mr_config_id(config_id, compose_hash, NEAR_EVENTS["app-id"], bytes.fromhex(NEAR_EVENTS["key-provider"]))
    assert ok and how == "MRCONFIGID v1 carries the compose-hash"
    ok, how = C.check_mr_config_id(config_id, "00" * 32, NEAR_EVENTS["app-id"], None)
    assert not ok and "does not carry" in how


def test_v2_is_keccak_over_the_measured_identity() -> None:
    compose_hash, app_id = NEAR_EVENTS["compose-hash"], NEAR_EVENTS["app-id"]
    kp_id = json.loads(KMS_EVENT)["id"]
    want = _v2_by_hand(compose_hash, app_id, 2, kp_id)
    assert C.mr_config_id_v2(compose_hash, app_id, "kms", kp_id) == want.hex()
    assert C.check_mr_config_id(want, compose_hash, app_id, KMS_EVENT) == (
        True, "MRCONFIGID v2 matches keccak(compose-hash, app-id, kms key provider id)")
    other = json.dumps({"name": "kms", "id": "3059" + "22" * 20}).encode()
    local = json.dumps({"name": "local-sgx", "id": kp_id}).encode()
    for app, event in ((app_id, other), (app_id, local), ("ab" * 20, KMS_EVENT)):
        assert C.check_mr_config_id(want, compose_hash, app, event)[0] is False
    for app, event in ((None, KMS_EVENT), (app_id, None), (app_id, b'{"name": "sgx"}')):
        ok, how = C.check_mr_config_id(want, compose_hash, app, event)
        assert not ok and "v2" in how, "never skipped silently"


def test_zero_is_not_bound_and_says_so_other_versions_fail() -> None:
    ok, how = C.check_mr_config_id(bytes(48), NEAR_EVENTS["compose-hash"], None, None)
    assert ok and "zero" in how and "RTMR3 alone" in how
    ok, how = C.check_mr_config_id(b"\x03" + bytes(47), NEAR_EVENTS["compose-hash"], None, None)
    assert not ok and "v3" in how and "none was given" in how  # v3 needs its document (tests/test_dstack06_verify.py)
    ok, how = C.check_mr_config_id(b"\x04" + bytes(47), NEAR_EVENTS["compose-hash"], None, None)
    assert not ok and "version 4" in how


def test_expected_form_follows_the_app_compose() -> None:
    h = "ab" * 32
    assert C.expected_mr_config_id({"kms_enabled": True}, h, None) == ("v1", "01" + h + "00" * 15)
    doc = {"kms_enabled": True, "key_provider_id": "0x" + "cd" * 8}
    assert C.expected_mr_config_id(doc, h, None, dstack="0.5") == ("v2", None)
    assert C.expected_mr_config_id(doc, h, "ef" * 20, dstack="0.5") == ("v2", _v2_by_hand(h, "ef" * 20, 2, "cd" * 8).hex())
    assert C.expected_mr_config_id(doc, h, "ef" * 20) == ("v3", None), "dstack 0.6's VMM makes v3 (not predictable)"
    assert C.key_provider_kind({}) == "none" and C.key_provider_kind({"local_key_provider_enabled": True}) == "local"
    assert C.key_provider_kind({"kms_enabled": True, "key_provider": "tpm"}) == "tpm"
    with pytest.raises(C.ComposeError):
        C.mr_config_id_v2(h, "ef" * 20, "sgx", "")


def test_compose_hash_command_prints_the_form(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    doc = {"manifest_version": 2, "name": "x", "runner": "docker-compose", "docker_compose_file": "services: {}\n",
           "kms_enabled": True, "key_provider_id": "cd" * 8, "public_logs": False, "public_sysinfo": False}
    path = tmp_path / "app-compose.json"
    path.write_text(json.dumps(doc))
    assert main(["compose-hash", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["mr_config_id_form"], out["mr_config_id"]) == ("v3", None), "a dstack 0.6 VMM makes v3"
    assert main(["compose-hash", str(path), "--app-id", "ef" * 20]) == 0
    text = capsys.readouterr().out
    assert f"mr_config_id  v3 {C.MR_CONFIG_V3}" in text and "use_mrconfigid" in text


def test_verifier_checks_mrconfigid_when_the_policy_pins_the_compose_hash() -> None:
    coll = parse_collateral((DATA / "dstack_nearmpc_collateral.json").read_bytes())
    events = parse_event_log((DATA / "dstack_nearmpc_event_log.json").read_text())
    f = verify_quote(NEAR_QUOTE, policy=Policy(compose_hashes=(NEAR_EVENTS["compose-hash"],)), now=1787894484,
                     collateral=coll, events=events)
    check = next(c for c in f.checks if c.name == "policy.compose_hash")
    assert check.status == "pass" and "MRCONFIGID v1 carries the compose-hash" in check.detail


def test_simulator_binds_v2_like_dstack_and_the_verifier_accepts_it() -> None:
    """With key_provider_id the simulator's MRCONFIGID is v2 (as dstack-vmm sets it); the quote verifies with the
    compose-hash pinned, and a key_provider_id the guest would refuse stops the simulator."""
    from app.simulator import GuestAgentSimulator, SimulatorSettings
    from attestation.policy import simulator_policy

    kms_id = json.loads(GuestAgentSimulator().key_provider_info)["id"]
    text = json.dumps({"name": "v2", "runner": "docker-compose", "kms_enabled": True, "key_provider_id": kms_id})
    agent = GuestAgentSimulator(SimulatorSettings(app_compose=text, dstack="0.5"))
    quote = bytes.fromhex(agent.get_quote(b"x" * 64)["quote"])
    events = parse_event_log(agent.event_log)
    boot = {e.event: e.payload for e in events if e.imr == 3}
    assert quote[232] == 2 and quote[232:280].hex() == C.mr_config_id_v2(
        boot["compose-hash"].hex(), boot["app-id"].hex(), "kms", kms_id)
    policy = simulator_policy(agent.test_root_ca_der).model_copy(update={"compose_hashes": (boot["compose-hash"].hex(),)})
    f = verify_quote(quote, policy=policy, now=1787894484, collateral=parse_collateral(agent.collateral_json().encode()),
                     events=events)
    check = next(c for c in f.checks if c.name == "policy.compose_hash")
    assert check.status == "pass" and "MRCONFIGID v2 matches" in check.detail, check.detail
    for bad in (text.replace(kms_id, "ab" * 32), text.replace('"kms_enabled": true', '"kms_enabled": false')):
        with pytest.raises(ValueError, match="would refuse to boot"):
            GuestAgentSimulator(SimulatorSettings(app_compose=bad, dstack="0.5"))


def test_simulator_cli_refuses_an_app_compose_it_cannot_boot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    for name, text in (("kp.json", json.dumps({"name": "v", "runner": "docker-compose", "kms_enabled": True,
                                                "key_provider_id": "abab"})), ("bad.json", "not json")):
        (tmp_path / name).write_text(text)
        assert main(["simulator", "--app-compose", str(tmp_path / name), "--write-policy", str(tmp_path / "p.yaml")]) == 2
        assert not (tmp_path / "p.yaml").exists() and capsys.readouterr().err.startswith("error: ")
