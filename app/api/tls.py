"""TLS that terminates inside the CVM, and the attestation that binds it.

The server's key is ECDSA P-256 derived from dstack ``GetKey`` at :data:`TLS_KEY_PATH` (bound to the app id: only
this app in a CVM can derive it; a gateway or a man in the middle cannot), with a self-signed certificate for
127.0.0.1, localhost and ``api.tls_names``. ``GET /api/v1/cvm_tune/attestation?nonce=HEX`` answers a quote whose
report_data is :func:`report_data` (nonce, SHA-256 of the certificate's SubjectPublicKeyInfo), the event log, the
app-compose and the certificate; ``cvm-tune api attest`` checks it (:mod:`app.api.attest`).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import ipaddress
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.api.errors import BadRequest

TLS_KEY_PATH = "cvm-tune/api-tls/v1"
REPORT_DATA_TAG = b"cvm-tune-api-attestation-v1"
SCHEMA = "cvm-tune/api-attestation/v1"


def report_data(nonce: bytes, spki_sha256: bytes) -> bytes:
    """``SHA-512(tag ":" nonce ":" SHA-256(SPKI DER))``: 64 bytes (``spki_sha256`` empty for plain HTTP)."""
    return hashlib.sha512(REPORT_DATA_TAG + b":" + nonce + b":" + spki_sha256).digest()


def spki_sha256(cert_pem: bytes) -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(cert_pem)
    return hashlib.sha256(cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)).digest()


@dataclass(frozen=True)
class TlsIdentity:
    key_pem: bytes
    cert_pem: bytes

    @property
    def spki_sha256(self) -> bytes:
        return spki_sha256(self.cert_pem)

    @contextlib.contextmanager
    def files(self) -> Iterator[tuple[str, str]]:
        """(key file, cert file) in a private temporary directory, removed when the block ends (uvicorn reads
        them once, at start)."""
        with tempfile.TemporaryDirectory(prefix="cvm-tune-tls-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
            key, cert = Path(d) / "key.pem", Path(d) / "cert.pem"
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(self.key_pem)
            cert.write_bytes(self.cert_pem)
            yield str(key), str(cert)


def tls_identity(agent: Any, names: tuple[str, ...]) -> TlsIdentity:
    """The GetKey-derived key and its self-signed certificate for 127.0.0.1, localhost and ``names``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    from app.export.signing import derive_key

    key = derive_key(agent.get_key, TLS_KEY_PATH)
    sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cvm-tune training API")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(key, hashes.SHA256()))
    return TlsIdentity(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()),
                       cert.public_bytes(serialization.Encoding.PEM))


def attestation(ag: Any, tls: TlsIdentity | None, nonce_hex: str, collateral: Any) -> dict[str, Any]:
    """The attestation document for ``nonce_hex`` (16 to 64 bytes, hex).

    Raises:
        BadRequest: the nonce is not 32 to 128 hex digits.
    """
    try:
        nonce = bytes.fromhex(nonce_hex)
    except ValueError:
        nonce = b""
    if not 16 <= len(nonce) <= 64:
        raise BadRequest("nonce must be 32 to 128 hex digits (16 to 64 random bytes)")
    spki = tls.spki_sha256 if tls else b""
    quote, event_log = ag.agent.quote(report_data(nonce, spki))
    mr_config = ag.agent.mr_config_document(quote)  # dstack 0.6 with a key provider: what MRCONFIGID v3 hashes
    return {"schema": SCHEMA, "nonce": nonce.hex(), "tls_spki_sha256": spki.hex() or None,
            "certificate_pem": tls.cert_pem.decode() if tls else None, "quote": quote.hex(), "event_log": event_log,
            "app_compose": ag.ident.app_compose, "collateral": collateral(quote),
            **({"mr_config": mr_config.decode()} if mr_config else {})}


# What OpenSSL reports on the server when the client ends the handshake because it does not trust the certificate.
REFUSED = frozenset({"TLSV1_ALERT_UNKNOWN_CA", "SSLV3_ALERT_BAD_CERTIFICATE", "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
                     "TLSV1_ALERT_ACCESS_DENIED", "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE"})


def log_refused_handshakes(context: Any, log: Any, url: str, *, every_s: float = 10.0) -> None:
    """Say so when a client refuses this server's certificate: an SDK that does not trust it retries for minutes
    without a word, and the event loop keeps failed handshakes to its debug log. ``context`` is the server's
    ``ssl.SSLContext``: its TLS objects (asyncio's and uvloop's alike wrap every connection with
    ``context.wrap_bio``) report such a handshake once per ``every_s`` seconds at most, naming the fix."""
    import ssl
    import time

    last = [-every_s]

    class Watched(ssl.SSLObject):
        def do_handshake(self) -> None:
            try:
                super().do_handshake()
            except ssl.SSLError as exc:
                now = time.monotonic()
                if getattr(exc, "reason", None) in REFUSED and now - last[0] >= every_s:
                    last[0] = now
                    log(f"TLS: a client refused this server's certificate ({exc.reason}): it does not trust it — "
                        f"run `cvm-tune api attest {url} --policy POLICY.yaml -o trust.pem` and point SSL_CERT_FILE "
                        "at that file")
                raise

    context.sslobject_class = Watched
