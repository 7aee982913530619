"""Dataset format header: constants, the header object, key derivation and the clear prefix.

The normative specification is the docstring of :mod:`app.dataset.format`; this module holds
decoding steps 1-3's building blocks shared by the writer (:mod:`app.dataset.format`), the
owner-signature trailer reader (:mod:`app.dataset.format_sig`) and the chunk reader
(:mod:`app.dataset.format_read`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, BinaryIO

from cryptography.hazmat.primitives import hashes, hmac
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from app.errors import CvmTuneError, DatasetFormatError, KeySourceError
from attestation.outputs.confidential import DATASET_META_KEY, parse_recipients
from attestation.bundle.dataset_sig import OwnerSignature
from attestation.io.hashing import canonical_json

FORMAT_MAGIC = b"CVMTDS\x00\x01"  # version 1: unsigned
FORMAT_MAGIC_V2 = b"CVMTDS\x00\x02"  # version 2: version 1 + the owner-signature trailer
FORMAT_VERSIONS = (1, 2)
ALG = "AES-256-GCM/HKDF-SHA256/STREAM-v1"
CONTENT_TYPE = "application/jsonl"
BLOB_CONTENT_TYPE = "application/octet-stream"  # sealed checkpoint files (app.training.checkpoints)
TABLE_CONTENT_TYPES = ("application/vnd.apache.parquet", "application/vnd.apache.arrow.file")  # app.dataset.tabular
CONTENT_TYPES = (CONTENT_TYPE, BLOB_CONTENT_TYPE, *TABLE_CONTENT_TYPES)
DEFAULT_CHUNK_SIZE = 1 << 20
MIN_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 16 << 20
MAX_HEADER_LEN = 65536
KEY_LEN = 32
TAG_LEN = 16
MAC_LEN = 32
KEY_CHECK_MESSAGE = b"cvm-tune key check"
# Bytes after a short final chunk that are still recognised as trailing data. Each candidate costs
# one AES-GCM pass over the chunk, and only on the error path (~70 ms in all for 1 MiB chunks).
TRAILING_SEARCH = 1024

_MAX_INT = (1 << 53) - 1  # largest int every JSON implementation reads exactly
_REQUIRED = frozenset({"alg", "chunk_size", "salt", "content_type", "dataset_id", "dataset_version"})
_ALLOWED = _REQUIRED | {"metadata"}
_META_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
_SALT = re.compile(r"[0-9a-f]{64}\Z")
# Control characters have several JSON escapings and surrogates have no UTF-8 form; banning them
# keeps the canonical header bytes identical in every language.
_BAD_CHARS = re.compile(r"[\x00-\x1f\ud800-\udfff]")


@dataclass(frozen=True)
class DatasetHeader:
    """The parsed header. Unauthenticated unless it came from :func:`open_encrypted` or encryption."""

    chunk_size: int
    salt: bytes
    dataset_id: str
    dataset_version: int
    content_type: str
    metadata: dict
    raw: bytes  # the exact header JSON bytes as stored in the file
    format_version: int = 1  # the magic's last byte: 1 unsigned, 2 owner-signed

    @property
    def recipients(self) -> tuple[str, ...]:
        """The age recipients the owner named (``cvm-tune dataset encrypt --recipient``); () for none."""
        return tuple(str(self.metadata.get(DATASET_META_KEY, "")).split())


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


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_LEN:
        raise KeySourceError(f"the dataset key must be exactly {KEY_LEN} bytes")


def _derive(key: bytes, salt: bytes, label: bytes, version: int = 1) -> bytes:
    info = f"cvm-tune/dataset/v{version}/".encode() + label  # per version: no cross-version key reuse
    hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_LEN, salt=salt, info=info)
    return hkdf.derive(bytes(key))


def _hmac(key: bytes, data: bytes) -> hmac.HMAC:
    mac = hmac.HMAC(key, hashes.SHA256())
    mac.update(data)
    return mac


def _nonce(index: int, final: bool) -> bytes:
    if index >= 1 << 88:  # unreachable in practice (2^88 chunks); never wrap the counter
        raise DatasetFormatError("too many chunks for one file")
    return index.to_bytes(11, "big") + (b"\x01" if final else b"\x00")



def _read_upto(src: BinaryIO, n: int) -> bytes:
    """Read ``n`` bytes, fewer only at end-of-file (file objects may return short reads)."""
    data = src.read(n)
    if len(data) == n or not data:
        return data
    parts, got = [data], len(data)
    while got < n and (more := src.read(n - got)):
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _fill(src: BinaryIO, view: memoryview) -> int:
    """Fill ``view`` from ``src``; returns the byte count (short only at end-of-file)."""
    got = 0
    readinto = getattr(src, "readinto", None)
    while got < len(view):
        if readinto is not None:
            n = readinto(view[got:])
        else:
            data = src.read(len(view) - got)
            n = len(data)
            view[got : got + n] = data
        if not n:
            break
        got += n
    return got


def _text(value: Any, max_len: int, min_len: int) -> bool:
    return isinstance(value, str) and min_len <= len(value) <= max_len and not _BAD_CHARS.search(value)


def _int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _header_from_obj(obj: Any, raw: bytes, err: type[CvmTuneError]) -> DatasetHeader:
    """Check every header rule (the same rules guard encryption and decryption)."""
    if not isinstance(obj, dict):
        raise err("the dataset header is not a JSON object")
    unknown = sorted(set(obj) - _ALLOWED)
    if unknown:
        names = ", ".join(repr(k)[:40] for k in unknown[:5])
        raise err(f"unknown header key(s) {names} (a newer format version?)")
    missing = sorted(_REQUIRED - set(obj))
    if missing:
        raise err(f"the dataset header lacks {', '.join(missing)}")
    if obj["alg"] != ALG:
        raise err(f"unsupported header alg (expected {ALG!r})")
    if not _int(obj["chunk_size"], MIN_CHUNK_SIZE, MAX_CHUNK_SIZE):
        raise err(f"header chunk_size must be an int in {MIN_CHUNK_SIZE}..{MAX_CHUNK_SIZE}")
    if not isinstance(obj["salt"], str) or not _SALT.match(obj["salt"]):
        raise err("header salt must be 64 lowercase hex characters")
    if obj["content_type"] not in CONTENT_TYPES:
        raise err(f"header content_type must be one of {', '.join(CONTENT_TYPES)} in this format")
    if not _text(obj["dataset_id"], 256, 1):
        raise err("header dataset_id must be 1-256 characters without control characters")
    if not _int(obj["dataset_version"], 0, _MAX_INT):
        raise err("header dataset_version must be an int >= 0")
    meta = obj.get("metadata", {})
    if not isinstance(meta, dict) or len(meta) > 64:
        raise err("header metadata must be an object with at most 64 entries")
    for k, v in meta.items():
        if not isinstance(k, str) or not _META_KEY.match(k):
            raise err("header metadata keys must match [A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
        if not (_text(v, 1024, 0) or _int(v, -_MAX_INT, _MAX_INT)):
            raise err("header metadata values must be strings (<= 1024 characters) or ints")
    if DATASET_META_KEY in meta:  # the owner's age recipients of every weight file trained on this dataset
        try:
            if parse_recipients(str(meta[DATASET_META_KEY])) != tuple(str(meta[DATASET_META_KEY]).split()) or not meta[
                    DATASET_META_KEY]:
                raise ValueError("not sorted, unique and space-separated")
        except ValueError as exc:
            raise err(f"header metadata {DATASET_META_KEY} must list age X25519 recipients: {exc}") from None
    return DatasetHeader(chunk_size=obj["chunk_size"], salt=bytes.fromhex(obj["salt"]), dataset_id=obj["dataset_id"],
                         dataset_version=obj["dataset_version"], content_type=obj["content_type"],
                         metadata=dict(meta), raw=raw)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("duplicate key")
    return obj


def _no_constant(_name: str) -> Any:
    raise ValueError("NaN/Infinity")


def _parse_header(raw: bytes) -> DatasetHeader:
    problem = None
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        problem = type(exc).__name__
    if problem is not None:  # raised outside the except block: nothing chains to the parser error
        raise DatasetFormatError(f"the dataset header is not valid JSON ({problem})")
    header = _header_from_obj(obj, raw, DatasetFormatError)
    if canonical_json(obj) != raw:  # one byte string per header: no parser differentials
        raise DatasetFormatError("the dataset header is not canonical JSON")
    return header


def _read_prefix(src: BinaryIO) -> bytes:
    """Read ``magic ‖ header_len ‖ header`` (step 1 of decoding); returns those bytes."""
    magic = _read_upto(src, len(FORMAT_MAGIC))
    if not magic:
        raise DatasetFormatError("not a cvm-tune encrypted dataset (the file is empty)")
    if magic[:7] != FORMAT_MAGIC[:7][: len(magic)]:
        raise DatasetFormatError("not a cvm-tune encrypted dataset (bad magic bytes)")
    if len(magic) == 8 and magic[7] not in FORMAT_VERSIONS:
        raise DatasetFormatError(f"unsupported version {magic[7]} of the cvm-tune dataset format (this reads 1 and 2)",
                                 fix="upgrade cvm-tune, or re-encrypt the dataset with this version")
    length = _read_upto(src, 4) if len(magic) == 8 else b""
    if len(length) < 4:
        raise DatasetFormatError("the file ends inside the dataset header")
    header_len = int.from_bytes(length, "big")
    if not 1 <= header_len <= MAX_HEADER_LEN:
        raise DatasetFormatError(f"dataset header length {header_len} is outside 1..{MAX_HEADER_LEN}")
    raw = _read_upto(src, header_len)
    if len(raw) < header_len:
        raise DatasetFormatError("the file ends inside the dataset header")
    return magic + length + raw


def read_header(src: BinaryIO) -> DatasetHeader:
    """Parse the header without a key (for ``inspect``). The result is NOT authenticated.

    Args:
        src: the encrypted file, positioned at its start.

    Returns:
        The parsed header.

    Raises:
        DatasetFormatError: not a version-1 dataset, or a malformed header.
    """
    prefix = _read_prefix(src)
    return dataclasses.replace(_parse_header(prefix[12:]), format_version=prefix[7])

