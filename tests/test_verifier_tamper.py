"""Tamper table on a REAL dstack quote: every change is rejected, by the check that owns the bytes.

Quote ``dstack_nearmpc_quote.bin`` (dstack 0.5.8, 5006 bytes: 4936 signed + 70 zero padding), its
collateral (with and without ``pck_certificate_chain``) and its event log, verified at the pinned
``now`` of ``manifest.json``. dcap-qvl alone accepts 3 753 of the 5 006 single-bit flips here (946
without ``pck_certificate_chain``): padding, certification-data type and length fields, PEM framing,
and — when the collateral carries the PCK chain — the quote's whole PEM chain; the verifier must
accept none.

The padding rule (docs/verifier.md, "Quote padding"): the signed region ends where the declared signature
data ends; real dstack quotes carry zero bytes after it, so zero bytes there are accepted and any
non-zero byte is rejected (``quote.padding``). The property tests below state exactly that.
"""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attestation import Policy, parse_collateral, parse_event_log, verify_quote
from attestation.errors import CollateralError, QuoteParseError
from attestation.tdx.quote import Quote

from .conftest_data import TESTDATA

NOW = 1787894484
RAW = (TESTDATA / "dstack_nearmpc_quote.bin").read_bytes()
Q = Quote.from_bytes(RAW)
COLLATERAL_TEXT = {
    "with-pck-chain": (TESTDATA / "dstack_nearmpc_collateral.json").read_text(),
    "no-pck-chain": (TESTDATA / "dstack_nearmpc_collateral_nopckchain.json").read_text(),
}
COLLATERAL = {k: parse_collateral(v) for k, v in COLLATERAL_TEXT.items()}
EVENTS = json.loads((TESTDATA / "dstack_nearmpc_event_log.json").read_text())
POLICY = Policy(name="tamper", allowed_app_events=("mpc-image-digest",))
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def failed(raw: bytes = RAW, *, coll: str = "with-pck-chain", events: list | None = None,
           report_data: bytes | None = None) -> set[str]:
    f = verify_quote(raw, policy=POLICY, now=NOW, collateral=COLLATERAL[coll],
                     events=None if events is None else parse_event_log(events), expected_report_data=report_data)
    return {c.name for c in f.checks if c.status == "fail"}


def flip(data: bytes, pos: int, mask: int = 0x01) -> bytes:
    out = bytearray(data)
    out[pos] ^= mask
    return bytes(out)


def regions(q: Quote) -> list[tuple[int, int, str]]:
    """``(start, end, check)``: which check must fail when a byte in ``[start, end)`` changes."""
    sig = q.signed_end - q.sig_data_len  # signature data starts here (636 in a v4 quote)
    auth_len_at = sig + 134 + 384 + 64
    (auth_len,) = struct.unpack_from("<H", q.raw, auth_len_at)
    inner_at = auth_len_at + 2 + auth_len
    return [
        (0, 2, "quote.parse"),  # version
        (2, 4, "quote.signature"),  # attestation key type (dcap-qvl: unsupported)
        (4, 8, "quote.parse"),  # TEE type
        (8, sig - 4, "quote.signature"),  # rest of the header and the TD report body
        (sig - 4, sig, "quote.parse"),  # signature data length
        (sig, sig + 128, "quote.signature"),  # quote signature, attestation key
        (sig + 128, sig + 134, "quote.parse"),  # certification data type and size
        (sig + 134, auth_len_at, "quote.signature"),  # QE report and its signature
        (auth_len_at, auth_len_at + 2, "quote.parse"),  # QE auth data length
        (auth_len_at + 2, inner_at, "quote.signature"),  # QE auth data
        (inner_at, inner_at + 6, "quote.parse"),  # inner certification data type and size
        (inner_at + 6, q.signed_end, "quote.cert_chain"),  # the PEM PCK chain + NUL
        (q.signed_end, len(q.raw), "quote.padding"),  # unsigned trailing bytes
    ]


REGIONS = regions(Q)


def owner(pos: int) -> str:
    return next(check for start, end, check in REGIONS if start <= pos < end)


@pytest.mark.parametrize(("pos", "check"), [(5000, "quote.padding"), (632, "quote.parse"), (764, "quote.parse"),
                                           (1252, "quote.parse"), (1285, "quote.cert_chain"), (1400, "quote.cert_chain")])
def test_dcap_qvl_alone_accepts_these_changes_the_verifier_rejects(pos: int, check: str) -> None:
    """Why quote.parse is strict and quote.padding / quote.cert_chain exist (if dcap-qvl ever starts
    rejecting one of these, this test says so)."""
    import dcap_qvl

    report = dcap_qvl.verify(flip(RAW, pos), COLLATERAL["with-pck-chain"].qvl, NOW)
    assert report.status == "UpToDate"
    assert check in failed(flip(RAW, pos))


