"""# cvm-tune encrypted dataset, format version 1

A dataset file is a streaming authenticated encryption of one JSONL plaintext. The data owner
encrypts it outside the CVM; cvm-tune decrypts it **in memory, chunk by chunk**, and no plaintext
is ever written to disk. The design follows age's STREAM construction (counter nonce with a
last-chunk flag) with AES-256-GCM, HKDF-SHA256 and HMAC-SHA256 from pyca/cryptography.

## Layout

| field        | size              | content |
|--------------|-------------------|---------|
| `magic`      | 8                 | `43 56 4d 54 44 53 00 01` (`b"CVMTDS\\x00\\x01"`; the last byte is the format version) |
| `header_len` | 4                 | u32 big-endian, `1 ≤ header_len ≤ 65536` |
| `header`     | `header_len`      | canonical JSON object (below) |
| `key_check`  | 32                | `HMAC-SHA256(K_check, "cvm-tune key check")` |
| `header_mac` | 32                | `HMAC-SHA256(K_header, magic ‖ header_len ‖ header ‖ key_check)` |
| `chunk_0 … chunk_n` | rest       | `AES-256-GCM(K_payload, nonce_i, plaintext_i, aad = header_mac)`, ciphertext ‖ 16-byte tag |

All chunks except the last hold exactly `chunk_size` plaintext bytes (`chunk_size + 16` on disk).
The last chunk is the *final* chunk; it holds `1 … chunk_size` bytes, or 0 bytes only when the
whole plaintext is empty (then the file has exactly one chunk, 16 bytes). There is no length field:
the reader finds the end of the stream by reaching end-of-file.

`nonce_i = i as 11-byte big-endian ‖ 0x01 if chunk i is final else 0x00` (12 bytes).

## Keys

`dataset_key` is 32 bytes (from a key file or derived from dstack `GetKey`). With `salt` from the
header, for `label` in `check`, `header`, `payload`:

    K_label = HKDF-SHA256(ikm=dataset_key, salt=salt, info="cvm-tune/dataset/v1/" ‖ label, length=32)

`salt` is 32 fresh random bytes per file, so every file has its own payload key and the chunk
counter never repeats a (key, nonce) pair.

## Header

The header is the UTF-8 bytes of `json.dumps(obj, sort_keys=True, separators=(",", ":"),
ensure_ascii=False)`. With the rules below that means, in any language: keys sorted (all keys are
ASCII), no whitespace, ints in plain decimal, strings with only `"` and `\\` escaped (as `\\"`
and `\\\\`) and everything else as raw UTF-8. Readers reject any other serialisation of the same
object (one byte string per header), duplicate keys, `NaN`/`Infinity` and floats. Keys:

| key               | type   | rule |
|-------------------|--------|------|
| `alg`             | string | exactly `"AES-256-GCM/HKDF-SHA256/STREAM-v1"` |
| `chunk_size`      | int    | `4096 … 16777216` (default 1048576) |
| `salt`            | string | 64 lowercase hex characters |
| `content_type`    | string | `"application/jsonl"` (a dataset) or `"application/octet-stream"` (a sealed checkpoint file, `app.training.checkpoints`); readers name the one they expect |
| `dataset_id`      | string | 1–256 characters, no control characters (U+0000–U+001F) |
| `dataset_version` | int    | `0 … 2^53-1` |
| `metadata`        | object | optional; ≤ 64 entries; keys match `[A-Za-z0-9][A-Za-z0-9_.-]{0,63}`; values are strings (≤ 1024 characters, no control characters) or ints (abs ≤ 2^53-1) |

Any other key is rejected: a new field means a new format version byte. Ints never include
booleans. The header is **authenticated but not encrypted**: never put secrets in `dataset_id`
or `metadata`.

## Decoding (normative; stop at the first failure)

1. `magic`: an empty file or other first 7 bytes → *format error* "not a cvm-tune encrypted
   dataset"; another version byte → *format error* "unsupported version N". `header_len` out of
   range, the file ending before the end of `header_mac`, a header that is not canonical JSON or breaks a
   rule above → *format error*. Nothing is trusted yet.
2. Derive the keys; compare `key_check` in constant time → *wrong key*. Editing the salt also
   lands here (it changes every derived key).
3. Verify `header_mac` in constant time → *header integrity error*.
4. Read the chunks as blocks of `chunk_size + 16` bytes (the last block may be shorter). Before
   opening block `i`, look ahead to learn whether end-of-file follows it:
   * **more bytes follow**: open it as non-final. If that fails but it opens as final, or a prefix
     of it opens as final with at most 1024 bytes after it → *trailing data*. Otherwise → *chunk
     integrity error* naming `i`.
   * **end-of-file follows**: open it as final. If that fails: shorter than 16 bytes, opens as
     non-final (cut at a chunk boundary), or opens neither way → *truncated*; a prefix that opens
     as final with at most 1024 bytes after it → *trailing data*. An empty final chunk with
     `i > 0` → *format error*.
   * no chunk at all after the header → *truncated*.
5. Release chunk `i`'s plaintext only after its tag verified.

What each damage looks like:

| damage | error (`app.errors`) |
|---|---|
| empty file, bad magic/version, bad `header_len`, malformed header, cut inside the header | `DatasetFormatError` |
| wrong key, edited `key_check` or `salt` | `WrongKeyError` |
| other header edit, edited `header_mac` | `HeaderIntegrityError` (an edit that breaks the JSON or a rule: `DatasetFormatError`) |
| bit flip in a chunk that is not the last; chunks swapped; a non-final chunk duplicated | `ChunkIntegrityError` (first bad index) |
| final chunk dropped (cut at a boundary); cut inside a chunk; **bit flip in the last chunk** | `TruncatedDatasetError` |
| bytes appended after the final chunk; final chunk duplicated | `TrailingDataError` if the final chunk is full-size or at most 1024 bytes were appended; otherwise `TruncatedDatasetError` or `ChunkIntegrityError` (the reader cannot find the end of a short final chunk without trying every length) |

A cut inside the last chunk and a modified last chunk leave the same evidence (no authenticated
final chunk), so both are reported as truncation, which is what `TruncatedDatasetError` means:
"the stream ended without an authenticated final chunk".

## Security notes

* Chunks are bound to their header by the AAD (`header_mac`) and to their position by the nonce,
  so chunks cannot be moved between files, reordered, dropped or duplicated undetected.
* AES-GCM alone is not key-committing; `key_check` commits the file to one `dataset_key`, so a
  file cannot decrypt to two different plaintexts under two keys.
* **Streaming releases authenticated chunks before the end is known.** A caller that must not
  act on partial data (training) must consume the whole stream first and treat any error as "the
  dataset is invalid" (`parse_jsonl` does: it returns rows only after the final chunk verified).
* Not covered by this format: rollback to an older valid file (pin `dataset_version` and the
  ciphertext SHA-256 in a manifest) and owner signatures (a later format version).

## Test vector

`dataset_key = 00 01 02 … 1f`, `salt = 11 × 32`, `chunk_size = 4096`, `dataset_id = "kat"`,
`dataset_version = 1`, no metadata, plaintext `{"text":"hello"}\\n` (17 bytes); the file is
(hex, 318 bytes):

    43564d5444530001000000d17b22616c67223a224145532d3235362d47434d2f
    484b44462d5348413235362f53545245414d2d7631222c226368756e6b5f7369
    7a65223a343039362c22636f6e74656e745f74797065223a226170706c696361
    74696f6e2f6a736f6e6c222c22646174617365745f6964223a226b6174222c22
    646174617365745f76657273696f6e223a312c2273616c74223a223131313131
    3131313131313131313131313131313131313131313131313131313131313131
    313131313131313131313131313131313131313131313131313131227dbe9c85
    6585b4c220d8dab6f28466f62251a7a7f13660e3dd6aa67ae6d06ba781d4bc94
    ddc7cb1d14427a41687228c40cdf2520feeb072faeedbe0eb8e42013a2e3525a
    368447efef064be2a081f44248c5612b323ceca32fe7136c8451e737b4d5

File SHA-256: `49955459760723366c30dda78836f1cc7272e94c395d53726075bf2d8ce6a5bd`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, hmac
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from app.errors import (
    ChunkIntegrityError,
    ConfigError,
    CvmTuneError,
    DataError,
    DatasetFormatError,
    HeaderIntegrityError,
    KeySourceError,
    TrailingDataError,
    TruncatedDatasetError,
    WrongKeyError,
)
from app.fsutil import fsync_dir
from attestation.hashing import canonical_json

FORMAT_MAGIC = b"CVMTDS\x00\x01"
FORMAT_VERSION = FORMAT_MAGIC[-1]
ALG = "AES-256-GCM/HKDF-SHA256/STREAM-v1"
CONTENT_TYPE = "application/jsonl"
BLOB_CONTENT_TYPE = "application/octet-stream"  # sealed checkpoint files (app.training.checkpoints)
CONTENT_TYPES = (CONTENT_TYPE, BLOB_CONTENT_TYPE)
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


@dataclass(frozen=True)
class EncryptResult:
    """What :func:`encrypt_stream` wrote (sizes in bytes, SHA-256 as hex)."""

    header: DatasetHeader
    plaintext_size: int
    plaintext_sha256: str
    ciphertext_size: int
    ciphertext_sha256: str
    chunks: int


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_LEN:
        raise KeySourceError(f"the dataset key must be exactly {KEY_LEN} bytes")


def _derive(key: bytes, salt: bytes, label: bytes) -> bytes:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_LEN, salt=salt, info=b"cvm-tune/dataset/v1/" + label)
    return hkdf.derive(bytes(key))


def _hmac(key: bytes, data: bytes) -> hmac.HMAC:
    mac = hmac.HMAC(key, hashes.SHA256())
    mac.update(data)
    return mac


def _nonce(index: int, final: bool) -> bytes:
    if index >= 1 << 88:  # unreachable in practice (2^88 chunks); never wrap the counter
        raise DatasetFormatError("too many chunks for one file")
    return index.to_bytes(11, "big") + (b"\x01" if final else b"\x00")


def _fresh_salt() -> bytes:
    return secrets.token_bytes(32)


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
        raise err(f"header content_type must be one of {', '.join(CONTENT_TYPES)} in format version 1")
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
    if len(magic) == 8 and magic[7] != FORMAT_VERSION:
        raise DatasetFormatError(f"unsupported version {magic[7]} of the cvm-tune dataset format (this reads {FORMAT_VERSION})",
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
    return _parse_header(prefix[12:])


def encrypt_stream(src: BinaryIO, dst: BinaryIO, key: bytes, *, dataset_id: str, dataset_version: int = 0,
                   chunk_size: int = DEFAULT_CHUNK_SIZE, metadata: dict | None = None,
                   content_type: str = CONTENT_TYPE) -> EncryptResult:
    """Encrypt ``src`` to ``dst`` in the version-1 format, holding about two chunks in memory.

    Args:
        src: plaintext JSONL, read to end-of-file.
        dst: where the encrypted file is written (from its current position).
        key: the 32-byte dataset key.
        dataset_id: the dataset's name (stored in the clear).
        dataset_version: the owner's version number (stored in the clear).
        chunk_size: plaintext bytes per chunk (4096..16 MiB).
        metadata: extra ``{str: str | int}`` stored in the clear header.
        content_type: one of ``CONTENT_TYPES`` (default: a JSONL dataset).

    Returns:
        Sizes, SHA-256 digests and the chunk count of what was written.

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
    header = dataclasses.replace(header, raw=raw)
    prefix = FORMAT_MAGIC + len(raw).to_bytes(4, "big") + raw
    key_check = _hmac(_derive(key, salt, b"check"), KEY_CHECK_MESSAGE).finalize()
    header_mac = _hmac(_derive(key, salt, b"header"), prefix + key_check).finalize()
    aead = AESGCM(_derive(key, salt, b"payload"))

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
    return EncryptResult(header=header, plaintext_size=plain_size, plaintext_sha256=pt_hash.hexdigest(),
                         ciphertext_size=written, ciphertext_sha256=ct_hash.hexdigest(), chunks=index)


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


