"""OpenSSF model signatures of the exported model directories, made with a key that only the CVM can derive.

The key is ECDSA P-256, one per run: derived from dstack ``GetKey`` at ``cvm-tune/model-signing/v1/runs/<run_id>``
(:func:`attestation.bundle.model_sig.run_key_path`; GetKey binds it to the app id, so nothing outside the deployment can
derive it, and two runs never share a key: a directory copied from another run fails the library's own check), then::

    scalar = HKDF-SHA256(ikm=GetKey bytes, salt=None, info=b"cvm-tune/model-signing/v1 P-256", length=48)
             mod (n - 1) + 1                       (n: the P-256 group order)

Signing is ``model_signing``'s key-based signer (the ``model_signing sign key`` of the library's CLI): a Sigstore
bundle ``<dir>/model.sig`` over the SHA-256 of every file in the directory. The public key goes into the manifest
(``signing.public_key_pem``), which the quote binds; anyone can check the signature with the library's own
``model_signing verify key`` and that public key. The private key never touches a file system: the library reads
its PEM from a path, so it gets a pipe's ``/proc/self/fd`` path, written and closed in this process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from attestation.bundle import manifest as B
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from app.errors import ExportError, KeySourceError

KEY_INFO = b"cvm-tune/model-signing/v1 P-256"
GETKEY_PURPOSE = "cvm-tune-model-signing"
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


def derive_key(get_key: Callable[[str, str], bytes], path: str) -> ec.EllipticCurvePrivateKey:
    """A model-signing key from GetKey(``path``) (a run's: :func:`attestation.bundle.model_sig.run_key_path`).

    Raises:
        KeySourceError: GetKey returned fewer than 32 bytes.
        TeeError: raised by ``get_key`` when the guest agent fails.
    """
    material = get_key(path, GETKEY_PURPOSE)
    if not isinstance(material, bytes | bytearray) or len(material) < 32:
        raise KeySourceError(f"GetKey({path}) returned no usable key material (need at least 32 bytes)")
    okm = HKDF(algorithm=hashes.SHA256(), length=48, salt=None, info=KEY_INFO).derive(bytes(material))
    return ec.derive_private_key(int.from_bytes(okm, "big") % (_P256_ORDER - 1) + 1, ec.SECP256R1())


def public_key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    """SubjectPublicKeyInfo PEM: what ``model_signing verify key --public_key`` reads."""
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def sign_dir(key: ec.EllipticCurvePrivateKey, directory: Path) -> Path:
    """Sign ``directory`` (every file but the signature) into ``directory/model.sig``.

    Raises:
        ExportError: the library failed to sign.
    """
    import model_signing  # sigstore stack: imported only when signing

    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, pem)  # < 1 KiB: fits the pipe buffer
        os.close(write_fd)
        write_fd = -1
        config = model_signing.signing.Config().use_elliptic_key_signer(private_key=f"/proc/self/fd/{read_fd}")
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
    signature = Path(directory) / B.SIGNATURE_NAME
    try:
        config.set_hashing_config(
            model_signing.hashing.Config().set_ignored_paths(paths=[B.SIGNATURE_NAME], ignore_git_paths=False)
        ).sign(Path(directory), signature)
    except (OSError, ValueError) as exc:
        raise ExportError(f"signing {directory} failed: {exc}", fix="report this: the model-signing library refused") from exc
    return signature
