"""Bad-input and fault cases 51-64 of ``shared/reference/threats-and-faults.md`` §7, verifier side.

Each test names its case. Real sample quotes are used wherever a real quote can show the case;
TEST-PKI re-signed variants of a real quote (``tests/forge.py``) only where none can (a debug TD,
a Revoked or freshly OutOfDate TCB level). Case 58 (tampered event log) is the event-log part of
``test_verifier_tamper.py``; case 53's verifier side (``require_rtmr3_audit``) is in
``test_pipeline.py``. What is not the verifier's (51/52 agent handling, 63's published run
counter, 64's dev-image flag) is listed in docs/verifier.md, "What the verifier does not check".
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from attestation import Policy, parse_collateral, parse_event_log, verify_quote
from attestation.tdx.eventlog import boot_info, name_problems, runtime_digest
from attestation.policy import CVM_TUNE_APP_EVENTS, DEFAULT_POLICY
from attestation.tdx.quote import Quote

from app.cli import main
from app.simulator import GuestAgentSimulator, SimulatorSettings
from app.simulator.agent import SimulatorRpcError

from . import forge
from .conftest_data import TESTDATA

NOW = 1787894484
RAW = (TESTDATA / "dstack_nearmpc_quote.bin").read_bytes()
COLL = parse_collateral((TESTDATA / "dstack_nearmpc_collateral.json").read_bytes())
EVENTS = json.loads((TESTDATA / "dstack_nearmpc_event_log.json").read_text())
NEAR_POLICY = Policy(name="near", allowed_app_events=("mpc-image-digest",))
FORGED_NOW = 1800000000  # 2027-01-15; forged collateral is valid 2020..2099


def checks(raw: bytes = RAW, *, policy: Policy = NEAR_POLICY, now: int = NOW, coll=COLL, events: list | None = None,
           report_data: bytes | None = None) -> dict[str, tuple[str, str]]:
    f = verify_quote(raw, policy=policy, now=now, collateral=coll,
                     events=None if events is None else parse_event_log(events), expected_report_data=report_data)
    return {c.name: (c.status, c.detail) for c in f.checks}


def failed(**kw) -> set[str]:
    return {name for name, (status, _) in checks(**kw).items() if status == "fail"}


# ----------------------------------------------------------------------------- a real cvm-tune bundle
@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("threats")
    cfg = root / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"output": {"dir": str(root / "out")}, "training": {"max_steps": 2, "save_steps": 2}}))
    assert main(["run", "--config", str(cfg)]) == 0
    return {"dir": next((root / "out" / "exports").iterdir()), "policy": root / "out" / "simulator-test-policy.yaml"}


def verify_json(bundle_dir: Path, policy: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(["verify", str(bundle_dir), "--policy", str(policy), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_case_51_52_a_bundle_without_its_quote_is_never_accepted(bundle: dict, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "b"
    shutil.copytree(bundle["dir"], copy)
    (copy / "quote.bin").unlink()
    (copy / "quote.hex").unlink()
    rc, doc = verify_json(copy, bundle["policy"], capsys)
    bad = {c["name"] for c in doc["checks"] if c["status"] == "fail"}
    assert rc == 1 and {"bundle.files", "quote.parse"} <= bad


def test_case_54_debug_td_is_rejected() -> None:
    got = checks(forge.quote(forge.td_attributes(0x10000001)), policy=forge.policy(), now=FORGED_NOW,
                 coll=forge.collateral())
    assert got["quote.signature"][0] == "fail" and "Debug mode is enabled" in got["quote.signature"][1]
    assert got["quote.td_attributes"] == ("fail", "TD is in DEBUG mode (TDATTRIBUTES.TUD.DEBUG=1): its memory is "
                                                  "readable by the host")
    assert checks(forge.quote(), policy=forge.policy(), now=FORGED_NOW, coll=forge.collateral())[
        "quote.td_attributes"][0] == "pass"


@pytest.mark.parametrize(
    ("attributes", "words"),
    [(0x00000000, "SEPT_VE_DISABLE is 0"), (0x10000002, "reserved TUD attribute bits")],
    ids=["sept-ve-disable-0", "reserved-bits"],
)
def test_case_55_td_attributes_are_rejected(attributes: int, words: str) -> None:
    got = checks(forge.quote(forge.td_attributes(attributes)), policy=forge.policy(), now=FORGED_NOW,
                 coll=forge.collateral())
    assert got["quote.td_attributes"][0] == "fail" and words in got["quote.td_attributes"][1]
    assert got["quote.signature"][0] == "fail"  # dcap-qvl's validate_attrs agrees


def test_case_55_nonzero_mr_service_td_is_rejected() -> None:
    """The real TDX v5 (TD 1.5) sample: MRSERVICETD set."""
    entry = TESTDATA / "dcapqvl_tdx_quote_outdated"
    raw = bytearray(entry.read_bytes())
    q = Quote.from_bytes(bytes(raw))
    assert q.version == 5 and q.td.mr_service_td == bytes(48)
    raw[q.body_offset + 600] = 1  # MRSERVICETD[0]
    coll = parse_collateral((TESTDATA / "dcapqvl_tdx_quote_outdated_collateral.json").read_bytes())
    got = checks(bytes(raw), now=1772707803, coll=coll)
    assert got["quote.td_attributes"] == ("fail", "MRSERVICETD is not zero")


def test_case_56_outofdate_is_rejected_by_default_with_its_advisories() -> None:
    coll = parse_collateral((TESTDATA / "dstack_nearmpc_collateral_nopckchain.json").read_bytes())
    raw = (TESTDATA / "dcapqvl_tdx_quote").read_bytes()
    status, detail = checks(raw, policy=DEFAULT_POLICY, coll=coll)["quote.tcb_status"]
    assert status == "fail" and detail.startswith("TCB status OutOfDate not in ['UpToDate']")
    assert "INTEL-SA-01192, INTEL-SA-01245, INTEL-SA-01312, INTEL-SA-01313" in detail
    # a 90-day grace period does not cover a TCB level dated 2025-05-14 at 2026-08
    graced = checks(raw, policy=Policy(outofdate_grace_period_s=90 * 86400), coll=coll)["quote.tcb_status"]
    assert graced[0] == "fail" and "grace period ended 2025-08-12T00:00:00Z" in graced[1]
    denied = checks(raw, policy=Policy(allowed_tcb_statuses=("OutOfDate",), denied_advisories=("INTEL-SA-01245",)),
                    coll=coll)["quote.tcb_status"]
    assert denied == ("fail", "TCB status OutOfDate; denied advisories present: INTEL-SA-01245")


def _all_levels(status: str, date: str = "2027-01-01T00:00:00Z"):
    def edit(tcb: dict) -> None:
        for level in tcb["tcbLevels"]:
            level["tcbStatus"], level["tcbDate"] = status, date
            level["advisoryIDs"] = ["INTEL-SA-99999"]
        for module in tcb["tdxModuleIdentities"]:  # the TDX module's levels carry a date too
            for level in module["tcbLevels"]:
                level["tcbDate"] = date
    return edit


def test_case_56_outofdate_inside_the_grace_period_is_accepted_with_a_warning() -> None:
    coll = forge.collateral(_all_levels("OutOfDate"))  # TCB level dated 2027-01-01 (1798761600)
    grace = forge.policy(outofdate_grace_period_s=30 * 86400)
    inside = checks(forge.quote(), policy=grace, now=FORGED_NOW, coll=coll)["quote.tcb_status"]
    assert inside[0] == "pass" and inside[1].startswith("WARNING: OutOfDate accepted inside the policy's grace period")
    assert "INTEL-SA-99999" in inside[1]
    after = checks(forge.quote(), policy=grace, now=1798761600 + 30 * 86400 + 1, coll=coll)["quote.tcb_status"]
    assert after[0] == "fail" and "grace period ended 2027-01-31T00:00:00Z" in after[1]
    default = checks(forge.quote(), policy=forge.policy(), now=FORGED_NOW, coll=coll)["quote.tcb_status"]
    assert default[0] == "fail"


def test_case_56_revoked_is_always_rejected() -> None:
    coll = forge.collateral(_all_levels("Revoked"))
    from attestation.policy import TCB_STATUSES
    everything = forge.policy(allowed_tcb_statuses=TCB_STATUSES, outofdate_grace_period_s=90 * 86400)
    got = checks(forge.quote(), policy=everything, now=FORGED_NOW, coll=coll)
    assert got["quote.signature"][0] == "fail" and "quote.tcb_status" not in got


@pytest.mark.parametrize(("now", "label"), [(1786617938 - 1, "before"), (1789171031 + 1, "after")])
def test_case_57_collateral_outside_its_window_is_cannot_verify(now: int, label: str) -> None:
    got = checks(now=now)
    assert got["collateral.window"][0] == "fail" and got["collateral.window"][1].startswith("cannot verify")
    assert "quote.signature" not in got  # never "valid"


def test_case_57_stale_collateral_below_the_policy_minimum_is_rejected() -> None:
    """(threats §3) a PCCS can serve stale-but-unexpired collateral: a minimum tcbEvaluationDataNumber."""
    assert checks()["collateral.tcb_evaluation"][0] == "skip"
    assert checks(policy=Policy(min_tcb_evaluation_data_number=19))["collateral.tcb_evaluation"][0] == "pass"
    status, detail = checks(policy=Policy(min_tcb_evaluation_data_number=20))["collateral.tcb_evaluation"]
    assert status == "fail" and "tcbEvaluationDataNumber 19 < policy minimum 20" in detail


def test_case_57_unreachable_pccs_is_an_error_not_a_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["collateral", str(TESTDATA / "dstack_nearmpc_quote.bin"), "-o", str(tmp_path / "c.json"),
               "--pccs", "http://127.0.0.1:9", "--retries", "0", "--timeout", "2"])
    assert rc == 2 and "cannot fetch" in capsys.readouterr().err


def _with_event(index: int, name: str, payload: str = "00") -> list:
    extra = {"imr": 3, "event_type": 0x08000001, "digest": "", "event": name, "event_payload": payload}
    return [*EVENTS[:index], extra, *EVENTS[index:]]


READY = next(i for i, e in enumerate(EVENTS) if e["event"] == "system-ready")


def test_case_59_second_compose_hash_is_rejected() -> None:
    compose = next(e for e in EVENTS if e["event"] == "compose-hash")
    after = _with_event(len(EVENTS), "compose-hash", compose["event_payload"])
    assert {"event_log.boot", "event_log.names", "event_log.replay"} <= failed(events=after)
    assert any("after system-ready (privileged append)" in p for p in boot_info(parse_event_log(after)).problems)
    before = _with_event(READY, "compose-hash", "11" * 32)  # a duplicate inside the boot sequence
    assert "second 'compose-hash' before system-ready" in checks(events=before)["event_log.boot"][1]


def test_case_60_colon_names_and_unknown_names_are_rejected() -> None:
    # why: the v1 digest cannot tell these apart
    assert runtime_digest("cvm-tune.run", b"start:x") == runtime_digest("cvm-tune.run:start", b"x")
    for events, words in (
        (_with_event(len(EVENTS), "cvm-tune.run:start"), "contains ':'"),
        (_with_event(len(EVENTS), "cvm-tune.debug"), "not an allowed event name after system-ready"),
        (_with_event(READY, "cvm-tune.run.start"), "not an allowed event name before system-ready"),
    ):
        assert "event_log.names" in failed(events=events)
        assert words in checks(events=events)["event_log.names"][1]
    problems = name_problems(parse_event_log(_with_event(len(EVENTS), "a:b")), boot_names=(), app_names=("a:b",))
    assert problems and "contains ':'" in problems[-1]  # even a policy cannot allow a ':' name


def test_case_60_the_app_never_emits_such_names(bundle: dict, capsys: pytest.CaptureFixture[str]) -> None:
    assert all(":" not in name for name in CVM_TUNE_APP_EVENTS)
    with pytest.raises(SimulatorRpcError, match="must not contain ':'"):  # a 0.5 agent's EmitEvent refuses it
        GuestAgentSimulator(SimulatorSettings(dstack="0.5")).emit_event("cvm-tune.run:start", b"")
    # dstack 0.5 (the committed sample bundle): every audit entry is an RTMR3 event named cvm-tune.<type>, none with
    # ':', and the verifier replays them (audit.rtmr3 pass)
    sample = TESTDATA.parent / "bundle"
    rc, doc = verify_json(sample, TESTDATA.parent / "bundle-policy.yaml", capsys)
    names = {c["name"]: c["status"] for c in doc["checks"]}
    assert rc == 0 and names["event_log.names"] == "pass" and names["audit.rtmr3"] == "pass", doc["checks"]
    app = _app_events(sample)
    assert app and all(n.startswith("cvm-tune.") and ":" not in n and n in CVM_TUNE_APP_EVENTS for n in app)
    # dstack 0.6 (the demo bundle: the simulator's default): EmitEvent is gone, so RTMR3 holds no event after
    # system-ready at all (event_log.boot fails any), and the audit chain is bound by report_data alone
    rc, doc = verify_json(bundle["dir"], bundle["policy"], capsys)
    names = {c["name"]: c["status"] for c in doc["checks"]}
    manifest = json.loads((bundle["dir"] / "manifest.json").read_text())
    assert rc == 0 and names["event_log.names"] == "pass" and names["event_log.boot"] == "pass", doc["checks"]
    assert manifest["audit"]["rtmr3"] == "unsupported" and names["audit.rtmr3"] == "skip" and _app_events(bundle["dir"]) == []


def _app_events(bundle_dir: Path) -> list[str]:
    """The names of the RTMR3 events after the first ``system-ready`` in a bundle's event log."""
    rtmr3 = [e["event"] for e in json.loads((bundle_dir / "event_log.json").read_text()) if e["imr"] == 3]
    return rtmr3[rtmr3.index("system-ready") + 1:]


