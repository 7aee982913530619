"""The project's own parser, replay and verifier on the REAL sample quotes in shared/testdata.

Each sample is verified at the ``now`` pinned in its manifest.json entry (all real collateral has
expired), with a policy that allows exactly the expected TCB status, so the test pins both the
status dcap-qvl computes and our own steps around it.
"""

from __future__ import annotations

import json

import dcap_qvl
import pytest

from attestation import Policy, TrustedRoot, parse_collateral, parse_event_log, replay, verify_quote
from attestation.errors import QuoteParseError
from attestation.tdx.eventlog import boot_info
from attestation.tdx.inputs import decode_quote_input
from attestation.tdx.quote import Quote

from .conftest_data import TESTDATA, load_manifest

ENTRIES = load_manifest()


def _quote(entry: dict) -> bytes:
    return decode_quote_input((TESTDATA / entry["quote"]).read_bytes(), source=entry["quote"])


def _policy(entry: dict) -> Policy:
    status = entry["expected_status"] or "UpToDate"
    root = entry["root_ca_der"]
    trusted = "intel" if root is None else TrustedRoot(name="synthetic test root", der_hex=(TESTDATA / root).read_bytes().hex())
    # the NEAR MPC node measures one app event of its own after system-ready
    return Policy(name="sample", allowed_tcb_statuses=(status,), trusted_root=trusted, allowed_app_events=("mpc-image-digest",))


@pytest.mark.parametrize("entry", ENTRIES, ids=[f"{e['quote']}@{e['now']}" for e in ENTRIES])
def test_parser_agrees_with_dcap_qvl(entry: dict) -> None:
    raw = _quote(entry)
    q = Quote.from_bytes(raw)
    ref = dcap_qvl.parse_quote(raw)
    assert q.version == ref.header.version and q.tee_type == ref.header.tee_type
    if q.td is not None:
        for name in ("mr_td", "mr_config_id", "rt_mr0", "rt_mr1", "rt_mr2", "rt_mr3", "report_data", "td_attributes"):
            assert getattr(q.td, name) == getattr(ref.report, name), name


@pytest.mark.parametrize("entry", ENTRIES, ids=[f"{e['quote']}@{e['now']}" for e in ENTRIES])
def test_sample_gives_expected_result(entry: dict) -> None:
    raw = _quote(entry)
    coll = parse_collateral((TESTDATA / entry["collateral"]).read_bytes())
    assert (coll.not_before, coll.not_after) == (entry["valid_from"], entry["valid_until"])
    events = parse_event_log((TESTDATA / entry["event_log"]).read_text()) if entry["event_log"] else None
    f = verify_quote(raw, policy=_policy(entry), now=entry["now"], collateral=coll, events=events)
    checks = {c.name: c for c in f.checks}
    if Quote.from_bytes(raw).tee_name == "SGX":
        assert checks["quote.tee_type"].status == "fail" and "TDX" in checks["quote.tee_type"].detail
        return
    if entry["expected_error"]:
        assert checks["quote.signature"].status == "fail"
        assert entry["expected_error"] in checks["quote.signature"].detail
        return
    assert checks["quote.signature"].status == "pass", checks["quote.signature"].detail
    assert (f.tcb_status, list(f.advisory_ids)) == (entry["expected_status"], entry["expected_advisory_ids"])
    assert checks["quote.tcb_status"].status == "pass"
    assert checks["quote.td_attributes"].status == "pass"
    assert checks["quote.padding"].status == "pass"
    assert checks["quote.cert_chain"].status == "pass", checks["quote.cert_chain"].detail
    assert checks["collateral.chains"].status == "pass", checks["collateral.chains"].detail
    if entry["event_log_replays_all_rtmrs"]:
        assert checks["event_log.replay"].status == "pass", checks["event_log.replay"].detail
        assert checks["event_log.boot"].status == "pass"
        assert checks["event_log.names"].status == "pass", checks["event_log.names"].detail


def test_default_policy_rejects_outofdate_with_advisories() -> None:
    entry = next(e for e in ENTRIES if e["expected_status"] == "OutOfDate")
    coll = parse_collateral((TESTDATA / entry["collateral"]).read_bytes())
    f = verify_quote(_quote(entry), policy=Policy(), now=entry["now"], collateral=coll)
    check = next(c for c in f.checks if c.name == "quote.tcb_status")
    assert check.status == "fail"
    assert "OutOfDate" in check.detail and "INTEL-SA-01192" in check.detail


