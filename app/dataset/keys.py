"""Where the 32-byte dataset key comes from: the :class:`KeySource` seam.

Sources: a key file (demo, tests, data owner's side), a key derived from the dstack ``GetKey``
call (the call is injected so this module never imports dstack), an environment variable (a dstack
encrypted env var: confidential but forgeable by the host, so only with a pinned owner signature)
and the attested owner release (:mod:`app.dataset.release`). No source ever logs or prints key bytes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from app.errors import CvmTuneError, KeySourceError
from app.fsutil import fsync_dir

KEY_LEN = 32
DERIVED_KEY_INFO = b"cvm-tune/dataset-key/v1"
_MAX_KEY_FILE = 256  # read no more than this: a key file is 32 or 64-65 bytes


@runtime_checkable
class KeySource(Protocol):
    """A source of the dataset key."""

    def describe(self) -> str:
        """A label for logs and manifests (never the secret), e.g. ``getkey:cvm-tune/dataset/v1``."""
        ...

    def dataset_key(self) -> bytes:
        """The 32-byte dataset key.

        Raises:
            KeySourceError: the key cannot be obtained.
        """
        ...


class KeyFileSource:
    """A key file: 32 raw bytes, or 64 hex characters with an optional trailing newline.

    The file must be readable by its owner only (mode ``0600`` or stricter).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def describe(self) -> str:
        """``file:<name>`` (the directory is not needed to identify the key)."""
        return f"file:{self.path.name}"

    def dataset_key(self) -> bytes:
        """Read and check the key file.

        Returns:
            The 32-byte key.

        Raises:
            KeySourceError: the file is missing, not a regular file, readable by group or others,
                or does not hold exactly one key.
        """
        return _parse_key_file(read_private_file(self.path, "key file", _MAX_KEY_FILE), self.path.name)


def read_private_file(path: Path, what: str, max_len: int, *, check: Callable[[bytes], None] | None = None) -> bytes:
    """Read at most ``max_len + 1`` bytes of a secret file that only its owner may read (0600 or stricter).
    ``check`` sees the bytes before the mode is judged, so a file that is not a secret at all (a public key given
    where the private key belongs) is named as such rather than answered with ``chmod 600``.

    Raises:
        KeySourceError: missing, not a regular file, refused by ``check``, or readable by group or others.
    """
    path = Path(path)
    name = path.name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # NONBLOCK: a FIFO must not hang us
    except FileNotFoundError:
        raise KeySourceError(f"{what} {name} not found", fix=f"create it (mode 0600) or fix the path {path}") from None
    except OSError as exc:
        raise KeySourceError(f"cannot open {what} {name}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)  # fstat on the open file: no race between the check and the read
        if not stat.S_ISREG(st.st_mode):
            raise KeySourceError(f"{what} {name} is not a regular file")
        data = os.read(fd, max_len + 1)
        if check is not None:
            check(data)
        if st.st_mode & 0o077:
            raise KeySourceError(f"{what} {name} is readable by group or others (mode {stat.S_IMODE(st.st_mode):04o})",
                                 fix=f"chmod 600 {path}")
        return data
    finally:
        os.close(fd)


def _parse_key_file(data: bytes, name: str) -> bytes:
    if len(data) == KEY_LEN:
        return data
    text = data[:-1] if data.endswith(b"\n") else data
    if len(text) == 2 * KEY_LEN:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    raise KeySourceError(f"key file {name} holds {len(data)} bytes, not a key: expected 32 raw bytes or 64 hex characters",
                         fix="write the key with `cvm-tune` (write_key_file) or fix the file")


def derive_key(material: bytes) -> bytes:
    """``HKDF-SHA256(ikm=material, salt=None, info=b"cvm-tune/dataset-key/v1", length=32)``: what
    :class:`DerivedKeySource` makes of GetKey's bytes (also the checkpoint and saved-state keys, each at its own path).

    Raises:
        KeySourceError: fewer than 32 bytes.
    """
    if not isinstance(material, bytes | bytearray) or len(material) < KEY_LEN:
        raise KeySourceError(f"GetKey returned no usable key material (need at least {KEY_LEN} bytes)")
    return HKDF(algorithm=hashes.SHA256(), length=KEY_LEN, salt=None, info=DERIVED_KEY_INFO).derive(bytes(material))


class DerivedKeySource:
    """The dataset key derived from the dstack ``GetKey`` call for ``path``.

    ``dataset_key() = HKDF-SHA256(ikm=get_key(path, purpose), salt=None,
    info=b"cvm-tune/dataset-key/v1", length=32)``: the extra HKDF keeps the dataset key
    separate from any other use of the same GetKey bytes.
    """

    def __init__(self, get_key: Callable[[str, str], bytes], path: str, purpose: str = "cvm-tune-dataset-key", *,
                 agent: Any = None, opens: Callable[[bytes], bool] | None = None) -> None:
        self._get_key = get_key
        self.path = path
        self.purpose = purpose
        self._agent, self._opens = agent, opens  # key epochs: the guest agent, "this key opens the dataset"

    def describe(self) -> str:
        """``getkey:<path>``."""
        return f"getkey:{self.path}"

    def dataset_key(self) -> bytes:
        """Call GetKey and derive the dataset key.

        Returns:
            The 32-byte key.

        Raises:
            KeySourceError: GetKey returned no bytes or fewer than 32.
            TeeError: raised by ``get_key`` itself when the guest agent fails.
        """
        material = self._get_key(self.path, self.purpose)
        if not isinstance(material, bytes | bytearray) or len(material) < KEY_LEN:
            raise KeySourceError(f"GetKey({self.path}) returned no usable key material (need at least {KEY_LEN} bytes)")
        hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_LEN, salt=None, info=DERIVED_KEY_INFO)
        key = hkdf.derive(bytes(material))
        if self._agent is not None and self._opens is not None:
            key = self._epoch_key(key)
        return key

    def _epoch_key(self, current: bytes) -> bytes:
        """After a KMS key rotation the dataset (encrypted under a GetKey key of before) opens with the key of the
        epochs it was encrypted under: the newest older epoch whose key passes the dataset's key check (nothing is
        decrypted). ``current`` when it opens, or when no older one does (the dataset stage then says so).

        Raises:
            KeyEpochError: the agent answered other epochs than asked (it ignores the selectors).
        """
        from app.keys_epoch import KeyEpochError, older_epochs

        opens = self._opens
        if opens is None or opens(current):
            return current
        _raw, epochs = self._agent.get_key_at(self.path, self.purpose)
        for older in older_epochs(epochs) if epochs is not None else []:
            try:
                raw, _ = self._agent.get_key_at(self.path, self.purpose, older)
            except KeyEpochError:
                raise
            except CvmTuneError:  # the KMS no longer authorises that epoch
                continue
            key = derive_key(raw)
            if opens(key):
                return key
        return current


