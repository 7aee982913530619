"""Fetch a quote's collateral from a PCCS: the attestation package's one networked module.

``fetch_collateral(raw_quote, pccs_url=...)`` asks the PCCS exactly what dcap-qvl's
``get_collateral`` asks (``src/collateral.rs`` @ 9bffe30; paths relative to the base URL, a trailing
``/sgx/certification/v4`` or ``/tdx/certification/v4`` is dropped; ``tee`` is ``tdx`` or ``sgx``)::

    GET /sgx/certification/v4/pckcrl?ca=<platform|processor>&encoding=der
        body: the PCK CRL (DER)                    header SGX-PCK-CRL-Issuer-Chain
    GET /<tee>/certification/v4/tcb?fmspc=<FMSPC>
        body: {"tcbInfo": {...}, "signature": hex} header TCB-Info-Issuer-Chain (or SGX-TCB-Info-Issuer-Chain)
    GET /<tee>/certification/v4/qe/identity?update=standard
        body: {"enclaveIdentity": {...}, "signature": hex}
                                                   header SGX-Enclave-Identity-Issuer-Chain
    GET /sgx/certification/v4/rootcacrl            body: the root CA CRL as hex (a PCCS; Intel's PCS has
        no such path: the CRL distribution point of the root certificate is used instead)

Issuer-chain headers are URL-encoded PEM. ``tcb_info`` and ``qe_identity`` are kept as the exact
bytes of the inner objects as served (Intel signs those bytes; they are never re-serialised).
FMSPC and CA type come from the quote's PCK certificate, and the quote's own PCK chain becomes
``pck_certificate_chain``, as dcap-qvl does. PEM chains are written in canonical form.

HTTP goes through the project's one HTTP edge (:mod:`attestation.io.http_edge`): no proxy or credentials
from the environment, TLS verified, at most 3 redirects (each target checked again), bounded bodies, a per-request timeout, an
overall deadline, and the one retry policy (connection errors, 429 and 5xx; ``Retry-After`` honoured up
to 10 s). Nothing here is trusted: the verifier checks every signature. Every failure is a
:class:`PccsError` (exit 2 at the CLI); a caller that goes on without collateral must say so.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple
from urllib.parse import SplitResult, unquote

import dcap_qvl
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from attestation.tdx.dcap import MAX_COLLATERAL_BYTES, parse_collateral
from attestation.errors import CollateralError
from attestation.io.http_edge import DeadlineExceeded, Edge, EdgeError, GaveUp, TooLarge, budget_s, check_url, retry
from attestation.tdx.quote import Quote

PHALA_PCCS_URL = "https://pccs.phala.network"  # dcap-qvl's default
INTEL_PCS_URL = "https://api.trustedservices.intel.com"
MAX_REDIRECTS = 3  # each target checked again (a CRL distribution point may move)
BACKOFF_CAP_S = 10.0  # the longest wait between attempts, a server's Retry-After included


class PccsError(CollateralError):
    """The PCCS could not be reached or answered something that is not collateral."""

    default_fix = "check --pccs URL and the network, then run `cvm-tune collateral` again"


def fetch_collateral(
    raw_quote: bytes,
    *,
    pccs_url: str = PHALA_PCCS_URL,
    timeout: float = 15.0,
    retries: int = 3,
    backoff: float = 0.5,
    deadline_s: float | None = None,
) -> str:
    """Fetch the collateral for ``raw_quote`` and return it as dcap-qvl ``QuoteCollateralV3`` JSON.

    Args:
        raw_quote: the quote bytes (already decoded from hex / GetQuote JSON).
        pccs_url: PCCS base URL (a trailing ``/sgx|tdx/certification/v4`` is accepted).
        timeout: seconds per request (connect and read).
        retries: retries per request on connection errors and retryable HTTP statuses.
        backoff: wait before the first retry, doubled per retry (0.5 s, 1 s, 2 s, ...; at most 10 s, a server's
            Retry-After honoured up to that).
        deadline_s: the whole fetch, every request, retry and wait together, however slowly a server sends
            (default: the four requests with every attempt taking its timeouts in full, plus the waits).

    Raises:
        QuoteParseError: the bytes are not a quote.
        PccsError: no PCK chain in the quote, network failure, HTTP error, or unusable answers.
    """
    if not timeout > 0 or retries < 0:
        raise PccsError(f"timeout must be > 0 and retries >= 0 (got {timeout}, {retries})",
                        fix="pass --timeout SECONDS > 0 and --retries N >= 0")
    q = Quote.from_bytes(raw_quote)
    try:
        parsed = dcap_qvl.parse_quote(bytes(raw_quote))
        fmspc, ca = parsed.fmspc(), parsed.ca()
        pck_chain = q.pck_chain or parsed.cert_chain_pem_bytes()
    except ValueError as exc:
        raise PccsError(f"cannot read FMSPC / CA type from the quote's PCK certificate: {_line(exc)}") from exc
    if not pck_chain:
        raise PccsError("the quote carries no PEM PCK certificate chain (encrypted-PPID quotes are not supported)")
    base = pccs_url.strip().rstrip("/").removesuffix("/sgx/certification/v4").removesuffix("/tdx/certification/v4")
    if not base.startswith(("http://", "https://")):
        raise PccsError(f"--pccs {pccs_url!r} is not an http(s) URL", fix="pass a URL such as https://pccs.phala.network")
    _check(base)
    tee = "tdx" if q.is_tdx else "sgx"
    if deadline_s is None:
        deadline_s = budget_s(requests=4, attempts=retries + 1, timeout_s=timeout, backoff_s=backoff, cap_s=BACKOFF_CAP_S)
    with Edge(deadline_s=deadline_s, timeout_s=timeout) as edge:
        get = lambda url: _get(edge, url, retries, backoff, deadline_s)  # noqa: E731
        crl = get(f"{base}/sgx/certification/v4/pckcrl?ca={ca}&encoding=der")
        pck_crl, pck_crl_chain = _der_crl(crl), _header_chain(crl, "SGX-PCK-CRL-Issuer-Chain")
        tcb = get(f"{base}/{tee}/certification/v4/tcb?fmspc={fmspc}")
        tcb_chain = _header_chain(tcb, "TCB-Info-Issuer-Chain", "SGX-TCB-Info-Issuer-Chain")
        tcb_info, tcb_sig = _signed_member(tcb, "tcbInfo")
        qe = get(f"{base}/{tee}/certification/v4/qe/identity?update=standard")
        qe_chain = _header_chain(qe, "SGX-Enclave-Identity-Issuer-Chain")
        qe_identity, qe_sig = _signed_member(qe, "enclaveIdentity")
        root_crl_url = _root_crl_url(qe_chain) if base.startswith(INTEL_PCS_URL) else f"{base}/sgx/certification/v4/rootcacrl"
        root_crl = _der_crl(get(root_crl_url))
    text = json.dumps(
        {
            "pck_crl_issuer_chain": pck_crl_chain,
            "root_ca_crl": root_crl.hex(),
            "pck_crl": pck_crl.hex(),
            "tcb_info_issuer_chain": tcb_chain,
            "tcb_info": tcb_info,
            "tcb_info_signature": tcb_sig,
            "qe_identity_issuer_chain": qe_chain,
            "qe_identity": qe_identity,
            "qe_identity_signature": qe_sig,
            "pck_certificate_chain": _canonical_pem(pck_chain.rstrip(b"\0"), "the quote's PCK chain"),
        },
        indent=2,
    )
    parse_collateral(text)  # CollateralError if the pieces do not make collateral
    return text


def save_collateral(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temp file in the same directory, fsync, rename).

    Raises:
        PccsError: the file cannot be written.
    """
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or Path("."))
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise PccsError(f"cannot write {path}: {exc.strerror}", fix="choose a writable output path with -o") from exc


