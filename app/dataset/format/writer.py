"""Writing a dataset file: :func:`encrypt_stream` (bounded memory) and :func:`encrypt_file` (atomic)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from app.dataset.format.header import (
    ALG,
    CONTENT_TYPE,
    DEFAULT_CHUNK_SIZE,
    FORMAT_MAGIC,
    FORMAT_MAGIC_V2,
    KEY_CHECK_MESSAGE,
    MAX_HEADER_LEN,
    DatasetHeader,
    _check_key,
    _derive,
    _header_from_obj,
    _hmac,
    _nonce,
    _read_upto,
)
from app.errors import ConfigError, DataError, KeySourceError
from app.fsutil import fsync_dir
from attestation.dataset_sig import OwnerSignature, make_trailer, parse_trailer
from attestation.hashing import canonical_json


@dataclass(frozen=True)
class EncryptResult:
    """What :func:`encrypt_stream` wrote (sizes in bytes, SHA-256 as hex)."""

    header: DatasetHeader
    plaintext_size: int
    plaintext_sha256: str
    ciphertext_size: int
    ciphertext_sha256: str
    chunks: int
    signature: OwnerSignature | None = None  # version 2: the owner's signed statement


def _fresh_salt() -> bytes:
    return secrets.token_bytes(32)


def encrypt_stream(src: BinaryIO, dst: BinaryIO, key: bytes, *, dataset_id: str, dataset_version: int = 0,
                   chunk_size: int = DEFAULT_CHUNK_SIZE, metadata: dict | None = None,
                   content_type: str = CONTENT_TYPE, owner_key: Ed25519PrivateKey | None = None) -> EncryptResult:
    """Encrypt ``src`` to ``dst``, holding about two chunks in memory.

    Without ``owner_key`` the file is format version 1 (unsigned); with it, version 2: the same
    layout with per-version keys and the owner-signature trailer after the last chunk.

    Args:
        src: plaintext JSONL, read to end-of-file.
        dst: where the encrypted file is written (from its current position).
        key: the 32-byte dataset key.
        dataset_id: the dataset's name (stored in the clear).
        dataset_version: the owner's version number (stored in the clear).
        chunk_size: plaintext bytes per chunk (4096..16 MiB).
        metadata: extra ``{str: str | int}`` stored in the clear header.
        content_type: one of ``CONTENT_TYPES`` (default: a JSONL dataset).
        owner_key: the data owner's Ed25519 signing key (format version 2).

    Returns:
        Sizes, SHA-256 digests (the whole file, trailer included) and the chunk count of what
        was written, and the signature (version 2).

    Raises:
        KeySourceError: the key is not 32 bytes.
        ConfigError: a header parameter breaks a format rule.
    """
    _check_key(key)
    salt = _fresh_salt()
    obj: dict[str, Any] = {"alg": ALG, "chunk_size": chunk_size, "content_type": content_type,
                           "dataset_id": dataset_id, "dataset_version": dataset_version, "salt": salt.hex()}
    if metadata:
        obj["metadata"] = dict(metadata)
    header = _header_from_obj(obj, b"", ConfigError)
    raw = canonical_json(obj)
    if len(raw) > MAX_HEADER_LEN:
        raise ConfigError(f"the dataset header would be {len(raw)} bytes (max {MAX_HEADER_LEN}): shorten metadata")
    version = 1 if owner_key is None else 2
    header = dataclasses.replace(header, raw=raw, format_version=version)
    prefix = (FORMAT_MAGIC if version == 1 else FORMAT_MAGIC_V2) + len(raw).to_bytes(4, "big") + raw
    key_check = _hmac(_derive(key, salt, b"check", version), KEY_CHECK_MESSAGE).finalize()
    header_mac = _hmac(_derive(key, salt, b"header", version), prefix + key_check).finalize()
    aead = AESGCM(_derive(key, salt, b"payload", version))

    ct_hash, pt_hash = hashlib.sha256(), hashlib.sha256()
    written = 0

    def emit(data: bytes) -> None:
        nonlocal written
        ct_hash.update(data)
        view = memoryview(data)
        while view:  # a raw stream may write only part of the buffer
            n = dst.write(view)
            if n is None:
                raise BlockingIOError("the output stream is non-blocking and not ready")
            view = view[n:]
        written += len(data)

    emit(prefix + key_check + header_mac)
    index, plain_size = 0, 0
    cur = _read_upto(src, chunk_size)
    while True:
        nxt = _read_upto(src, chunk_size) if len(cur) == chunk_size else b""
        final = not nxt  # a full chunk followed by end-of-file is itself the final chunk
        pt_hash.update(cur)
        plain_size += len(cur)
        emit(aead.encrypt(_nonce(index, final), cur, header_mac))
        index += 1
        if final:
            break
        cur = nxt
    signature = None
    if owner_key is not None:
        trailer = make_trailer(owner_key, plaintext_size=plain_size, plaintext_sha256=pt_hash.digest(),
                               body_sha256=ct_hash.digest())
        signature = parse_trailer(trailer)
        emit(trailer)
    return EncryptResult(header=header, plaintext_size=plain_size, plaintext_sha256=pt_hash.hexdigest(),
                         ciphertext_size=written, ciphertext_sha256=ct_hash.hexdigest(), chunks=index,
                         signature=signature)


def encrypt_file(src: Path, dst: Path, key: bytes, **kw: Any) -> EncryptResult:
    """Encrypt the file ``src`` to ``dst`` atomically (temp file in dst's directory, fsync, rename).

    On any error the temp file is removed and an existing ``dst`` is left untouched. The new file
    has mode 0600 (``mkstemp``); the ciphertext is not secret, but its clear header may be.

    Args:
        src: the plaintext JSONL file.
        dst: the encrypted file to create or replace (its directory must exist).
        key: the 32-byte dataset key.
        **kw: ``dataset_id`` and the other keyword arguments of :func:`encrypt_stream`.

    Returns:
        As :func:`encrypt_stream`.

    Raises:
        KeySourceError: the key is not 32 bytes.
        ConfigError: bad header parameters, or ``dst`` is ``src``.
        DataError: reading ``src`` or writing ``dst`` failed (the OS error is chained).
    """
    src, dst = Path(src), Path(dst)
    _check_key(key)
    if dst.exists() and src.exists() and os.path.samefile(src, dst):
        raise ConfigError("the encrypted output would overwrite its own plaintext input", fix="choose another output path")
    tmp: str | None = None
    try:
        with open(src, "rb") as fin:
            fd, tmp = tempfile.mkstemp(prefix=f".tmp-{dst.name}-", dir=dst.parent)
            with os.fdopen(fd, "wb") as fout:
                result = encrypt_stream(fin, fout, key, **kw)
                fout.flush()
                os.fsync(fout.fileno())
        os.replace(tmp, dst)
        tmp = None
        fsync_dir(dst.parent)
    except OSError as exc:
        raise DataError(f"encrypting {src.name} to {dst} failed: {exc.strerror or type(exc).__name__}",
                        fix="check both paths, free space and permissions") from exc
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return result