class EnvKeySource:
    """The key in an environment variable: 64 hex characters (e.g. a dstack encrypted env var).

    dstack encrypts env vars to a public key anyone can fetch, so the host can replace the value
    with a key of its own choosing: this source protects confidentiality only. The pipeline
    therefore accepts it only with a pinned owner signature (``dataset.owner_public_key``).
    """

    def __init__(self, name: str, environ: Mapping[str, str] | None = None) -> None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,254}", name):
            raise KeySourceError(f"{name!r} is not an environment variable name")
        self.name = name
        self._environ = os.environ if environ is None else environ

    def describe(self) -> str:
        """``env:<NAME>``."""
        return f"env:{self.name}"

    def dataset_key(self) -> bytes:
        """Read the variable (never echoed).

        Raises:
            KeySourceError: unset, or not 64 hex characters.
        """
        value = self._environ.get(self.name)
        if value is None:
            raise KeySourceError(f"environment variable {self.name} is not set",
                                 fix=f"set {self.name} (a dstack encrypted env var listed in allowed_envs) to the 64-hex dataset key")
        text = value.strip()
        if not re.fullmatch(r"[0-9a-fA-F]{64}", text):
            raise KeySourceError(f"environment variable {self.name} does not hold a key ({len(value)} characters, "
                                 "expected 64 hex characters)")
        return bytes.fromhex(text)


def write_key_file(path: Path, key: bytes) -> None:
    """Create a key file (mode 0600, 64 hex characters and a newline) atomically.

    Args:
        path: the file to create; it must not exist.
        key: the 32-byte key.

    Raises:
        KeySourceError: the key is not 32 bytes, ``path`` exists, or the file cannot be written.
    """
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_LEN:
        raise KeySourceError(f"a dataset key must be exactly {KEY_LEN} bytes")
    write_private_file(path, bytes(key).hex().encode() + b"\n", "key file")


def write_private_file(path: Path, data: bytes, what: str) -> None:
    """Create a secret file (mode 0600 from the start) atomically; never replaces an existing file.

    Raises:
        KeySourceError: ``path`` exists, or the file cannot be written.
    """
    path = Path(path)
    if path.exists() or path.is_symlink():
        raise KeySourceError(f"{what} {path} already exists: refusing to overwrite a key",
                             fix="remove it first if you really mean to replace the key, or choose another path")
    tmp = path.parent / f".tmp-{path.name}-{secrets.token_hex(8)}"
    try:
        # O_EXCL|O_NOFOLLOW: never write through a planted file or symlink; 0600 from the start.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o600)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        _publish(tmp, path)
        with contextlib.suppress(FileNotFoundError):  # gone already if _publish renamed it
            os.unlink(tmp)
        fsync_dir(path.parent)
    except FileExistsError:
        raise KeySourceError(f"{what} {path} already exists: refusing to overwrite a key") from None
    except OSError as exc:
        raise KeySourceError(f"cannot write {what} {path}: {exc.strerror}", fix="check the directory and its permissions") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _publish(tmp: Path, path: Path) -> None:
    """Give ``tmp`` the name ``path`` without ever replacing an existing ``path``."""
    try:
        os.link(tmp, path)  # unlike rename, link never replaces an existing file
    except FileExistsError:
        raise
    except OSError as exc:  # no hard links on this filesystem: check, then rename (a small race)
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        if path.exists() or path.is_symlink():
            raise FileExistsError(path) from None
        os.rename(tmp, path)