def test_regions_cover_the_whole_quote_and_the_sample_is_accepted() -> None:
    assert REGIONS[0][0] == 0 and REGIONS[-1][1] == len(RAW) == 5006
    assert all(a[1] == b[0] for a, b in zip(REGIONS, REGIONS[1:], strict=False))
    assert Q.pck_chain_offset == REGIONS[-2][0] and Q.signed_end == 4936
    assert failed(events=EVENTS, report_data=Q.td.report_data) == set()


@pytest.mark.parametrize("coll", ["with-pck-chain", pytest.param("no-pck-chain", marks=pytest.mark.slow)])
@pytest.mark.parametrize("region", REGIONS, ids=[f"{a}-{b}:{c}" for a, b, c in REGIONS])
def test_every_single_byte_flip_of_the_quote_is_rejected_by_its_check(region: tuple[int, int, str], coll: str) -> None:
    start, end, check = region
    misses = [pos for pos in range(start, end) if check not in failed(flip(RAW, pos), coll=coll)]
    assert not misses, f"flips at {misses[:10]} (of {len(misses)}) not rejected by {check}"


def test_report_data_flips_fail_the_signature_and_the_binding() -> None:
    for i in range(64):
        got = failed(flip(RAW, Q.report_data_offset + i), report_data=Q.td.report_data)
        assert {"quote.signature", "report_data"} <= got, (i, got)


@pytest.mark.parametrize("rtmr", range(4))
def test_rtmr_flips_fail_the_signature_and_the_replay(rtmr: int) -> None:
    at = Q.report_data_offset - 48 * (4 - rtmr)
    assert RAW[at : at + 48] == Q.td.rtmrs[rtmr]
    for i in range(48):
        got = failed(flip(RAW, at + i), events=EVENTS)
        assert {"quote.signature", "event_log.replay"} <= got, (rtmr, i, got)


# ----------------------------------------------------------------------------- event log (threats case 58:
# edited payload, reordered, dropped or extra event -> RTMR replay mismatch -> reject)
def _edited(i: int) -> list:
    events = json.loads(json.dumps(EVENTS))
    e = events[i]
    if e["imr"] == 3:
        payload = bytes.fromhex(e["event_payload"])
        e["event_payload"] = (flip(payload, 0) if payload else b"\x00").hex()
        e["digest"] = ""  # a digest field is never trusted anyway
    else:
        e["digest"] = flip(bytes.fromhex(e["digest"]), 47).hex()
    return events


@pytest.mark.parametrize("i", range(len(EVENTS)))
def test_event_edit_is_rejected(i: int) -> None:
    assert "event_log.replay" in failed(events=_edited(i))


@pytest.mark.parametrize("i", range(len(EVENTS)))
def test_event_drop_is_rejected(i: int) -> None:
    assert "event_log.replay" in failed(events=EVENTS[:i] + EVENTS[i + 1 :])


SAME_IMR_PAIRS = [i for i in range(len(EVENTS) - 1) if EVENTS[i]["imr"] == EVENTS[i + 1]["imr"]]


@pytest.mark.parametrize("i", SAME_IMR_PAIRS)
def test_event_reorder_is_rejected(i: int) -> None:
    """Swapping two events of the same RTMR. (Events of different RTMRs have no measured order.)"""
    events = EVENTS[:i] + [EVENTS[i + 1], EVENTS[i]] + EVENTS[i + 2 :]
    assert "event_log.replay" in failed(events=events)


@pytest.mark.parametrize("i", range(len(EVENTS) + 1))
def test_event_add_is_rejected(i: int) -> None:
    extra = {"imr": 3, "event_type": 0x08000001, "digest": "", "event": "mpc-image-digest", "event_payload": "00"}
    assert "event_log.replay" in failed(events=[*EVENTS[:i], extra, *EVENTS[i:]])
    copy = dict(EVENTS[min(i, len(EVENTS) - 1)])  # a duplicated boot or runtime event
    assert "event_log.replay" in failed(events=[*EVENTS[:i], copy, *EVENTS[i:]])


# ----------------------------------------------------------------------------- collateral fields
# A changed date (TCB info / QE identity issueDate or nextUpdate, a CRL's update times, a certificate's
# validity) moves the collateral's window: when ``now`` falls outside it, "cannot verify" is the answer.
FIELD_CHECKS = {
    "pck_crl_issuer_chain": {"collateral.chains", "collateral.window"},  # dcap-qvl never reads this one
    "root_ca_crl": {"collateral.parse", "quote.signature", "collateral.chains", "collateral.window"},
    "pck_crl": {"collateral.parse", "quote.signature", "collateral.chains", "collateral.window"},
    "tcb_info_issuer_chain": {"collateral.chains", "quote.signature", "collateral.window"},
    "tcb_info": {"collateral.parse", "quote.signature", "collateral.window"},
    "tcb_info_signature": {"quote.signature"},
    "qe_identity_issuer_chain": {"collateral.chains", "quote.signature", "collateral.window"},
    "qe_identity": {"collateral.parse", "quote.signature", "collateral.window"},
    "qe_identity_signature": {"quote.signature"},
    "pck_certificate_chain": {"collateral.chains", "quote.signature", "collateral.window"},
}


