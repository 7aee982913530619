"""TLS that terminates inside the CVM, and the attestation that binds it.

The server's key is ECDSA P-256 derived from dstack ``GetKey`` at :data:`TLS_KEY_PATH` (bound to the app id: only
this app in a CVM can derive it; a gateway or a man in the middle cannot), with a self-signed certificate for
127.0.0.1, localhost and ``api.tls_names``. ``GET /api/v1/cvm_tune/attestation?nonce=HEX`` answers a quote whose
report_data is :func:`report_data` (nonce, SHA-256 of the certificate's SubjectPublicKeyInfo), the event log, the
app-compose and the certificate; ``cvm-tune api attest`` checks it (:mod:`app.api.http.attest`).

The key and its certificate are a sealed object (:func:`tls_identity`), so both survive restarts and KMS key
rotations (``app.keys_epoch``) and a client's pinned certificate stays valid: the first start derives the key and
issues the certificate, and seals both (AES-256-GCM under HKDF of ``GetKey(`` :data:`SEAL_KEY_PATH` ``)``) into
``<output>/api/tls/`` with the key epochs they were sealed under (``key-epochs.json``); later starts open it, after a
rotation with the old epoch's key, and re-seal it under the current epochs (staged, then swapped in: a kill
half-way leaves the old or the new copy). An agent that ignores GetKey's epoch selectors is
:class:`~app.keys_epoch.KeyEpochError`, with nothing overwritten. A certificate is issued again (same key) only when
``api.tls_names`` changed or it expires within :data:`RENEW_S`.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import ipaddress
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.api.errors import BadRequest

TLS_KEY_PATH = "cvm-tune/api-tls/v1"
SEAL_KEY_PATH, SEAL_PURPOSE = "cvm-tune/api-tls-seal/v1", "cvm-tune-api-tls-seal-key"
SEALED_DIR, SEALED_FILE = "tls", "identity.sealed"  # <output>/api/tls/identity.sealed (+ key-epochs.json)
SEAL_TAG = b"cvm-tune/api-tls-identity/v1\n"  # the file's first bytes, and the AEAD's associated data
RENEW_S = 30 * 86400  # a sealed certificate expiring within this is issued again (same key)
REMOVE_FIX = ("restore {home} from a backup of the output volume, or remove it: the next start derives the key "
              "again, and clients run `cvm-tune api attest` again if it differs")
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


def tls_identity(agent: Any, names: tuple[str, ...], state_dir: Path) -> TlsIdentity:
    """The sealed TLS key and certificate under ``state_dir/tls`` (``state_dir``: the API's ``<output>/api``), made
    on the first start: the GetKey-derived key and a self-signed certificate for 127.0.0.1, localhost and ``names``.

    Raises:
        KeyEpochError: sealed under older key epochs and this agent ignores GetKey's selectors (nothing changed).
        StateError: the sealed identity does not open (changed, or sealed by another app; nothing changed).
        TeeError, KeySourceError: GetKey failed.
    """
    home = Path(state_dir) / SEALED_DIR
    keys = _seal_keys(agent)
    _recover(home)
    found = _open(home, keys) if home.exists() else None
    if found is None:
        from app.export.signing import derive_key

        ident = _issue(derive_key(agent.get_key, TLS_KEY_PATH), names)
    else:
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        ident = found[0] if _fits(found[0], names) else _issue(load_pem_private_key(found[0].key_pem, None), names)
    if found is None or ident != found[0] or keys.stale(found[1]):
        _store(home, ident, keys)
    return ident


def _sans(names: tuple[str, ...]) -> list[Any]:
    from cryptography import x509

    sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    return sans


def _issue(key: Any, names: tuple[str, ...]) -> TlsIdentity:
    """A self-signed certificate of ``key`` for 127.0.0.1, localhost and ``names``, valid for a year."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cvm-tune training API")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName(_sans(names)), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(key, hashes.SHA256()))
    return TlsIdentity(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()),
                       cert.public_bytes(serialization.Encoding.PEM))


