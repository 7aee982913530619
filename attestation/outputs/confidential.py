"""Confidential outputs: weight files written only as age v1 ciphertext, and the manifest's ``confidentiality``.

A run on a dataset whose owner-signed header names age X25519 recipients (or with ``export.recipients``) writes every
weight file of its bundle (``*.safetensors`` under ``adapter/`` and ``merged/``) as age v1 ciphertext to those
recipients plus the CVM's own key, named as age's own tools name ciphertext: the file's name plus ``.age``
(``adapter/adapter_model.safetensors.age``), so nothing that parses safetensors mistakes it for weights and
``age -d`` gives back the original file. The manifest's ``files`` list and hash the ciphertext under that name (so
anyone can check it); ``confidentiality.plaintext_sha256`` hashes the plaintext under the original name (a
recipient checks it after decrypting in memory); the model signature covers the plaintext, under the original names
(``attestation.bundle.confidential``). A bundle never holds a weight file under both names.

The CVM's key is an age X25519 identity derived from dstack GetKey at :data:`CVM_KEY_PATH`::

    secret   = HKDF-SHA256(ikm=GetKey(CVM_KEY_PATH) bytes, salt=None, info=CVM_KEY_INFO, length=32)
    identity = Bech32("age-secret-key-", secret).upper()      (BIP-173 Bech32, not Bech32m: the age spec)

pyrage builds identities only from strings, so :func:`identity_from_secret` encodes the 32 bytes itself (BIP-173's
reference algorithm, a dozen lines). Nothing here imports torch or the app: the verifier uses it too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import pyrage
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from attestation.errors import AttestationError
from attestation.io.hashing import read_regular

SCHEME = "age-v1/x25519"
CVM_KEY_PATH = "cvm-tune/outputs/v1"
CVM_KEY_INFO = b"cvm-tune/outputs/v1 age-x25519"
AGE_MAGIC = b"age-encryption.org/v1\n"
RECIPIENT = r"age1[02-9ac-hj-np-z]{58}"
DATASET_META_KEY = "cvm-tune.recipients"  # the owner-signed header's metadata entry: recipients, space-separated
MAX_RECIPIENTS = 16
WEIGHT_SUFFIX = ".safetensors"
AGE_SUFFIX = ".age"  # an encrypted weight file's name: the plaintext's name + .age
ENCRYPTED_DIRS = ("adapter", "merged")
_RECIPIENT = re.compile(RECIPIENT)
_CHARSET = "qpzry9x8gf2tvdw0s3jn54khce6mua7l"
_HEADER_LIMIT = 1 << 16


class IdentityError(AttestationError):
    """An identity file holds no age X25519 identity (``AGE-SECRET-KEY-1…``)."""

    default_fix = ("pass an age identity file: `cvm-tune keys age -o KEY` writes one (as age-keygen does: one "
                   "AGE-SECRET-KEY-1… line; comments allowed)")


class ConfidentialityInfo(BaseModel):
    """The manifest's ``confidentiality``: who can read the weight files, and the plaintext each one binds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    scheme: Literal["age-v1/x25519"] = SCHEME
    # the owner's, the operator's, the CVM's and (secure aggregation) the aggregator's
    recipients: tuple[str, ...] = Field(min_length=1, max_length=2 * MAX_RECIPIENTS + 2)
    dataset_recipients: tuple[str, ...] = ()
    cvm_recipient: str = Field(pattern=rf"^{RECIPIENT}$")
    cvm_key_path: str = CVM_KEY_PATH
    plaintext_sha256: dict[str, str] = Field(min_length=1)

    @field_validator("recipients", "dataset_recipients")
    @classmethod
    def _recipients(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if bad := [r for r in v if not _RECIPIENT.fullmatch(r)]:
            raise ValueError(f"not age X25519 recipients: {bad[:3]}")
        if list(v) != sorted(set(v)):
            raise ValueError("recipients must be sorted and unique")
        return v

    @field_validator("plaintext_sha256")
    @classmethod
    def _hashes(cls, v: dict[str, str]) -> dict[str, str]:
        for path, digest in v.items():
            if not is_weight_file(path) or not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ValueError(f"plaintext_sha256 must map weight files to SHA-256 hex, not {path!r}")
        return v

    @model_validator(mode="after")
    def _cvm_listed(self) -> ConfidentialityInfo:
        if self.cvm_recipient not in self.recipients:
            raise ValueError("the CVM's recipient must be among the recipients")
        return self


def is_weight_file(rel: str) -> bool:
    """A bundle path the confidential export encrypts: ``adapter/*.safetensors`` or ``merged/*.safetensors``."""
    parts = rel.split("/")
    return len(parts) == 2 and parts[0] in ENCRYPTED_DIRS and parts[1].endswith(WEIGHT_SUFFIX)


def ciphertext_name(rel: str) -> str:
    """The name weight file ``rel`` is stored under as age ciphertext: ``rel`` + ``.age``."""
    return rel + AGE_SUFFIX


def plaintext_name(rel: str) -> str | None:
    """The weight file an age-ciphertext name stands for (``adapter/x.safetensors.age`` -> ``adapter/x.safetensors``);
    None when ``rel`` is not such a name."""
    plain = rel.removesuffix(AGE_SUFFIX)
    return plain if plain != rel and is_weight_file(plain) else None


def stored_name(rel: str, encrypted: bool) -> str:
    """Where a bundle holds file ``rel``: its ``.age`` name when ``rel`` is a weight file and the bundle is
    confidential (``encrypted``), else ``rel``."""
    return ciphertext_name(rel) if encrypted and is_weight_file(rel) else rel


def naming_problems(files: Iterable[str], encrypted: bool) -> list[str]:
    """Weight files listed under the wrong name for the bundle's kind: a plaintext name in a confidential bundle (a
    bundle made before ciphertext was named ``.age``, or one holding both names), an ``.age`` name in a plaintext one."""
    if encrypted:
        return [f"{rel} is listed under its plaintext name, but the weights are encrypted (confidentiality): a "
                f"confidential bundle holds that file as age ciphertext named {ciphertext_name(rel)}"
                for rel in sorted(files) if is_weight_file(rel)]
    return [f"{rel} is an age ciphertext name, but the manifest has no confidentiality"
            for rel in sorted(files) if plaintext_name(rel) is not None]


def identity_from_secret(secret: bytes) -> str:
    """The age identity string (``AGE-SECRET-KEY-1…``) of a 32-byte X25519 secret."""
    if len(secret) != 32:
        raise ValueError("an age X25519 secret is 32 bytes")
    data, acc, bits = [], 0, 0
    for byte in secret:  # 8-bit bytes -> 5-bit groups, zero-padded
        acc, bits = (acc << 8) | byte, bits + 8
        while bits >= 5:
            bits -= 5
            data.append((acc >> bits) & 31)
    if bits:
        data.append((acc << (5 - bits)) & 31)
    hrp = "age-secret-key-"
    values = [ord(c) >> 5 for c in hrp] + [0] + [ord(c) & 31 for c in hrp] + data + [0] * 6
    polymod = 1
    for v in values:
        top, polymod = polymod >> 25, ((polymod & 0x1FFFFFF) << 5) ^ v
        for i, g in enumerate((0x3B6A57B2, 0x26508E6D, 0x1EA119FA, 0x3D4233DD, 0x2A1462B3)):
            polymod ^= g if (top >> i) & 1 else 0
    checksum = [((polymod ^ 1) >> 5 * (5 - i)) & 31 for i in range(6)]
    return (hrp + "1" + "".join(_CHARSET[d] for d in data + checksum)).upper()


def recipient_of(identity: str) -> str:
    """The public ``age1…`` recipient of an identity string."""
    return str(pyrage.x25519.Identity.from_str(identity).to_public())


def parse_recipients(values: list[str] | tuple[str, ...] | str) -> tuple[str, ...]:
    """Sorted, unique recipients from a list or a space-separated string.

    Raises:
        ValueError: one is not an age X25519 recipient, or there are more than :data:`MAX_RECIPIENTS`.
    """
    items = values.split() if isinstance(values, str) else list(values)
    if bad := [r for r in items if not _RECIPIENT.fullmatch(r)]:
        raise ValueError(f"{bad[0][:70]!r} is not an age X25519 recipient (age1… , 62 characters)")
    out = tuple(sorted(set(items)))
    if len(out) > MAX_RECIPIENTS:
        raise ValueError(f"at most {MAX_RECIPIENTS} recipients")
    return out


def load_identities(path: Path) -> list[pyrage.x25519.Identity]:
    """The X25519 identities of an age identity file (``age-keygen`` output).

    Raises:
        IdentityError: unreadable, or no valid ``AGE-SECRET-KEY-1…`` line.
    """
    try:
        text = read_regular(Path(path), 1 << 20).decode("utf-8")  # a FIFO or device is refused, not waited on
    except (OSError, UnicodeDecodeError) as exc:
        why = (exc.strerror or type(exc).__name__) if isinstance(exc, OSError) else "not UTF-8 text"
        raise IdentityError(f"cannot read the identity file {path}: {why}") from None
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            try:
                out.append(pyrage.x25519.Identity.from_str(line))
            except pyrage.IdentityError:
                raise IdentityError(f"{path} holds a line that is not an age X25519 identity") from None
    if not out:
        raise IdentityError(f"{path} holds no age identity")
    return out


def encrypt(data: bytes, recipients: tuple[str, ...]) -> bytes:
    """age v1 ciphertext of ``data`` to every recipient (X25519 stanzas, in order)."""
    return pyrage.encrypt(data, [pyrage.x25519.Recipient.from_str(r) for r in recipients])


def decrypt(data: bytes, identities: list[pyrage.x25519.Identity]) -> bytes | None:
    """The plaintext, or None when no identity is a recipient or the ciphertext is damaged (age cannot tell which
    for a changed stanza; the manifest's ciphertext hash tells the two apart)."""
    try:
        return pyrage.decrypt(data, identities)
    except pyrage.DecryptError:
        return None


def x25519_stanzas(data: bytes) -> int | None:
    """How many X25519 recipient stanzas an age v1 header holds (``-grease`` stanzas ignored); None when ``data``
    does not start with a well-formed age v1 header (magic, stanzas, ``---`` MAC line) or carries another stanza type."""
    if not data.startswith(AGE_MAGIC):
        return None
    end = data.find(b"\n--- ", 0, _HEADER_LIMIT)
    if end < 0 or data.find(b"\n", end + 1, _HEADER_LIMIT) < 0:
        return None
    count = 0
    for line in data[len(AGE_MAGIC):end].split(b"\n"):
        if line.startswith(b"-> "):
            kind = line.split(b" ")[1] if len(line.split(b" ")) > 1 else b""
            if kind == b"X25519":
                count += 1
            elif not kind.endswith(b"-grease"):
                return None
    return count

