"""The data owner's Ed25519 signing key: create, load, pin.

``cvm-tune keys new -o PREFIX`` writes two files and never overwrites either:

* ``PREFIX.key``: the private key, PKCS#8 PEM (unencrypted: protect the file, mode 0600);
* ``PREFIX.pub``: the raw public key as 64 hex characters and a newline. That value is what the
  CVM's configuration pins (``dataset.owner_public_key``); its SHA-256 is the owner key id that
  ``inspect`` shows and the export manifest records.

The owner signs each encrypted dataset (format version 2) and each key grant with this key.

``cvm-tune keys age -o FILE`` writes an age X25519 identity file (the format ``age-keygen`` writes): its recipient
(``age1…``) is what ``dataset encrypt --recipient`` takes, and the file is what ``--identity`` reads.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from app.dataset.keys import read_private_file, write_private_file
from app.errors import ConfigError, DatasetSignatureError, KeySourceError
from attestation.bundle.dataset_sig import owner_key_id, public_key_bytes

_MAX_PEM = 4096
_HEX64 = re.compile(r"[0-9a-f]{64}")


def new_owner_key(prefix: Path) -> tuple[Path, Path, bytes]:
    """Generate an owner key pair into ``PREFIX.key`` (0600) and ``PREFIX.pub``.

    Returns:
        (private key path, public key path, raw public key).

    Raises:
        KeySourceError: either file exists already, or cannot be written (nothing is left behind).
    """
    prefix = Path(prefix)
    key_path, pub_path = prefix.with_name(prefix.name + ".key"), prefix.with_name(prefix.name + ".pub")
    for p in (key_path, pub_path):
        if p.exists() or p.is_symlink():
            raise KeySourceError(f"{p} already exists: refusing to overwrite an owner key",
                                 fix="choose another -o prefix, or remove the old files if you really mean to replace the key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    pub = public_key_bytes(key)
    write_private_file(key_path, pem, "owner key file")
    try:
        write_private_file(pub_path, pub.hex().encode() + b"\n", "owner public key file")
    except KeySourceError:
        key_path.unlink(missing_ok=True)
        raise
    pub_path.chmod(0o644)  # public
    return key_path, pub_path, pub


def new_age_identity(path: Path, *, now: datetime | None = None) -> str:
    """Write a new age X25519 identity file as ``age-keygen -o`` does (``# created: <RFC 3339>``, ``# public key:
    age1…``, ``AGE-SECRET-KEY-1…``), mode 0600, atomically, never over an existing file; return its recipient.

    Raises:
        KeySourceError: ``path`` exists, or the file cannot be written (nothing is left behind).
    """
    import pyrage

    identity = pyrage.x25519.Identity.generate()
    recipient = str(identity.to_public())
    created = (now or datetime.now().astimezone()).isoformat(timespec="seconds").replace("+00:00", "Z")
    text = f"# created: {created}\n# public key: {recipient}\n{identity}\n"
    write_private_file(Path(path), text.encode("ascii"), "age identity file")
    return recipient


def load_owner_key(path: Path) -> Ed25519PrivateKey:
    """Load an owner private key file (PKCS#8 PEM, Ed25519, mode 0600 or stricter).

    Raises:
        KeySourceError: missing, readable by others, or not an Ed25519 private key.
    """
    data = read_private_file(Path(path), "owner key file", _MAX_PEM, check=lambda raw: _not_public(Path(path), raw))
    problem = None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        problem = type(exc).__name__  # the message may quote the file
    if problem is not None:
        raise KeySourceError(f"owner key file {Path(path).name} is not an unencrypted PKCS#8 PEM private key ({problem})",
                             fix="use the .key file written by `cvm-tune keys new`")
    if not isinstance(key, Ed25519PrivateKey):
        raise KeySourceError(f"owner key file {Path(path).name} holds a {type(key).__name__}, not an Ed25519 key")
    return key


def _not_public(path: Path, data: bytes) -> None:
    """Refuse a public key (a ``.pub`` file's 64 hex, or a PEM public key) given as the owner's private key.

    Raises:
        KeySourceError: ``data`` is a public key (or a dataset key: 64 hex too).
    """
    text = data.strip().decode("ascii", "replace")
    if _HEX64.fullmatch(text):
        what = "the owner's public key" if path.suffix == ".pub" else "64 hex characters (an owner public key or a dataset key)"
    elif re.match(r"-----BEGIN [A-Z0-9 ]*PUBLIC KEY-----", text):
        what = "a PEM public key"
    else:
        return
    private = path.with_suffix(".key") if path.suffix == ".pub" else Path("PREFIX.key")
    raise KeySourceError(f"owner key file {path.name} holds {what}, not the owner's private key",
                         fix=f"pass the private key {private} (the PEM file `cvm-tune keys new` wrote next to the .pub)")


def signer_mismatch(what: str, signer: bytes, pinned: bytes) -> DatasetSignatureError:
    """The error for ``what`` signed by ``signer`` where ``pinned`` was expected: it says so when the pinned value is
    the signer's owner key id (the other 64-hex value ``keys new`` prints) instead of its public key."""
    if owner_key_id(signer) == pinned.hex():
        return DatasetSignatureError(
            f"{what} is signed by owner key {owner_key_id(signer)[:16]}…, and the value pinned as its public key is "
            "that key's owner key id, not the public key", fix="pin the public key: the content of the owner's .pub "
            "file (`cvm-tune keys new` prints it after 'owner_public_key:'), not the owner key id")
    return DatasetSignatureError(f"{what} is signed by owner key {owner_key_id(signer)[:16]}…, not by the pinned key "
                                 f"{owner_key_id(pinned)[:16]}…")


def parse_public_key(value: str) -> bytes:
    """A pinned owner public key: 64 lowercase hex characters (the content of ``PREFIX.pub``).

    Raises:
        ConfigError: anything else.
    """
    text = value.strip()
    if not _HEX64.fullmatch(text):
        raise ConfigError("an owner public key is 64 lowercase hex characters (the content of the .pub file)")
    return bytes.fromhex(text)


def load_public_key(arg: str) -> bytes:
    """An owner public key given as 64 hex characters or as the path of a ``.pub`` file.

    Raises:
        ConfigError: neither.
    """
    if _HEX64.fullmatch(arg.strip()):
        return bytes.fromhex(arg.strip())
    try:
        text = Path(arg).read_text(encoding="ascii")[:200]
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read owner public key {arg}: {getattr(exc, 'strerror', None) or type(exc).__name__}") from None
    if re.match(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----", text):
        public = Path(arg).with_suffix(".pub") if Path(arg).suffix == ".key" else Path("PREFIX.pub")
        raise ConfigError(f"{Path(arg).name} holds a private key, not the owner's public key",
                          fix=f"pass the public key {public} (64 hex; `cvm-tune keys new` wrote it next to the .key)")
    return parse_public_key(text)


__all__ = ["load_owner_key", "load_public_key", "new_age_identity", "new_owner_key", "owner_key_id", "parse_public_key"]