def test_expired_collateral_is_cannot_verify_not_valid() -> None:
    entry = ENTRIES[0]
    coll = parse_collateral((TESTDATA / entry["collateral"]).read_bytes())
    f = verify_quote(_quote(entry), policy=_policy(entry), now=entry["valid_until"] + 1, collateral=coll)
    check = next(c for c in f.checks if c.name == "collateral.window")
    assert check.status == "fail" and "cannot verify" in check.detail
    assert not any(c.name == "quote.signature" and c.status == "pass" for c in f.checks)


@pytest.mark.parametrize("offset", [568, 520, 636, 184, 376])
def test_tampered_signed_byte_is_rejected(offset: int) -> None:
    entry = next(e for e in ENTRIES if e["quote"] == "dstack_nearmpc_quote.bin")
    raw = bytearray(_quote(entry))
    raw[offset] ^= 0x01
    coll = parse_collateral((TESTDATA / entry["collateral"]).read_bytes())
    f = verify_quote(bytes(raw), policy=_policy(entry), now=entry["now"], collateral=coll)
    check = next(c for c in f.checks if c.name == "quote.signature")
    assert check.status == "fail" and "ISV enclave report signature is invalid" in check.detail


def test_nonzero_trailing_padding_is_rejected() -> None:
    """dcap-qvl accepts a flip in the unsigned padding; our verifier must not."""
    entry = next(e for e in ENTRIES if e["quote"] == "dstack_nearmpc_quote.bin")
    raw = bytearray(_quote(entry))
    raw[5000] ^= 0xFF
    coll = parse_collateral((TESTDATA / entry["collateral"]).read_bytes())
    f = verify_quote(bytes(raw), policy=_policy(entry), now=entry["now"], collateral=coll)
    checks = {c.name: c.status for c in f.checks}
    assert checks["quote.signature"] == "pass"  # dcap-qvl alone would accept it
    assert checks["quote.padding"] == "fail"


@pytest.mark.parametrize("name", ["dstack_nearmpc", "dstack_simulator"])
def test_stripped_and_forged_event_logs(name: str) -> None:
    raw = (TESTDATA / f"{name}_quote.bin").read_bytes()
    rtmrs = Quote.from_bytes(raw).td.rtmrs
    events = json.loads((TESTDATA / f"{name}_event_log.json").read_text())
    for e in events:  # what dstack >= 0.5.6 GetQuote returns
        if e["imr"] == 3:
            e["digest"] = ""
        else:
            e["event_payload"] = ""
    assert replay(parse_event_log(events)).rtmrs == rtmrs
    forged = json.loads((TESTDATA / f"{name}_event_log.json").read_text())
    target = next(e for e in forged if e["event"] == "compose-hash")
    target["event_payload"] = "11" * 32  # keep the old digest: a naive replay would still match
    rep = replay(parse_event_log(forged))
    assert rep.rtmrs[3] != rtmrs[3]
    assert any("compose-hash" in p for p in rep.problems)


def test_boot_boundary_rules() -> None:
    events = json.loads((TESTDATA / "dstack_nearmpc_event_log.json").read_text())
    dup = dict(next(e for e in events if e["event"] == "compose-hash"))
    events.append(dup)  # a privileged append after system-ready
    info = boot_info(parse_event_log(events))
    assert any("after system-ready" in p for p in info.problems)


@pytest.mark.parametrize(
    "data",
    [b"", b"\x04\x00", b"abc", b"0x123", b"{\"quote\": 5}", b"{not json", bytes(5000)],
    ids=["empty", "short", "text", "odd-hex", "json-no-quote", "bad-json", "zeros"],
)
def test_malformed_quote_input_is_a_parse_error(data: bytes) -> None:
    with pytest.raises(QuoteParseError):
        Quote.from_bytes(decode_quote_input(data))


def test_quote_input_forms_decode_to_the_same_bytes() -> None:
    raw = (TESTDATA / "dstack_nearmpc_quote.bin").read_bytes()
    assert decode_quote_input(raw) == raw
    assert decode_quote_input(b"0x" + raw.hex().encode() + b"\n") == raw
    assert decode_quote_input(json.dumps({"quote": raw.hex(), "event_log": "[]"}).encode()) == raw
    hex_text = (TESTDATA / "dcapqvl_near_quote_hex.txt").read_bytes()
    assert Quote.from_bytes(decode_quote_input(hex_text)).is_tdx


def test_truncated_quote_is_a_parse_error() -> None:
    raw = (TESTDATA / "dstack_nearmpc_quote.bin").read_bytes()
    for cut in (40, 600, 700, 4900):
        with pytest.raises(QuoteParseError):
            Quote.from_bytes(raw[:cut])
