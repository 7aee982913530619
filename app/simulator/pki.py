"""Deterministic throwaway test PKI: synthetic TDX quotes and DCAP collateral for the simulator.

Follows ``shared/reference/attestation.md`` §8. A real TDX v4 quote supplies the header, TD body,
QE report and QE auth data; a test root CA, PCK platform CA, PCK leaf (carrying the real leaf's
SGX extension, so FMSPC / PCE-ID / CPUSVN still match the real TCB info), TCB signer and
attestation key then re-sign everything. ``dcap_qvl.verify_with_root_ca`` accepts the result
with the test root; ``dcap_qvl.verify`` (Intel root) rejects it.

Every key is derived from the simulator secret with HKDF, every certificate and CRL uses fixed
serials and a fixed 2020..2099 validity and is signed with deterministic ECDSA (RFC 6979), so one
secret always yields byte-identical roots, collateral and quotes. None of this is secret: the
certificates say ``TEST ONLY`` in their subjects and must never be trusted outside tests.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import struct
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import NameOID

NOT_BEFORE = dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc)
NOT_AFTER = dt.datetime(2099, 1, 1, tzinfo=dt.timezone.utc)
COLLATERAL_ISSUE_DATE = "2020-01-01T00:00:00Z"
COLLATERAL_NEXT_UPDATE = "2099-01-01T00:00:00Z"
SGX_EXTENSION_OID = x509.ObjectIdentifier("1.2.840.113741.1.13.1")
TEST_ORG = "cvm-tune TEST ONLY"
_HKDF_SALT = b"cvm-tune dstack simulator v1"
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551

# TDX quote v4 layout (attestation.md §4): header 48 + TD1.0 body 584 = 632 signed bytes.
HEADER_BODY_LEN = 632
_SIG_DATA = 636  # after u32 signature-data length
_QE_REPORT = 770  # after quote sig (64), attestation key (64), cert type u16, size u32
_QE_REPORT_LEN = 384
_QE_AUTH_LEN = 1218


def derive_secret_bytes(secret: bytes, label: str, length: int = 32) -> bytes:
    """HKDF-SHA256 expansion of the simulator secret under a distinct label.

    Args:
        secret: the simulator's 32-byte root secret.
        label: a unique, stable purpose label (changing it changes every derived value).
        length: output length in bytes.

    Returns:
        ``length`` pseudo-random bytes, a pure function of ``(secret, label)``.
    """
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=_HKDF_SALT, info=label.encode()).derive(secret)


def derive_p256_key(secret: bytes, label: str) -> ec.EllipticCurvePrivateKey:
    """A deterministic P-256 private key for ``label``.

    Forty-eight HKDF bytes are reduced into ``[1, n-1]`` so the bias is negligible and no
    derivation can fail.
    """
    scalar = int.from_bytes(derive_secret_bytes(secret, label, 48), "big") % (_P256_ORDER - 1) + 1
    return ec.derive_private_key(scalar, ec.SECP256R1())


def raw_signature(key: ec.EllipticCurvePrivateKey, data: bytes) -> bytes:
    """Deterministic ECDSA-P256-SHA256 over ``data`` as the 64-byte raw ``r || s`` DCAP uses."""
    r, s = decode_dss_signature(key.sign(data, ec.ECDSA(hashes.SHA256(), deterministic_signing=True)))
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def public_xy(key: ec.EllipticCurvePrivateKey) -> bytes:
    """The 64-byte ``x || y`` encoding of a P-256 public key (quote attestation-key format)."""
    point = key.public_key().public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    return point[1:]


def testca_name(common_name: str) -> x509.Name:
    """``O=cvm-tune TEST ONLY, CN=<common_name>``: every simulator certificate says it is a test."""
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, TEST_ORG), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def issue_certificate(
    *,
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    serial: int,
    ca_path_length: int | None,
    extensions: tuple[x509.ExtensionType, ...] = (),
    not_before: dt.datetime = NOT_BEFORE,
    not_after: dt.datetime = NOT_AFTER,
) -> x509.Certificate:
    """Issue an X.509 v3 certificate signed deterministically by ``issuer_key``.

    Args:
        ca_path_length: ``None`` for an end-entity certificate (digitalSignature only); an int
            for a CA (keyCertSign + cRLSign) with that path length.
        extensions: extra non-critical extensions (e.g. the copied SGX extension, EKUs, SANs).

    Returns:
        The certificate, with SubjectKeyIdentifier and AuthorityKeyIdentifier (webpki wants both).
    """
    is_ca = ca_path_length is not None
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(serial)
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=ca_path_length), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=not is_ca,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=is_ca,
                crl_sign=is_ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
        )
    )
    for ext in extensions:
        builder = builder.add_extension(ext, critical=False)
    return builder.sign(issuer_key, hashes.SHA256(), ecdsa_deterministic=True)


def _empty_crl(issuer: x509.Certificate, issuer_key: ec.EllipticCurvePrivateKey) -> bytes:
    # webpki runs with UnknownStatusPolicy::Deny, so both CRLs must exist even though empty.
    crl = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(issuer.subject)
        .last_update(NOT_BEFORE)
        .next_update(NOT_AFTER)
        .add_extension(x509.CRLNumber(1), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
        .sign(issuer_key, hashes.SHA256(), ecdsa_deterministic=True)
    )
    return crl.public_bytes(serialization.Encoding.DER)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class DcapTestPki:
    """The five DCAP test keys, their certificates and CRLs (attestation.md §8 steps 1-3)."""

    att_key: ec.EllipticCurvePrivateKey
    pck_leaf_key: ec.EllipticCurvePrivateKey
    tcb_key: ec.EllipticCurvePrivateKey
    root_cert: x509.Certificate
    pck_ca_cert: x509.Certificate
    pck_leaf_cert: x509.Certificate
    tcb_cert: x509.Certificate
    root_crl_der: bytes
    pck_crl_der: bytes

    @classmethod
    def build(cls, secret: bytes, sgx_extension: x509.UnrecognizedExtension) -> DcapTestPki:
        """Derive the whole PKI from ``secret``.

        Args:
            secret: the simulator secret.
            sgx_extension: the SGX extension of the base quote's real PCK leaf, copied verbatim.
        """
        keys = {name: derive_p256_key(secret, f"dcap/{name}") for name in ("root", "pck-ca", "pck-leaf", "tcb", "att")}
        root_name = testca_name("cvm-tune dstack simulator TEST SGX Root CA")
        root = issue_certificate(
            subject=root_name, public_key=keys["root"].public_key(), issuer=root_name,
            issuer_key=keys["root"], serial=1, ca_path_length=1,
        )
        # "Platform" in the CN mirrors Intel's naming, which dcap-qvl uses to tell the CA type.
        pck_ca = issue_certificate(
            subject=testca_name("cvm-tune dstack simulator TEST SGX PCK Platform CA"),
            public_key=keys["pck-ca"].public_key(), issuer=root_name, issuer_key=keys["root"],
            serial=2, ca_path_length=0,
        )
        leaf = issue_certificate(
            subject=testca_name("cvm-tune dstack simulator TEST SGX PCK Certificate"),
            public_key=keys["pck-leaf"].public_key(), issuer=pck_ca.subject, issuer_key=keys["pck-ca"],
            serial=3, ca_path_length=None, extensions=(sgx_extension,),
        )
        tcb = issue_certificate(
            subject=testca_name("cvm-tune dstack simulator TEST SGX TCB Signing"),
            public_key=keys["tcb"].public_key(), issuer=root_name, issuer_key=keys["root"],
            serial=4, ca_path_length=None,
        )
        return cls(
            att_key=keys["att"], pck_leaf_key=keys["pck-leaf"], tcb_key=keys["tcb"],
            root_cert=root, pck_ca_cert=pck_ca, pck_leaf_cert=leaf, tcb_cert=tcb,
            root_crl_der=_empty_crl(root, keys["root"]), pck_crl_der=_empty_crl(pck_ca, keys["pck-ca"]),
        )

    @property
    def root_der(self) -> bytes:
        """DER of the test root CA (what ``verify_with_root_ca`` takes)."""
        return self.root_cert.public_bytes(serialization.Encoding.DER)

    def sign_quote(self, header_body: bytes, qe_report: bytes, qe_auth: bytes) -> bytes:
        """Assemble and sign a v4 quote (attestation.md §8 steps 4-7).

        Args:
            header_body: the 632 bytes of header + TD report body, already patched.
            qe_report: the base quote's 384-byte QE report (its REPORTDATA is rebound here).
            qe_auth: the base quote's QE authentication data.

        Returns:
            The complete quote, without trailing padding.

        Raises:
            ValueError: wrong input sizes.
        """
        if len(header_body) != HEADER_BODY_LEN or len(qe_report) != _QE_REPORT_LEN:
            raise ValueError("header/body must be 632 bytes and the QE report 384 bytes")
        att_xy = public_xy(self.att_key)
        # The QE report vouches for the attestation key: REPORTDATA = sha256(att_key || auth) || 0*32.
        report = qe_report[:320] + hashlib.sha256(att_xy + qe_auth).digest() + bytes(32)
        pem_chain = _pem(self.pck_leaf_cert) + _pem(self.pck_ca_cert) + _pem(self.root_cert) + b"\0"
        inner = struct.pack("<HI", 5, len(pem_chain)) + pem_chain
        cert6 = report + raw_signature(self.pck_leaf_key, report) + struct.pack("<H", len(qe_auth)) + qe_auth + inner
        sig_data = raw_signature(self.att_key, header_body) + att_xy + struct.pack("<HI", 6, len(cert6)) + cert6
        return header_body + struct.pack("<I", len(sig_data)) + sig_data

    def collateral(self, tcb_info_raw: str, qe_identity_raw: str) -> str:
        """dcap-qvl ``QuoteCollateralV3`` JSON signed by the test TCB signer (§8 step 8).

        The validity dates are widened to 2020..2099 and each object is serialised once
        (compact, key order kept) and signed over exactly those bytes.
        """
        signed: dict[str, str] = {}
        for field, raw in (("tcb_info", tcb_info_raw), ("qe_identity", qe_identity_raw)):
            obj = json.loads(raw)
            obj["issueDate"] = COLLATERAL_ISSUE_DATE
            obj["nextUpdate"] = COLLATERAL_NEXT_UPDATE
            text = json.dumps(obj, separators=(",", ":"))
            signed[field] = text
            signed[field + "_signature"] = raw_signature(self.tcb_key, text.encode()).hex()
        tcb_chain = (_pem(self.tcb_cert) + _pem(self.root_cert)).decode()
        # No pck_certificate_chain: it would override the chain embedded in the quote.
        return json.dumps(
            {
                "pck_crl_issuer_chain": (_pem(self.pck_ca_cert) + _pem(self.root_cert)).decode(),
                "root_ca_crl": self.root_crl_der.hex(),
                "pck_crl": self.pck_crl_der.hex(),
                "tcb_info_issuer_chain": tcb_chain,
                "tcb_info": signed["tcb_info"],
                "tcb_info_signature": signed["tcb_info_signature"],
                "qe_identity_issuer_chain": tcb_chain,
                "qe_identity": signed["qe_identity"],
                "qe_identity_signature": signed["qe_identity_signature"],
            },
            indent=2,
        )


@dataclass(frozen=True)
class BaseQuote:
    """The pieces of a real v4 TDX quote that synthetic quotes reuse."""

    header_body: bytes
    qe_report: bytes
    qe_auth: bytes
    sgx_extension: x509.UnrecognizedExtension

    @classmethod
    def parse(cls, raw: bytes) -> BaseQuote:
        """Split a real quote (header/body, QE report, QE auth data, PCK leaf SGX extension).

        Raises:
            ValueError: not a v4 TDX quote with QE-report certification data and a PEM chain.
        """
        version, key_type, tee_type = struct.unpack_from("<HHI", raw, 0)
        if (version, key_type, tee_type) != (4, 2, 0x81) or len(raw) < _QE_AUTH_LEN + 2:
            raise ValueError("base quote must be a TDX v4 ECDSA-P256 quote")
        cert_type = struct.unpack_from("<H", raw, _SIG_DATA + 128)[0]
        if cert_type != 6:
            raise ValueError(f"base quote certification data type {cert_type}, expected 6 (QE report)")
        auth_len = struct.unpack_from("<H", raw, _QE_AUTH_LEN)[0]
        auth_end = _QE_AUTH_LEN + 2 + auth_len
        inner_type, pem_len = struct.unpack_from("<HI", raw, auth_end)
        if inner_type != 5:
            raise ValueError(f"base quote inner certification data type {inner_type}, expected 5 (PEM chain)")
        pem = raw[auth_end + 6 : auth_end + 6 + pem_len].rstrip(b"\0")
        leaf = x509.load_pem_x509_certificates(pem)[0]
        ext = leaf.extensions.get_extension_for_oid(SGX_EXTENSION_OID).value
        if not isinstance(ext, x509.UnrecognizedExtension):
            raise ValueError("unexpected SGX extension type in the base quote's PCK leaf")
        return cls(
            header_body=raw[:HEADER_BODY_LEN],
            qe_report=raw[_QE_REPORT : _QE_REPORT + _QE_REPORT_LEN],
            qe_auth=raw[_QE_AUTH_LEN + 2 : auth_end],
            sgx_extension=ext,
        )


@dataclass(frozen=True)
class KmsTestCa:
    """Test stand-ins for the KMS root CA and the app CA below it (``dstack.md`` §5.1, §5.3)."""

    root_spki: bytes
    app_cert_pem: str

    @classmethod
    def build(cls, secret: bytes, app_id: bytes) -> KmsTestCa:
        """Derive the KMS root CA (its SPKI hex is the ``key-provider`` id) and Info's ``app_cert``.

        ``app_cert`` mirrors the real agent's demo client certificate: the PEM chain
        ``leaf, app CA, KMS root`` joined with newlines.
        """
        root_key = derive_p256_key(secret, "kms/root-ca")
        root_name = testca_name("cvm-tune dstack simulator TEST KMS Root CA")
        root = issue_certificate(
            subject=root_name, public_key=root_key.public_key(), issuer=root_name, issuer_key=root_key,
            serial=10, ca_path_length=1,
        )
        ca_key = derive_p256_key(secret, "kms/app-ca/" + app_id.hex())
        ca = issue_certificate(
            subject=testca_name("cvm-tune TEST App CA " + app_id.hex()),
            public_key=ca_key.public_key(), issuer=root_name, issuer_key=root_key, serial=11, ca_path_length=0,
        )
        demo_key = derive_p256_key(secret, "app/demo-cert/" + app_id.hex())
        demo = issue_certificate(
            subject=testca_name("demo-cert"), public_key=demo_key.public_key(), issuer=ca.subject, issuer_key=ca_key,
            serial=12, ca_path_length=None, extensions=(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.CLIENT_AUTH]),),
        )
        spki = root_key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return cls(root_spki=spki, app_cert_pem="\n".join(_pem(c).decode() for c in (demo, ca, root)))