class DecryptedStream:
    """Authenticated plaintext chunks of one dataset file; iterate once.

    ``header`` is authenticated (key check and header MAC passed). Each yielded chunk verified its
    own tag, but the stream as a whole is authentic only when iteration ends without an error:
    callers that must not act on partial data consume the whole stream first. The totals
    (``plaintext_size``, ``plaintext_sha256``, ``ciphertext_size``, ``ciphertext_sha256`` over all
    bytes read, header included, and ``chunks``) exist only after a complete iteration.
    """

    def __init__(self, src: BinaryIO, header: DatasetHeader, payload_key: bytes, aad: bytes, prefix: bytes) -> None:
        self.header = header
        self._src = src
        self._aead = AESGCM(payload_key)
        self._aad = aad
        self._ct_hash = hashlib.sha256(prefix)
        self._ct_size = len(prefix)
        self._pt_hash = hashlib.sha256()
        self._pt_size = 0
        self._chunks = 0
        self._started = False
        self.complete = False

    def __iter__(self) -> Iterator[bytes]:
        if self._started:
            raise RuntimeError("a DecryptedStream can be iterated only once")
        self._started = True
        return self._run()

    def _totals(self) -> None:
        if not self.complete:
            raise RuntimeError("dataset totals exist only after the whole stream was read and authenticated")

    @property
    def plaintext_size(self) -> int:
        self._totals()
        return self._pt_size

    @property
    def plaintext_sha256(self) -> str:
        self._totals()
        return self._pt_hash.hexdigest()

    @property
    def ciphertext_size(self) -> int:
        self._totals()
        return self._ct_size

    @property
    def ciphertext_sha256(self) -> str:
        self._totals()
        return self._ct_hash.hexdigest()

    @property
    def chunks(self) -> int:
        self._totals()
        return self._chunks

    def _run(self) -> Iterator[bytes]:
        size = self.header.chunk_size + TAG_LEN
        buf = bytearray(size)  # reused: memory stays at one ciphertext block plus one plaintext chunk
        view = memoryview(buf)
        n = _fill(self._src, view)
        if n == 0:
            raise TruncatedDatasetError("the stream ended without a final chunk (no chunks after the header)")
        index = 0
        while True:
            peek = self._src.read(1) if n == size else b""  # look ahead: is this block the last one?
            block = view[:n]
            self._ct_hash.update(block)
            offset = self._ct_size
            self._ct_size += n
            plain = self._open_inner(block, index, offset) if peek else self._open_last(block, index, offset)
            self._pt_hash.update(plain)
            self._pt_size += len(plain)
            self._chunks += 1
            self.complete = not peek  # the final chunk verified and end-of-file follows it
            yield plain
            if self.complete:
                return
            index += 1
            buf[0] = peek[0]
            n = 1 + _fill(self._src, view[1:])

    def _try(self, block: memoryview, index: int, final: bool) -> bytes | None:
        try:
            return self._aead.decrypt(_nonce(index, final), block, self._aad)
        except InvalidTag:
            return None

    def _final_prefix(self, block: memoryview, index: int) -> int:
        """Bytes after a final chunk hidden at the start of ``block`` (0 if none found)."""
        for extra in range(1, min(TRAILING_SEARCH, len(block) - TAG_LEN) + 1):
            if self._try(block[: len(block) - extra], index, True) is not None:
                return extra
        return 0

    def _open_inner(self, block: memoryview, index: int, offset: int) -> bytes:
        plain = self._try(block, index, False)
        if plain is not None:
            return plain
        if self._try(block, index, True) is not None or self._final_prefix(block, index):
            raise TrailingDataError(f"bytes follow the final chunk {index} (appended data or a duplicated final chunk)")
        raise ChunkIntegrityError(f"chunk {index} (byte offset {offset}) failed authentication: the file was modified, "
                                  "or its chunks were reordered or duplicated")

    def _open_last(self, block: memoryview, index: int, offset: int) -> bytes:
        cut = TruncatedDatasetError(f"the stream ended inside chunk {index} (byte offset {offset}) without a final "
                                    "chunk: the file was cut short (or its last chunk was modified)")
        if len(block) < TAG_LEN:
            raise cut
        plain = self._try(block, index, True)
        if plain is not None:
            if not plain and index > 0:
                raise DatasetFormatError(f"chunk {index} is an empty final chunk after data (not allowed in version 1)")
            return plain
        if len(block) == self.header.chunk_size + TAG_LEN and self._try(block, index, False) is not None:
            raise TruncatedDatasetError(f"the stream ended without a final chunk (after chunk {index}): "
                                        "the file was cut at a chunk boundary")
        if self._final_prefix(block, index):
            raise TrailingDataError(f"bytes follow the final chunk {index} (appended data)")
        raise cut


