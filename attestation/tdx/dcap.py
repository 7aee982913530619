"""dcap-qvl at the edge: collateral parsing, its validity window, and the signature/TCB call.

dcap-qvl (Rust) verifies the PCK chain, CRLs, TCB info, QE identity, QE report, the TD report
signature, the TCB level and the TD attributes. It raises ``ValueError`` for every failure; this
module turns that into a :class:`DcapResult` with the message, and works out the collateral's
validity window so an expired collateral is reported as "cannot verify", not as a bad quote.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

import dcap_qvl
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives.serialization import Encoding

from attestation.errors import CollateralError

_PEM_FIELDS = ("pck_crl_issuer_chain", "tcb_info_issuer_chain", "qe_identity_issuer_chain", "pck_certificate_chain")
_CERT_ERRORS = (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm)  # malformed or tampered certificates
_PARSE_ERRORS = (KeyError, ValueError, TypeError, AttributeError, OverflowError, RecursionError, x509.InvalidVersion, UnsupportedAlgorithm)
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
    tcb_date: int | None = None  # tcbDate of the platform's matched TCB level (unix seconds)
    tcb_evaluation_data_number: int | None = None  # min of TCB info and QE identity


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
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        qvl = dcap_qvl.QuoteCollateralV3.from_json(text)
    except (ValueError, TypeError, RecursionError) as exc:
        first = (str(exc).splitlines() or [""])[0][:200]
        raise CollateralError(f"collateral is not dcap-qvl QuoteCollateralV3 JSON: {first}") from exc
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
                for cert in _load_chain(obj[key].encode()) or []:
                    starts.append(int(cert.not_valid_before_utc.timestamp()))
                    ends.append(int(cert.not_valid_after_utc.timestamp()))
    except _PARSE_ERRORS as exc:
        raise CollateralError(f"collateral field unreadable: {type(exc).__name__}: {str(exc)[:200]}") from exc
    return Collateral(text, qvl, max(starts), min(ends), tcb_number)


@lru_cache(maxsize=32)
def _load_chain(pem: bytes) -> tuple[x509.Certificate, ...] | None:
    """The certificates of a PEM chain (parsed once per verification: the collateral window, the chain
    checks and the quote's chain all read the same chains)."""
    try:
        with warnings.catch_warnings():  # tampered certificates may trip cryptography's deprecation warnings
            warnings.simplefilter("ignore")
            return tuple(x509.load_pem_x509_certificates(pem))
    except ValueError:
        return None


@lru_cache(maxsize=64)
def _issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    """``issuer`` signed ``cert`` (one signature check per pair: the quote's and the collateral's
    chains share their PCK CA, TCB signing and root links)."""
    try:
        cert.verify_directly_issued_by(issuer)
    except _CERT_ERRORS:
        return False
    return True


def chain_problems(name: str, pem: bytes, root_der: bytes) -> tuple[list[str], tuple[x509.Certificate, ...]]:
    """A shipped PEM chain must be exactly the canonical PEM of its certificates (nothing else, not
    one whitespace byte different), each certificate issued by the next, ending in ``root_der``.

    dcap-qvl ignores some chains (``pck_crl_issuer_chain``; the quote's own chain when the collateral
    carries ``pck_certificate_chain``), skips unparsable PEM blocks and anchors at its own root, so a
    changed byte there would otherwise pass unnoticed. Returns the problems and the certificates.
    """
    certs = _load_chain(pem)
    if not certs:
        return [f"{name} is not a PEM certificate chain"], ()
    problems = []
    if b"".join(c.public_bytes(Encoding.PEM) for c in certs) != pem:
        problems.append(f"{name} is not in canonical PEM form (bytes around the certificates were changed)")
    for i, (cert, issuer) in enumerate(zip(certs, certs[1:], strict=False)):
        if not _issued_by(cert, issuer):
            problems.append(f"{name}: certificate {i} is not issued by certificate {i + 1}")
    if certs[-1].public_bytes(Encoding.DER) != root_der:
        problems.append(f"{name} does not end in the trusted root certificate")
    return problems, certs


@lru_cache(maxsize=64)
def quote_chain_problems(chain: bytes, root_der: bytes) -> tuple[str, ...]:
    """The quote's embedded PCK chain (``Quote.pck_chain``): canonical PEM, then exactly one NUL."""
    if not chain.endswith(b"\0") or b"\0" in chain[:-1]:
        return ("the quote's PCK chain must end in exactly one NUL byte",)
    return tuple(chain_problems("the quote's PCK chain", chain[:-1], root_der)[0])


def collateral_chain_problems(text: str, root_der: bytes, quote_chain: bytes | None) -> tuple[str, ...]:
    """Every PEM chain of the collateral (see :func:`chain_problems`); the PCK CRL issued by the first
    certificate of ``pck_crl_issuer_chain`` and the root CA CRL by the root; and a
    ``pck_certificate_chain`` (which dcap-qvl uses *instead of* the quote's chain) equal to the
    quote's own chain, so the quote's chain bytes cannot be changed unnoticed."""
    problems, pck_chain_der = _collateral_own_problems(text, root_der)
    if pck_chain_der is not None and quote_chain is not None and pck_chain_der != _chain_der(quote_chain.rstrip(b"\0")):
        problems += ("collateral pck_certificate_chain is not the quote's own PCK chain",)
    return problems


@lru_cache(maxsize=64)
def _chain_der(pem: bytes) -> tuple[bytes, ...]:
    return tuple(c.public_bytes(Encoding.DER) for c in _load_chain(pem) or [])


@lru_cache(maxsize=16)
def _collateral_own_problems(text: str, root_der: bytes) -> tuple[tuple[str, ...], tuple[bytes, ...] | None]:
    """The collateral-only part of :func:`collateral_chain_problems`, plus the DER of its
    ``pck_certificate_chain`` (None when absent)."""
    obj = json.loads(text)
    problems: list[str] = []
    issuers: dict[str, tuple[x509.Certificate, ...]] = {}
    for key in _PEM_FIELDS:
        pem = obj.get(key)
        if pem is None and key == "pck_certificate_chain":
            continue
        pem_bytes = pem.encode() if isinstance(pem, str) else b""
        if key == "pck_certificate_chain" and pem_bytes.endswith(b"\0"):
            pem_bytes = pem_bytes[:-1]  # dcap-qvl's get_collateral copies the quote's chain with its NUL
        found, issuers[key] = chain_problems(f"collateral {key}", pem_bytes, root_der)
        problems += found
    for key, signer in (("pck_crl", issuers["pck_crl_issuer_chain"][:1]), ("root_ca_crl", issuers["pck_crl_issuer_chain"][-1:])):
        crl = x509.load_der_x509_crl(bytes.fromhex(obj[key]))
        try:
            signed = bool(signer) and crl.issuer == signer[0].subject and crl.is_signature_valid(signer[0].public_key())
        except _CERT_ERRORS:
            signed = False
        if not signed:
            problems.append(f"collateral {key} is not signed by its issuer in pck_crl_issuer_chain")
    pck = issuers.get("pck_certificate_chain")
    return tuple(problems), None if pck is None else tuple(c.public_bytes(Encoding.DER) for c in pck)


def dcap_verify(raw: bytes, collateral: Collateral, *, root_der: bytes | None, now: int) -> DcapResult:
    """Run dcap-qvl once (``QuoteVerifier(root_der)``, ``root_der`` None = Intel's root; the claims-only
    policy: every signature, chain, CRL and TCB check, no policy filter) and read the TCB status, its
    advisories, the platform TCB level's date and the collateral's TCB evaluation data number from the claims.

    The quote is passed byte-exact (dcap-qvl insists on ``bytes``; ``now`` must be an int). Only on failure
    is ``verify`` run as well, for its fuller error text (the cause chain).
    """
    try:
        claims = json.loads(
            dcap_qvl.QuoteVerifier(None if root_der is None else bytes(root_der))
            .verify_with_policy(bytes(raw), collateral.qvl, int(now), dcap_qvl.QuotePolicy.claims_only(int(now)))
            .to_json()
        )
        status, advisories = str(claims["tcb"]["status"]), tuple(claims["tcb"]["advisory_ids"])
        tcb_date = int(claims["platform"]["tcb_date_tag"])
        eval_number = int(claims["tcb"]["eval_data_number"])
    except (ValueError, TypeError, OverflowError, KeyError) as exc:
        return DcapResult(False, None, (), _error_text(_verify_error(raw, collateral, root_der, now) or exc))
    return DcapResult(True, status, advisories, None, tcb_date, eval_number)


def _verify_error(raw: bytes, collateral: Collateral, root_der: bytes | None, now: int) -> Exception | None:
    """dcap-qvl ``verify``'s own error for a quote the claims call rejected (it names the cause chain)."""
    try:
        if root_der is None:
            dcap_qvl.verify(bytes(raw), collateral.qvl, int(now))
        else:
            dcap_qvl.verify_with_root_ca(bytes(raw), collateral.qvl, bytes(root_der), int(now))
    except (ValueError, TypeError, OverflowError) as exc:
        return exc
    return None


def _error_text(exc: Exception) -> str:
    return " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
