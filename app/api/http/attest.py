"""``cvm-tune api attest URL --policy POLICY --out trust.pem``: check a training API before sending it anything.

1. A fresh 32-byte nonce; ``GET URL/api/v1/cvm_tune/attestation?nonce=HEX`` over the connection whose certificate
   is then read (not trusted yet: that is what this decides); the whole exchange within one deadline, the answer at
   most :data:`MAX_DOC` bytes.
2. The quote under the policy (signature, TCB, RTMR replay with the event log), its report_data =
   :func:`app.api.http.tls.report_data` over the nonce and the SHA-256 of the SubjectPublicKeyInfo of the certificate this
   connection presented (a man in the middle, or a gateway that terminates TLS, presents another key: rejected).
3. The app-compose hashes to the compose-hash the event log measured, and a non-zero MRCONFIGID binds that same
   compose-hash (v1 or v2, as the bundle verifier's ``compose.hash`` step checks it).
4. Writes the certificate to ``--out``: the SDK trusts it with ``SSL_CERT_FILE``.

Plain ``http://`` is accepted on loopback only (the server serves it only with the simulator; it binds no TLS key
and nothing is written).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import socket
import ssl
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

from attestation import load_policy
from attestation.compose.app_compose import check_mr_config_id
from attestation.tdx.dcap import parse_collateral
from attestation.io.http_edge import Watchdog, check_url
from attestation.tdx.inputs import event_log_from_json, getquote_mr_config
from attestation.io.safe_yaml import parse_json
from attestation.verify import quote_verdict

from app.api.http.tls import SCHEMA, report_data, spki_sha256
from app.errors import ConfigError
from app.fsutil import atomic_write_bytes

EXIT_REJECTED = 1
MAX_DOC = 8 << 20


def _fetch(url: urllib.parse.SplitResult, nonce: bytes, timeout: float) -> tuple[dict[str, Any], bytes | None]:
    """The attestation document and the DER certificate the connection presented (None for plain HTTP), the whole
    exchange (connect, TLS handshake, request, answer) within ``timeout`` seconds."""
    where = url.geturl()
    with Watchdog(time.monotonic() + timeout) as watchdog:
        port = url.port or (443 if url.scheme == "https" else 80)
        conn = http.client.HTTPConnection(url.hostname, port, timeout=timeout)
        der = None
        try:
            conn.sock = sock = socket.create_connection((url.hostname, port), timeout=timeout)
            watchdog.watch(sock)  # shut down at the deadline: ends a handshake or an answer dripped byte by byte
            if url.scheme == "https":
                ctx = ssl.create_default_context()
                ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # read, not trusted: the quote decides
                sock = ctx.wrap_socket(sock, server_hostname=url.hostname)
                der = sock.getpeercert(binary_form=True)  # now: an answer with Connection: close closes the socket
                if not der:
                    raise ssl.SSLError("the server presented no certificate")
            conn.sock = sock
            conn.request("GET", f"{url.path.rstrip('/')}/api/v1/cvm_tune/attestation?nonce={nonce.hex()}")
            resp = conn.getresponse()
            body = resp.read(MAX_DOC + 1)
        except (OSError, http.client.HTTPException) as exc:
            if not watchdog.fired:
                raise ConfigError(f"cannot fetch the attestation from {where}: {exc}",
                                  fix="check the URL and that `cvm-tune api serve` runs there") from None
        finally:
            conn.close()
        if watchdog.fired:
            raise ConfigError(f"the attestation exchange with {where} did not finish within {timeout:g} s (the "
                              "server stalled or dripped its answer)",
                              fix="check that `cvm-tune api serve` runs there and that nothing slow sits in between")
    if len(body) > MAX_DOC:
        raise ConfigError(f"{where} answered more than {MAX_DOC} bytes: too large for an attestation document",
                          fix="point at a cvm-tune training API")
    if resp.status != 200:
        raise ConfigError(f"{where} answered HTTP {resp.status} to the attestation request",
                          fix="point at a cvm-tune training API")
    try:
        doc = parse_json(body, "the attestation document", ValueError, max_bytes=MAX_DOC)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ConfigError(f"{where} did not answer a {SCHEMA} document", fix="point at a cvm-tune training API")
    return doc, der


def _mr_config(doc: dict[str, Any]) -> bytes | None:
    """The MrConfigV3 document a v3 MRCONFIGID is the hash of: the document's ``mr_config`` text, else the
    ``mr_config`` inside its ``vm_config`` (GetQuote's answer; dstack 0.6). Never trusted: it must hash to MRCONFIGID."""
    text = doc.get("mr_config")
    if not isinstance(text, str) and isinstance(doc.get("vm_config"), str):
        return getquote_mr_config(json.dumps({"vm_config": doc["vm_config"]}).encode())
    return text.encode() if isinstance(text, str) and text else None


def attest(url_text: str, *, policy_file: Path | None, out: Path, timeout: float = 60.0) -> int:
    """Check the server at ``url_text``; write its certificate to ``out`` when trusted. Returns the exit code.

    Raises:
        ConfigError: a bad URL, plain HTTP off loopback, or no attestation document (exit 2).
    """
    try:
        url = check_url(url_text, "the training API's URL")
    except ValueError as exc:
        raise ConfigError(str(exc), fix="pass the server's https:// URL, e.g. https://127.0.0.1:8443") from None
    policy = load_policy(policy_file)
    nonce = os.urandom(32)
    doc, der = _fetch(url, nonce, timeout)
    problems: list[str] = []
    spki = b""
    cert_pem = None
    if der is not None:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        try:
            cert_pem = x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)
        except ValueError:
            raise ConfigError(f"the certificate {url.geturl()} presented cannot be read",
                              fix="point at a cvm-tune training API") from None
        spki = spki_sha256(cert_pem)
        if doc.get("tls_spki_sha256") != spki.hex():
            problems.append("the certificate this connection presented is not the key the server attests (a man in "
                            "the middle, or TLS terminated outside the CVM)")
    if doc.get("nonce") != nonce.hex():
        problems.append("the document does not echo this request's nonce")
    try:
        events = event_log_from_json(doc.get("event_log") or "[]", source="attestation event_log")
        coll = parse_collateral(doc["collateral"]) if doc.get("collateral") else None
        verdict = quote_verdict(bytes.fromhex(str(doc.get("quote"))), policy=policy, now=int(time.time()),
                                collateral=coll, events=events, expected_report_data=report_data(nonce, spki))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"the attestation document is malformed: {exc}", fix="point at a cvm-tune training API") from None
    compose = str(doc.get("app_compose") or "").encode()
    measured = [e.payload.hex() for e in events if e.event == "compose-hash"]
    if not measured or measured[-1] != hashlib.sha256(compose).hexdigest():
        problems.append("the app-compose does not hash to the compose-hash the event log measured")
    elif verdict.findings.quote is not None and verdict.findings.boot is not None:
        boot = verdict.findings.boot
        bound, how = check_mr_config_id(verdict.findings.quote.td.mr_config_id, measured[-1], boot.hex("app-id"),
                                        boot.values.get("key-provider"), boot=boot, mr_config=_mr_config(doc))
        if not bound:
            problems.append(how)
    print(verdict.summary())
    for c in verdict.checks:
        if c.status != "pass":
            print(f"{c.status.upper()} {c.name}: {c.detail}")
    for p in problems:
        print(f"FAIL {p}")
    if not verdict.accepted or problems:
        print("NOT trusted: nothing written", file=sys.stderr)
        return EXIT_REJECTED
    compose_hash = measured[-1]
    if cert_pem is None:
        print(f"trusted (plain HTTP on loopback: no certificate to write); compose-hash {compose_hash[:16]}…")
        return 0
    atomic_write_bytes(out, cert_pem)
    trust = Path(out).absolute()  # the hint must hold after a `cd`
    print(f"trusted: compose-hash {compose_hash[:16]}…, TLS key {spki.hex()[:16]}…; wrote {trust}")
    print(f"use it: export SSL_CERT_FILE={trust} TINKER_BASE_URL={url_text.rstrip('/')}")
    return 0