def open_encrypted(src: BinaryIO, key: bytes, *, content_type: str = CONTENT_TYPE) -> DecryptedStream:
    """Authenticate the header of an encrypted dataset and return its chunk stream.

    Args:
        src: the encrypted file, positioned at its start; read sequentially, never whole.
        key: the 32-byte dataset key.
        content_type: the content type the caller expects (a dataset by default).

    Returns:
        A :class:`DecryptedStream` whose ``header`` is authenticated. Chunk errors
        (:class:`ChunkIntegrityError`, :class:`TruncatedDatasetError`,
        :class:`TrailingDataError`) are raised while iterating it.

    Raises:
        KeySourceError: the key is not 32 bytes.
        DatasetFormatError: not a version-1 dataset, or a malformed header.
        WrongKeyError: the key does not open this file (nothing was decrypted).
        HeaderIntegrityError: the header or its MAC was modified.
        DatasetFormatError: the authenticated header names another content type.
    """
    _check_key(key)
    prefix = _read_prefix(src)
    header = _parse_header(prefix[12:])
    tail = _read_upto(src, 2 * MAC_LEN)
    if len(tail) < 2 * MAC_LEN:
        raise DatasetFormatError("the file ends inside the dataset header (key check / MAC)")
    key_check, header_mac = tail[:MAC_LEN], tail[MAC_LEN:]
    try:  # step 2, before anything else uses the key
        _hmac(_derive(key, header.salt, b"check"), KEY_CHECK_MESSAGE).verify(key_check)
    except InvalidSignature:
        raise WrongKeyError("the key does not open this dataset (key check failed; nothing was decrypted)") from None
    try:  # step 3
        _hmac(_derive(key, header.salt, b"header"), prefix + key_check).verify(header_mac)
    except InvalidSignature:
        raise HeaderIntegrityError("the dataset header was modified (header MAC mismatch)") from None
    if header.content_type != content_type:
        raise DatasetFormatError(f"the file holds {header.content_type}, not {content_type}")
    return DecryptedStream(src, header, _derive(key, header.salt, b"payload"), header_mac, prefix + tail)