def _check(url: str) -> SplitResult:
    """The edge's URL rule, with plain http allowed anywhere: collateral is public and the verifier checks every
    signature in it, and a PCCS on a private network often serves plain http."""
    try:
        return check_url(url, "the PCCS URL", plain_http_anywhere=True)
    except ValueError as exc:
        raise PccsError(str(exc), fix="pass a URL such as https://pccs.phala.network") from None


class _Answer(NamedTuple):
    url: str
    headers: Mapping[str, str]
    content: bytes


def _get(edge: Edge, url: str, retries: int, backoff: float, deadline_s: float) -> _Answer:
    """GET through the HTTP edge with the one retry policy and a bounded body (at most the collateral limit)."""

    def attempt(_n: int) -> _Answer:
        with edge.request("GET", url, check=_check, redirects=MAX_REDIRECTS) as resp:
            if not 200 <= resp.status < 300:
                raise PccsError(f"{url} answered HTTP {resp.status}")
            return _Answer(url, resp.headers, resp.read_all(MAX_COLLATERAL_BYTES))

    try:
        return retry(attempt, attempts=retries + 1, backoff_s=backoff, cap_s=BACKOFF_CAP_S, deadline=edge.deadline)
    except GaveUp as exc:
        last = exc.last
        what = f"{url} answered HTTP {last.status}" if last.status else f"cannot fetch {url}: {last.reason}"
        raise PccsError(f"{what} (after {exc.attempts} attempt(s))") from None
    except DeadlineExceeded as exc:
        raise PccsError(f"cannot fetch {url}: the collateral fetch did not finish within {deadline_s:g} s"
                        + (f" (last: {exc.last.reason})" if exc.last else ""),
                        fix="check --pccs URL and the network; pass a larger --timeout for a slow PCCS") from None
    except TooLarge:
        raise PccsError(f"{url} answered more than {MAX_COLLATERAL_BYTES} bytes") from None
    except EdgeError as exc:
        raise PccsError(f"cannot fetch {url}: {exc.reason}") from None