def test_case_61_changed_adapter_is_named(bundle: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "b"
    shutil.copytree(bundle["dir"], copy)
    adapter = copy / "adapter" / "adapter_model.safetensors"
    data = bytearray(adapter.read_bytes())
    data[-1] ^= 1
    adapter.write_bytes(bytes(data))
    rc, doc = verify_json(copy, bundle["policy"], capsys)
    files = next(c for c in doc["checks"] if c["name"] == "manifest.files")
    assert rc == 1 and files["status"] == "fail" and files["reason"] == "adapter/adapter_model.safetensors changed"


def test_case_61_62_report_data_must_match_the_expected_value() -> None:
    q = Quote.from_bytes(RAW)
    assert checks(report_data=q.td.report_data)["report_data"][0] == "pass"
    fresh_nonce = bytes(range(32)).ljust(64, b"\0")  # an old quote presented for a fresh challenge
    assert checks(report_data=fresh_nonce)["report_data"] == (
        "fail", "report_data differs from the expected value (quote is for other content)")


def test_case_63_verdict_carries_the_freshness_facts(bundle: dict, capsys: pytest.CaptureFixture[str]) -> None:
    """The run counter is published by the app (not yet); the verdict gives what to compare it with."""
    manifest = json.loads((bundle["dir"] / "manifest.json").read_text())
    _, doc = verify_json(bundle["dir"], bundle["policy"], capsys)
    audit = manifest["audit"]
    assert doc["bundle"] == {"run_id": manifest["run_id"], "created_at": manifest["created_at"],
                             "audit_head": audit["head"], "audit_last_seq": audit["first_seq"] + audit["entries"] - 1}


def test_case_64_other_os_image_measurements_are_rejected() -> None:
    other = Quote.from_bytes((TESTDATA / "dstack_simulator_quote.bin").read_bytes()).td
    own = Quote.from_bytes(RAW).td
    pinned_other = Policy(expected_mrtd=(other.mr_td.hex(),), expected_rtmr0=(other.rt_mr0.hex(),),
                          expected_rtmr1=(other.rt_mr1.hex(),), expected_rtmr2=(other.rt_mr2.hex(),))
    differing = [name for name, a, b in (("MRTD", own.mr_td, other.mr_td), ("RTMR0", own.rt_mr0, other.rt_mr0),
                                         ("RTMR1", own.rt_mr1, other.rt_mr1), ("RTMR2", own.rt_mr2, other.rt_mr2)) if a != b]
    assert differing  # another dstack CVM: a different hardware profile or image
    assert checks(policy=pinned_other)["policy.measurements"] == ("fail", f"not allowed: {', '.join(differing)}")
    pinned_own = Policy(expected_mrtd=(own.mr_td.hex(),), expected_rtmr0=(own.rt_mr0.hex(), other.rt_mr0.hex()),
                        expected_rtmr1=(own.rt_mr1.hex(),), expected_rtmr2=(own.rt_mr2.hex(),))
    assert checks(policy=pinned_own)["policy.measurements"] == ("pass", "MRTD, RTMR0, RTMR1, RTMR2 allowed")
