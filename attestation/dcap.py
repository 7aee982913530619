"""dcap-qvl at the edge: collateral parsing, its validity window, and the signature/TCB call.

dcap-qvl (Rust) verifies the PCK chain, CRLs, TCB info, QE identity, QE report, the TD report
signature, the TCB level and the TD attributes. It raises ``ValueError`` for every failure; this
module turns that into a :class:`DcapResult` with the message, and works out the collateral's
validity window so an expired collateral is reported as "cannot verify", not as a bad quote.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

import dcap_qvl
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from attestation.errors import CollateralError
from attestation.roots import INTEL_SGX_ROOT_CA_DER

_PEM_FIELDS = ("pck_crl_issuer_chain", "tcb_info_issuer_chain", "qe_identity_issuer_chain", "pck_certificate_chain")
_CRL_FIELDS = ("root_ca_crl", "pck_crl")
MAX_COLLATERAL_BYTES = 1 << 20


@dataclass(frozen=True)
class Collateral:
    """Parsed collateral plus the time window in which all of it is valid."""

    text: str
    qvl: dcap_qvl.QuoteCollateralV3
    not_before: int
    not_after: int
    tcb_evaluation_data_number: int | None


@dataclass(frozen=True)
class DcapResult:
    """dcap-qvl's answer: a TCB status, or the error it raised."""

    ok: bool
    status: str | None
    advisory_ids: tuple[str, ...]
    error: str | None


def _ts(value: str) -> int:
    return int(datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp())


def parse_collateral(text: str | bytes) -> Collateral:
    """Parse dcap-qvl collateral JSON and compute its validity window.

    Raises:
        CollateralError: not JSON, missing fields, or fields dcap-qvl cannot read.
    """
    if isinstance(text, bytes):
        if len(text) > MAX_COLLATERAL_BYTES:
            raise CollateralError(f"collateral is {len(text)} bytes; expected a few tens of KB")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CollateralError("collateral is not UTF-8 JSON") from exc
    try:
        obj = json.loads(text)
        qvl = dcap_qvl.QuoteCollateralV3.from_json(text)
    except (ValueError, TypeError) as exc:
        raise CollateralError(f"collateral is not dcap-qvl QuoteCollateralV3 JSON: {str(exc).splitlines()[0]}") from exc
    starts: list[int] = []
    ends: list[int] = []
    tcb_number = None
    try:
        for key in ("tcb_info", "qe_identity"):
            inner = json.loads(obj[key])
            starts.append(_ts(inner["issueDate"]))
            ends.append(_ts(inner["nextUpdate"]))
            if key == "tcb_info":
                tcb_number = inner.get("tcbEvaluationDataNumber")
        for key in _CRL_FIELDS:
            crl = x509.load_der_x509_crl(bytes.fromhex(obj[key]))
            starts.append(int(crl.last_update_utc.timestamp()))
            if crl.next_update_utc is not None:
                ends.append(int(crl.next_update_utc.timestamp()))
        for key in _PEM_FIELDS:
            if obj.get(key):
                for cert in x509.load_pem_x509_certificates(obj[key].encode()):
                    starts.append(int(cert.not_valid_before_utc.timestamp()))
                    ends.append(int(cert.not_valid_after_utc.timestamp()))
    except (KeyError, ValueError, TypeError) as exc:
        raise CollateralError(f"collateral field unreadable: {exc}") from exc
    return Collateral(text, qvl, max(starts), min(ends), tcb_number)


def chain_root_problems(raw: bytes, collateral: Collateral, root_der: bytes) -> list[str]:
    """Every PEM chain (quote certification data, collateral issuer chains) must end in ``root_der``.

    dcap-qvl anchors at its own root and ignores a root copy inside a chain, so an altered copy
    would pass unnoticed; the shipped chains are part of the evidence and must be exactly right.
    """
    chains: list[tuple[str, bytes]] = []
    try:
        embedded = dcap_qvl.parse_quote(bytes(raw)).cert_chain_pem_bytes()
    except ValueError:
        embedded = None
    if embedded:
        chains.append(("the quote's PCK chain", embedded.rstrip(b"\0")))
    obj = json.loads(collateral.text)
    chains += [(f"collateral {k}", obj[k].encode()) for k in _PEM_FIELDS if obj.get(k)]
    problems = []
    for name, pem in chains:
        try:
            last = x509.load_pem_x509_certificates(pem)[-1].public_bytes(Encoding.DER)
        except ValueError:
            problems.append(f"{name} is not a PEM certificate chain")
            continue
        if last != root_der:
            problems.append(f"{name} does not end in the trusted root certificate")
    return problems


def dcap_verify(raw: bytes, collateral: Collateral, *, root_der: bytes | None, now: int) -> DcapResult:
    """Run dcap-qvl, then :func:`chain_root_problems`. ``root_der`` None = Intel's root.

    The quote is passed byte-exact (dcap-qvl insists on ``bytes``; ``now`` must be an int).
    """
    try:
        if root_der is None:
            rep = dcap_qvl.verify(bytes(raw), collateral.qvl, int(now))
        else:
            rep = dcap_qvl.verify_with_root_ca(bytes(raw), collateral.qvl, bytes(root_der), int(now))
    except (ValueError, TypeError, OverflowError) as exc:
        return DcapResult(False, None, (), " | ".join(line.strip() for line in str(exc).splitlines() if line.strip()))
    problems = chain_root_problems(raw, collateral, INTEL_SGX_ROOT_CA_DER if root_der is None else root_der)
    if problems:
        return DcapResult(False, None, (), "; ".join(problems))
    return DcapResult(True, rep.status, tuple(rep.advisory_ids), None)