def _line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:300]


def _canonical_pem(pem: bytes, what: str) -> str:
    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise PccsError(f"{what} is not a PEM certificate chain") from exc
    return b"".join(c.public_bytes(Encoding.PEM) for c in certs).decode()


def _header_chain(resp: _Answer, *names: str) -> str:
    for name in names:
        value = resp.headers.get(name)
        if value:
            return _canonical_pem(unquote(value).encode(), f"header {name} of {resp.url}")
    raise PccsError(f"{resp.url} answered without the {names[0]} header")


def _der_crl(resp: _Answer) -> bytes:
    """A CRL body: DER, or hex text of DER (what a PCCS serves for rootcacrl)."""
    body = resp.content
    try:
        text = body.decode("ascii").strip()
        der = bytes.fromhex(text) if text and len(text) % 2 == 0 else body
    except (UnicodeDecodeError, ValueError):
        der = body
    try:
        x509.load_der_x509_crl(der)
    except ValueError as exc:
        raise PccsError(f"{resp.url} did not answer a DER CRL") from exc
    return der


def _root_crl_url(qe_chain: str) -> str:
    root = x509.load_pem_x509_certificates(qe_chain.encode())[-1]
    try:
        points = root.extensions.get_extension_for_class(x509.CRLDistributionPoints).value
    except x509.ExtensionNotFound as exc:
        raise PccsError("the root certificate names no CRL distribution point") from exc
    for point in points:
        for name in point.full_name or ():
            if isinstance(name, x509.UniformResourceIdentifier):
                return str(name.value)
    raise PccsError("the root certificate names no CRL distribution point URL")


def _signed_member(resp: _Answer, key: str) -> tuple[str, str]:
    """``(exact text of body[key], signature hex)`` of a TCB-info / QE-identity answer."""
    try:
        text = resp.content.decode("utf-8")
        raw = _raw_member(text, key)
        signature = json.loads(text)["signature"]
        if not isinstance(signature, str):
            raise ValueError("signature is not a string")
        bytes.fromhex(signature)
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise PccsError(f"{resp.url} did not answer {{{key!r}: ..., 'signature': hex}} JSON: {_line(exc)}") from exc
    return raw, signature.lower()


def _raw_member(text: str, key: str) -> str:
    """The exact source text of the value of top-level member ``key`` of a JSON object."""
    dec = json.JSONDecoder()
    ws = " \t\r\n"
    pos = len(text) - len(text.lstrip(ws))
    if text[pos : pos + 1] != "{":
        raise ValueError("not a JSON object")
    pos += 1
    while True:
        pos += len(text[pos:]) - len(text[pos:].lstrip(ws))
        if text[pos : pos + 1] != '"':
            raise ValueError(f"no member {key!r}")
        name, pos = dec.raw_decode(text, pos)
        pos += len(text[pos:]) - len(text[pos:].lstrip(ws))
        if text[pos : pos + 1] != ":":
            raise ValueError("expected ':'")
        pos += 1
        pos += len(text[pos:]) - len(text[pos:].lstrip(ws))
        start = pos
        _, pos = dec.raw_decode(text, pos)
        if name == key:
            return text[start:pos]
        pos += len(text[pos:]) - len(text[pos:].lstrip(ws))
        if text[pos : pos + 1] != ",":
            raise ValueError(f"no member {key!r}")
        pos += 1