def _fits(ident: TlsIdentity, names: tuple[str, ...]) -> bool:
    """Whether the sealed certificate still serves: the same names, and not expiring within :data:`RENEW_S`."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(ident.cert_pem)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    left = cert.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc)
    return set(sans) == set(_sans(names)) and left.total_seconds() > RENEW_S


# ------------------------------------------------------------------------------------- the sealed identity on disk
def _seal_keys(agent: Any) -> Any:
    """The sealing key across key epochs (``EpochKeys``), or one epoch-less key for a stand-in agent (tests)."""
    from app.dataset import DerivedKeySource
    from app.dataset.keys import derive_key
    from app.keys_epoch import EpochKeys, FixedKey
    from app.tee import GuestAgent

    if isinstance(agent, GuestAgent):
        return EpochKeys(agent, SEAL_KEY_PATH, SEAL_PURPOSE, derive_key)
    return FixedKey(DerivedKeySource(agent.get_key, SEAL_KEY_PATH, SEAL_PURPOSE).dataset_key())


def _recover(home: Path) -> None:
    """Finish or undo a swap a kill interrupted, and drop a stage it left (the sealed copy in place is intact)."""
    from app.training.sealed import SWAP_SUFFIX

    old = home.with_name(home.name + SWAP_SUFFIX)
    if old.is_dir():
        if (home / SEALED_FILE).is_file():
            shutil.rmtree(old, ignore_errors=True)
        elif not home.exists():
            os.rename(old, home)
    for stage in home.parent.glob(f".tmp-*{home.name}-*") if home.parent.is_dir() else []:  # ours, staged_dir's
        shutil.rmtree(stage, ignore_errors=True)


def _open(home: Path, keys: Any) -> tuple[TlsIdentity, Any]:
    """The sealed identity and the epochs it records, opened with the key of those epochs.

    Raises:
        KeyEpochError: that key cannot be had from this agent. StateError: no candidate key opens it.
    """
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from app.errors import StateError
    from app.keys_epoch import KeyEpochError, read_epochs

    recorded = read_epochs(home)
    try:
        blob = (home / SEALED_FILE).read_bytes()
    except OSError as exc:
        raise StateError(f"cannot read the sealed TLS identity {home / SEALED_FILE}: {exc.strerror or exc}",
                         fix=REMOVE_FIX.format(home=home)) from None
    nonce, sealed = blob[len(SEAL_TAG):len(SEAL_TAG) + 12], blob[len(SEAL_TAG) + 12:]
    unseen = keys.current_epochs is None and recorded is not None  # an agent that reports no epochs
    for key, _epochs in [(keys.current, None)] if unseen else keys.candidates(recorded):
        try:
            doc = json.loads(AESGCM(key).decrypt(nonce, sealed, SEAL_TAG)) if blob.startswith(SEAL_TAG) else None
        except InvalidTag:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("key_pem"), str) and isinstance(doc.get("cert_pem"), str):
            return TlsIdentity(doc["key_pem"].encode(), doc["cert_pem"].encode()), recorded
    if unseen:
        raise KeyEpochError(f"the API's TLS key was sealed under {recorded} and does not open with the key this guest "
                            "agent gives; the agent reports no key epochs, so it cannot be asked for that epoch's key "
                            "(it ignores GetKey's epoch selectors: dstack guest 0.6.5 / 0.5.15 or older)")
    raise StateError(f"the sealed TLS identity {home / SEALED_FILE} does not open with this app's key: it was "
                     "changed, or sealed by another app", fix=REMOVE_FIX.format(home=home))


def _store(home: Path, ident: TlsIdentity, keys: Any) -> None:
    """Seal ``ident`` under the current key into ``home`` (with the current epochs): staged complete under a temp
    name, then renamed into place or swapped in (``app.training.sealed.swap_in``)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from app.fsutil import fsync_dir, staged_dir
    from app.keys_epoch import write_epochs
    from app.training.sealed import swap_in

    nonce = os.urandom(12)
    doc = json.dumps({"key_pem": ident.key_pem.decode(), "cert_pem": ident.cert_pem.decode()}).encode()
    stage = home.with_name(f".tmp-{home.name}-{nonce.hex()}")
    with staged_dir(stage) as tmp:
        fd = os.open(tmp / SEALED_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(SEAL_TAG + nonce + AESGCM(keys.current).encrypt(nonce, doc, SEAL_TAG))
        write_epochs(tmp, keys.current_epochs)
    if home.exists():
        swap_in(stage, home)  # a kill before it leaves the stage, which the next start removes
    else:
        os.rename(stage, home)
        fsync_dir(home.parent)


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
