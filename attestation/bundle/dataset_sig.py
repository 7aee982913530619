"""The data owner's signature on an encrypted dataset: the trailer of dataset format version 2.

A version-2 dataset file (``app.dataset.format``) ends in a fixed 176-byte trailer:

| field              | size | content |
|--------------------|------|---------|
| `magic`            | 8    | `b"CVMTDSIG"` |
| `owner_public_key` | 32   | the owner's Ed25519 public key (raw) |
| `plaintext_size`   | 8    | u64 big-endian: bytes of JSONL plaintext |
| `plaintext_sha256` | 32   | SHA-256 of the JSONL plaintext |
| `body_sha256`      | 32   | SHA-256 of every file byte before the trailer (magic, header, key check, header MAC, chunks) |
| `signature`        | 64   | `Ed25519(owner key, "cvm-tune/dataset-signature/v2" ‖ 0x00 ‖ statement)` |

The **statement** is the first 112 bytes. The dataset **commitment** is ``SHA-256(statement)``: it
names the header (dataset id and version), the ciphertext and the plaintext at once. The **owner
key id** is ``SHA-256(owner_public_key)`` in hex.

Shared by the app (which checks the signature against the owner key pinned in its config before it
uses the dataset key) and the verifier (which re-checks a dataset file against a bundle's manifest
without any key). Standard library and ``cryptography`` only.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

TRAILER_MAGIC = b"CVMTDSIG"
STATEMENT_LEN = 8 + 32 + 8 + 32 + 32
TRAILER_LEN = STATEMENT_LEN + 64
SIGNATURE_DOMAIN = b"cvm-tune/dataset-signature/v2\x00"
_READ = 1 << 20


class TrailerError(ValueError):
    """The trailer is missing, malformed or its signature does not verify (message names which)."""


def owner_key_id(public_key: bytes) -> str:
    """The owner key id: hex SHA-256 of the raw 32-byte Ed25519 public key."""
    return hashlib.sha256(public_key).hexdigest()


def public_key_bytes(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    """The raw 32-byte public key of an Ed25519 key."""
    from cryptography.hazmat.primitives import serialization

    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass(frozen=True)
class OwnerSignature:
    """A parsed trailer whose signature verified under ``owner_public_key`` (the key it names)."""

    owner_public_key: bytes
    plaintext_size: int
    plaintext_sha256: str
    body_sha256: str
    statement: bytes
    signature: bytes

    @property
    def owner_key_id(self) -> str:
        return owner_key_id(self.owner_public_key)

    @property
    def commitment(self) -> str:
        """Hex SHA-256 of the signed statement."""
        return hashlib.sha256(self.statement).hexdigest()

    @property
    def trailer(self) -> bytes:
        return self.statement + self.signature


def make_trailer(private_key: Ed25519PrivateKey, *, plaintext_size: int, plaintext_sha256: bytes,
                 body_sha256: bytes) -> bytes:
    """Sign a statement and return the 176-byte trailer."""
    if len(plaintext_sha256) != 32 or len(body_sha256) != 32 or not 0 <= plaintext_size < 1 << 64:
        raise ValueError("digests must be 32 bytes and the size a u64")
    statement = (TRAILER_MAGIC + public_key_bytes(private_key) + plaintext_size.to_bytes(8, "big")
                 + plaintext_sha256 + body_sha256)
    return statement + private_key.sign(SIGNATURE_DOMAIN + statement)


def parse_trailer(raw: bytes) -> OwnerSignature:
    """Parse a trailer and verify its signature under the public key it carries.

    Raises:
        TrailerError: wrong length or magic, or the signature does not verify.
    """
    if len(raw) != TRAILER_LEN or raw[:8] != TRAILER_MAGIC:
        raise TrailerError("no owner-signature trailer at the end of the file")
    statement, signature = raw[:STATEMENT_LEN], raw[STATEMENT_LEN:]
    pub = statement[8:40]
    try:
        Ed25519PublicKey.from_public_bytes(pub).verify(signature, SIGNATURE_DOMAIN + statement)
    except (InvalidSignature, ValueError):
        raise TrailerError("the owner signature does not verify (the signed statement or signature was modified)") from None
    return OwnerSignature(owner_public_key=pub, plaintext_size=int.from_bytes(statement[40:48], "big"),
                          plaintext_sha256=statement[48:80].hex(), body_sha256=statement[80:112].hex(),
                          statement=statement, signature=signature)


@dataclass(frozen=True)
class SignedFile:
    """What :func:`read_signed_file` found: the verified trailer, the recomputed body hash and the clear header."""

    signature: OwnerSignature
    body_sha256: str
    file_sha256: str
    header: dict


def read_signed_file(path: Path) -> SignedFile:
    """Check a version-2 dataset file without its key: trailer signature, body hash, clear header.

    The body hash is recomputed by streaming the file (bounded memory). The header is parsed but
    not authenticated here (the dataset key does that); it is covered by the signed body hash.

    Raises:
        TrailerError: not a version-2 file, no or a bad trailer, the body differs from what was
            signed, or an unreadable header.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as fh:
        head = fh.read(12)
        if head[:8] != b"CVMTDS\x00\x02":
            raise TrailerError("not a signed (format version 2) cvm-tune dataset")
        size = os.fstat(fh.fileno()).st_size
        if size < 12 + TRAILER_LEN:
            raise TrailerError("the file is too short to hold an owner-signature trailer")
        header_len = int.from_bytes(head[8:12], "big")
        raw_header = fh.read(min(header_len, 65536))
        try:
            header = json.loads(raw_header)
        except ValueError:
            header = None
        if not isinstance(header, dict):
            raise TrailerError("the dataset header is not a JSON object")
        fh.seek(size - TRAILER_LEN)
        signature = parse_trailer(fh.read(TRAILER_LEN))
        fh.seek(0)
        body, whole, left = hashlib.sha256(), None, size - TRAILER_LEN
        while left and (block := fh.read(min(_READ, left))):
            body.update(block)
            left -= len(block)
        whole = body.copy()
        whole.update(signature.trailer)
    if body.hexdigest() != signature.body_sha256:
        raise TrailerError("the file's content differs from what the owner signed (body hash mismatch)")
    return SignedFile(signature=signature, body_sha256=body.hexdigest(), file_sha256=whole.hexdigest(), header=header)
