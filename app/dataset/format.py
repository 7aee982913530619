"""# cvm-tune encrypted dataset, format versions 1 and 2

A dataset file is a streaming authenticated encryption of one JSONL plaintext (or of a Parquet or Arrow IPC
file, as its `content_type` says: :mod:`app.dataset.tabular`). The data owner
encrypts it outside the CVM; cvm-tune decrypts it **in memory, chunk by chunk**, and no plaintext
is ever written to disk. The design follows age's STREAM construction (counter nonce with a
last-chunk flag) with AES-256-GCM, HKDF-SHA256 and HMAC-SHA256 from pyca/cryptography.

**Version 2** (what `cvm-tune dataset encrypt` writes) is version 1 with per-version keys and the
data owner's **Ed25519 signature** in a fixed 176-byte trailer after the last chunk: the owner
signs the file's body hash (header, dataset id and version included) and the plaintext's size and
SHA-256, which only exist once the stream has been written, so the signature goes at the end and
encryption stays single-pass with bounded memory. **Version 1** (no trailer) remains for the demo
and key-file use. A version-1-only reader rejects a version-2 file at the magic ("unsupported
version 2"); this reader rejects every other version byte the same way.

## Layout

| field        | size              | content |
|--------------|-------------------|---------|
| `magic`      | 8                 | `43 56 4d 54 44 53 00 0V` (`b"CVMTDS\\x00"` ‖ the format version `V`, 1 or 2) |
| `header_len` | 4                 | u32 big-endian, `1 ≤ header_len ≤ 65536` |
| `header`     | `header_len`      | canonical JSON object (below) |
| `key_check`  | 32                | `HMAC-SHA256(K_check, "cvm-tune key check")` |
| `header_mac` | 32                | `HMAC-SHA256(K_header, magic ‖ header_len ‖ header ‖ key_check)` |
| `chunk_0 … chunk_n` | rest       | `AES-256-GCM(K_payload, nonce_i, plaintext_i, aad = header_mac)`, ciphertext ‖ 16-byte tag |
| `trailer`    | 176 (version 2)   | owner signature (`attestation.bundle.dataset_sig`): `"CVMTDSIG"` ‖ owner Ed25519 public key (32) ‖ plaintext size (u64 BE) ‖ plaintext SHA-256 ‖ body SHA-256 ‖ signature (64) |

In version 2, *body* = every byte before the trailer, the *statement* = the trailer's first 112
bytes, the signature = `Ed25519(owner key, "cvm-tune/dataset-signature/v2" ‖ 0x00 ‖ statement)`,
the dataset *commitment* = SHA-256(statement) and the *owner key id* = SHA-256(public key).

All chunks except the last hold exactly `chunk_size` plaintext bytes (`chunk_size + 16` on disk).
The last chunk is the *final* chunk; it holds `1 … chunk_size` bytes, or 0 bytes only when the
whole plaintext is empty (then the file has exactly one chunk, 16 bytes). There is no length field:
the reader finds the end of the stream by reaching end-of-file.

`nonce_i = i as 11-byte big-endian ‖ 0x01 if chunk i is final else 0x00` (12 bytes).

## Keys

`dataset_key` is 32 bytes (key file, dstack `GetKey`, env var or owner release). With `salt` from
the header and `V` the format version digit, for `label` in `check`, `header`, `payload`:

    K_label = HKDF-SHA256(ikm=dataset_key, salt=salt, info="cvm-tune/dataset/vV/" ‖ label, length=32)

(`"cvm-tune/dataset/v1/"` or `"cvm-tune/dataset/v2/"`: a version-2 file relabelled as version 1,
its signature stripped, fails the key check.)

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
| `content_type`    | string | `"application/jsonl"` (a dataset), `"application/vnd.apache.parquet"` or `"application/vnd.apache.arrow.file"` (a dataset table, `app.dataset.tabular`), or `"application/octet-stream"` (a sealed checkpoint file, `app.training.checkpoints`); readers name the ones they expect |
| `dataset_id`      | string | 1–256 characters, no control characters (U+0000–U+001F) |
| `dataset_version` | int    | `0 … 2^53-1` |
| `metadata`        | object | optional; ≤ 64 entries; keys match `[A-Za-z0-9][A-Za-z0-9_.-]{0,63}`; values are strings (≤ 1024 characters, no control characters) or ints (abs ≤ 2^53-1) |

Any other key is rejected: a new field means a new format version byte. Ints never include
booleans. The header is **authenticated but not encrypted**: never put secrets in `dataset_id`
or `metadata`.

## Decoding (normative; stop at the first failure)

1. `magic`: an empty file or other first 7 bytes → *format error* "not a cvm-tune encrypted
   dataset"; a version byte other than 1 or 2 → *format error* "unsupported version N". `header_len` out of
   range, the file ending before the end of `header_mac`, a header that is not canonical JSON or breaks a
   rule above → *format error*. Nothing is trusted yet.
   * Version 1 while the reader pins an owner key → *unsigned dataset*.
   * Version 2: the file must be seekable. Read the last 176 bytes: trailer magic and a valid
     signature under the public key it carries, else → *signature error* (magic present, signature
     fails), *trailing data* (a valid trailer found at most 1024 bytes earlier), or *truncated*
     (no trailer: cut short). A pinned owner key that differs from the trailer's → *signature
     error*. From here on the file ends where the trailer begins.
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
5. Release chunk `i`'s plaintext only after its tag verified. Version 2: before releasing the
   final chunk, the body SHA-256, plaintext size and plaintext SHA-256 must equal the signed
   statement → else *signature error* (content re-encrypted or replaced under the same key).

What each damage looks like:

| damage | error (`app.errors`) |
|---|---|
| empty file, bad magic/version, bad `header_len`, malformed header, cut inside the header | `DatasetFormatError` |
| v1 file where an owner key is pinned | `UnsignedDatasetError` |
| v2: trailer signature modified, statement edited, signed by another owner than the pinned one, body or plaintext differing from the statement | `DatasetSignatureError` |
| v2: trailer cut or missing | `TruncatedDatasetError` |
| v2: bytes appended after the trailer | `TrailingDataError` (at most 1024 bytes; more: `TruncatedDatasetError`) |
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
* Version 2 adds **authenticity independent of the key**: whoever holds the dataset key (a host
  that forged a dstack encrypted env var, say) still cannot produce a file the pinned owner signed.
* Rollback to an older *validly signed* file is not a format property: the app keeps the last
  trained `dataset_version` per dataset id on its output volume (`app.dataset.versions`).
* Streaming decryption runs in two stages (chunks ≥ 64 KiB): a worker thread reads, hashes and
  opens each block while the caller's thread hashes the previous plaintext; memory stays at about
  one ciphertext block and two plaintext chunks.

## Version 2 test vector

As the version 1 vector below (same key, salt, chunk size, id, version and plaintext), signed by the
owner key whose Ed25519 seed is `22 × 32` (public key `a09aa5f47a6759802ff955f8dc2d2a14a5c99d23be97f864127ff9383455a4f0`;
Ed25519 signatures are deterministic). The file (hex, 494 bytes):

      43564d5444530002000000d17b22616c67223a224145532d3235362d47434d2f
      484b44462d5348413235362f53545245414d2d7631222c226368756e6b5f7369
      7a65223a343039362c22636f6e74656e745f74797065223a226170706c696361
      74696f6e2f6a736f6e6c222c22646174617365745f6964223a226b6174222c22
      646174617365745f76657273696f6e223a312c2273616c74223a223131313131
      3131313131313131313131313131313131313131313131313131313131313131
      313131313131313131313131313131313131313131313131313131227d53e333
      0d688450f2681b248f91f5f71d536abfb3f9924703b3237a295058b32523b8aa
      9a8ad12034bd1124acea73e2c616dc1becee1385c0017d453315394ec2e72567
      06cd0af2c8eb96c56892c21bdefe82a62c7fe9805b2b5ce3165089db60b34356
      4d5444534947a09aa5f47a6759802ff955f8dc2d2a14a5c99d23be97f864127f
      f9383455a4f0000000000000001161089649a563a525014d86b167cbe5fae69e
      2fe431245d6bec5e65f298906b3ae8a76f34d8394cc0a516a096d9ad34b3d3b0
      5124b0739043dabf6fdb67dc71692a309dac6fc03517280d8fd04249a1a2fa91
      98320a54461d3386c4cd432927a9a80e5255ab0424e3778579e027b6667e3642
      03c9a4c90fd9359476b88362be04

File SHA-256: `c4dc0711c93911fd738f322ce62e4590c8b56d47c46a9389b7eddded07f0d688`; commitment
`f15ad93ccddd29e8a0e0b5275de00b218ca941730f797fdcc7302c962a972d47`.

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
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from app.dataset.format_header import (
    ALG,
    BLOB_CONTENT_TYPE,
    CONTENT_TYPE,
    CONTENT_TYPES,
    DEFAULT_CHUNK_SIZE,
    FORMAT_MAGIC,
    FORMAT_MAGIC_V2,
    FORMAT_VERSIONS,
    KEY_CHECK_MESSAGE,
    KEY_LEN,
    MAC_LEN,
    MAX_CHUNK_SIZE,
    MAX_HEADER_LEN,
    MIN_CHUNK_SIZE,
    TAG_LEN,
    TRAILING_SEARCH,
    DatasetHeader,
    EncryptResult,
    _check_key,
    _derive,
    _header_from_obj,
    _hmac,
    _parse_header,
    _read_prefix,
    _read_upto,
    read_header,
)
from app.dataset.format_read import THREADED_HASH_MIN_CHUNK, DecryptedStream
from app.dataset.format_sig import _read_trailer, read_signature
from app.dataset.format_write import write_chunks
from app.errors import (
    ConfigError,
    DataError,
    DatasetFormatError,
    HeaderIntegrityError,
    UnsignedDatasetError,
    WrongKeyError,
)
from app.fsutil import fsync_dir
from attestation.io.hashing import canonical_json

__all__ = [
    "ALG", "BLOB_CONTENT_TYPE", "CONTENT_TYPE", "CONTENT_TYPES", "DEFAULT_CHUNK_SIZE", "FORMAT_MAGIC", "FORMAT_MAGIC_V2",
    "FORMAT_VERSIONS", "KEY_CHECK_MESSAGE", "KEY_LEN", "MAC_LEN", "MAX_CHUNK_SIZE", "MAX_HEADER_LEN", "MIN_CHUNK_SIZE",
    "TAG_LEN", "THREADED_HASH_MIN_CHUNK", "TRAILING_SEARCH", "DatasetHeader", "DecryptedStream", "EncryptResult",
    "encrypt_file", "encrypt_stream", "open_encrypted", "read_header", "read_signature",
]


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

    return write_chunks(src, dst, header=header, head=prefix + key_check + header_mac, aead=aead, aad=header_mac,
                        owner_key=owner_key)


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


def open_encrypted(src: BinaryIO, key: bytes, *, content_type: str | tuple[str, ...] = CONTENT_TYPE,
                   owner_public_key: bytes | None = None) -> DecryptedStream:
    """Authenticate the header (and, version 2, the owner signature) and return the chunk stream.

    Args:
        src: the encrypted file, positioned at its start; read sequentially, never whole (a
            version-2 file must be seekable: its trailer is read first).
        key: the 32-byte dataset key.
        content_type: the content type the caller expects (a JSONL dataset by default), or a tuple of those it
            takes.
        owner_public_key: the pinned owner's raw Ed25519 public key. When given, the file must be
            version 2 and signed by exactly this key, checked before the key is used.

    Returns:
        A :class:`DecryptedStream` whose ``header`` is authenticated. Chunk errors
        (:class:`ChunkIntegrityError`, :class:`TruncatedDatasetError`,
        :class:`TrailingDataError`, and for version 2 :class:`DatasetSignatureError` when the
        content differs from the signed statement) are raised while iterating it.

    Raises:
        KeySourceError: the key is not 32 bytes.
        DatasetFormatError: not a version-1 or -2 dataset, or a malformed header.
        UnsignedDatasetError: ``owner_public_key`` given and the file is version 1.
        DatasetSignatureError: the trailer's signature fails, or it names another owner key.
        TruncatedDatasetError, TrailingDataError: version 2 without a trailer at end-of-file.
        WrongKeyError: the key does not open this file (nothing was decrypted).
        HeaderIntegrityError: the header or its MAC was modified.
        DatasetFormatError: the authenticated header names another content type.
    """
    _check_key(key)
    prefix = _read_prefix(src)
    version = prefix[7]
    header = dataclasses.replace(_parse_header(prefix[12:]), format_version=version)
    signature = None
    if version == 1 and owner_public_key is not None:
        raise UnsignedDatasetError("the dataset carries no owner signature (format version 1), but the configuration "
                                   "pins an owner key (dataset.owner_public_key)")
    if version == 2:
        signature, src = _read_trailer(src, len(prefix))
        if owner_public_key is not None and signature.owner_public_key != bytes(owner_public_key):
            from app.dataset.owner import signer_mismatch

            raise signer_mismatch("the dataset", signature.owner_public_key, bytes(owner_public_key))
    tail = _read_upto(src, 2 * MAC_LEN)
    if len(tail) < 2 * MAC_LEN:
        raise DatasetFormatError("the file ends inside the dataset header (key check / MAC)")
    key_check, header_mac = tail[:MAC_LEN], tail[MAC_LEN:]
    try:  # before anything else uses the key
        _hmac(_derive(key, header.salt, b"check", version), KEY_CHECK_MESSAGE).verify(key_check)
    except InvalidSignature:
        raise WrongKeyError("the key does not open this dataset (key check failed; nothing was decrypted)") from None
    try:
        _hmac(_derive(key, header.salt, b"header", version), prefix + key_check).verify(header_mac)
    except InvalidSignature:
        raise HeaderIntegrityError("the dataset header was modified (header MAC mismatch)") from None
    wanted = (content_type,) if isinstance(content_type, str) else tuple(content_type)
    if header.content_type not in wanted:
        raise DatasetFormatError(f"the file holds {header.content_type}, not {' or '.join(wanted)}")
    return DecryptedStream(src, header, AESGCM(_derive(key, header.salt, b"payload", version)), header_mac,
                           prefix + tail, signature)