def _other(ch: str) -> str:
    hexdigits = "0123456789abcdef"
    return hexdigits[(hexdigits.index(ch) + 1) % 16] if ch in hexdigits else chr(ord(ch) ^ 0x01)


def _collateral_failed(obj: dict) -> set[str]:
    try:
        coll = parse_collateral(json.dumps(obj))
    except CollateralError:
        return {"collateral.parse"}
    f = verify_quote(RAW, policy=POLICY, now=NOW, collateral=coll)
    return {c.name for c in f.checks if c.status == "fail"}


@pytest.mark.parametrize("field", sorted(FIELD_CHECKS))
def test_collateral_field_flips_are_rejected(field: str) -> None:
    """~60 positions per field: evenly spread, plus every line break of a PEM chain (PEM parsers skip
    whitespace, so only the byte-exact canonical-form check sees those)."""
    base = json.loads(COLLATERAL_TEXT["with-pck-chain"])
    value = base[field]
    positions = sorted({*range(0, len(value), max(1, len(value) // 40)), len(value) - 1,
                        *[i for i, ch in enumerate(value) if ch == "\n"][:20]})
    misses = []
    for pos in positions:
        got = _collateral_failed({**base, field: value[:pos] + _other(value[pos]) + value[pos + 1 :]})
        if not got & FIELD_CHECKS[field]:
            misses.append((pos, repr(value[pos]), sorted(got)))
    assert not misses, misses[:5]


@pytest.mark.slow
@pytest.mark.parametrize("field", sorted(FIELD_CHECKS))
def test_collateral_field_flips_are_rejected_exhaustively(field: str) -> None:
    base = json.loads(COLLATERAL_TEXT["with-pck-chain"])
    value = base[field]
    misses = [pos for pos in range(len(value))
              if not _collateral_failed({**base, field: value[:pos] + _other(value[pos]) + value[pos + 1 :]})
              & FIELD_CHECKS[field]]
    assert not misses, misses[:10]


# ----------------------------------------------------------------------------- properties
@SETTINGS
@given(pos=st.integers(0, len(RAW) - 1), mask=st.integers(1, 255), coll=st.sampled_from(sorted(COLLATERAL)))
def test_property_no_single_byte_change_anywhere_is_accepted(pos: int, mask: int, coll: str) -> None:
    """Rule: every byte of a quote is either signed, structural, part of the byte-exact PCK chain,
    or padding that must be zero — so no single-byte change is ever accepted, and the failing check
    names the part that was changed (quote.padding exactly for the bytes after the signed region)."""
    got = failed(flip(RAW, pos, mask), coll=coll)
    assert owner(pos) in got
    assert ("quote.padding" in got) == (pos >= Q.signed_end)


@SETTINGS
@given(extra=st.binary(min_size=1, max_size=300), keep=st.integers(0, 70))
def test_property_padding_may_only_be_zero_bytes(extra: bytes, keep: int) -> None:
    """Rule: the bytes after the declared signature data carry nothing: any run of zero bytes (as
    real dstack quotes have, 70 of them) is accepted, any non-zero byte is rejected."""
    raw = RAW[: Q.signed_end + keep] + extra
    got = failed(raw)
    assert got == ({"quote.padding"} if any(extra) else set())


@SETTINGS
@given(data=st.binary(max_size=6000))
def test_property_arbitrary_bytes_never_crash_the_parser(data: bytes) -> None:
    try:
        Quote.from_bytes(data)
    except QuoteParseError:
        pass


@SETTINGS
@given(pos=st.integers(0, 1400), value=st.integers(0, 255), cut=st.integers(1401, len(RAW)))
def test_property_corrupt_structure_is_a_parse_error_or_a_rejection(pos: int, value: int, cut: int) -> None:
    raw = bytearray(RAW[:cut])
    raw[pos] = value
    try:
        Quote.from_bytes(bytes(raw))
    except QuoteParseError:
        return
    f = verify_quote(bytes(raw), policy=POLICY, now=NOW, collateral=COLLATERAL["with-pck-chain"])
    # Only the signed region itself, with any amount of its zero padding, may pass (padding rule above).
    same_quote = RAW[pos] == value and cut >= Q.signed_end
    assert same_quote or any(c.status == "fail" for c in f.checks)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(sorted(FIELD_CHECKS)), frac=st.floats(0, 1, exclude_max=True), ch=st.characters())
def test_property_collateral_changes_are_rejected_never_crash(field: str, frac: float, ch: str) -> None:
    base = json.loads(COLLATERAL_TEXT["with-pck-chain"])
    value = base[field]
    pos = int(frac * len(value))
    if value[pos] == ch:
        return
    assert _collateral_failed({**base, field: value[:pos] + ch + value[pos + 1 :]})
