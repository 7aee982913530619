"""Reading a dataset file: :func:`open_encrypted` and the authenticated chunk stream."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from app.dataset.format.header import (
    CONTENT_TYPE,
    KEY_CHECK_MESSAGE,
    MAC_LEN,
    TAG_LEN,
    THREADED_HASH_MIN_CHUNK,
    TRAILING_SEARCH,
    DatasetHeader,
    _check_key,
    _derive,
    _fill,
    _hmac,
    _nonce,
    _parse_header,
    _read_prefix,
    _read_upto,
)
from app.dataset.format.signature import _read_trailer
from app.errors import (
    ChunkIntegrityError,
    DatasetFormatError,
    DatasetSignatureError,
    HeaderIntegrityError,
    KeySourceError,
    TrailingDataError,
    TruncatedDatasetError,
    UnsignedDatasetError,
    WrongKeyError,
)
from attestation.dataset_sig import TRAILER_LEN, OwnerSignature


class _Hasher:
    """SHA-256 whose updates may run on one worker thread, in order, one at a time.

    hashlib releases the GIL on large buffers, so the ciphertext hash, the plaintext hash and
    AES-GCM (which holds the GIL) proceed in parallel on separate cores. The caller must not
    modify a buffer until :meth:`wait` returned after its update.
    """

    def __init__(self, prefix: bytes, threaded: bool) -> None:
        self._h = hashlib.sha256(prefix)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cvm-tune-hash") if threaded else None
        self._pending: Future[None] | None = None

    def update(self, data: bytes | memoryview) -> None:
        self.wait()
        if self._pool is None:
            self._h.update(data)
        else:
            self._pending = self._pool.submit(self._h.update, data)

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def hexdigest(self) -> str:
        self.wait()
        return self._h.hexdigest()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # finishes a pending update: no thread outlives the stream
            self._pool = None


class DecryptedStream:
    """Authenticated plaintext chunks of one dataset file; iterate once.

    ``header`` is authenticated (key check and header MAC passed). Each yielded chunk verified its
    own tag, but the stream as a whole is authentic only when iteration ends without an error:
    callers that must not act on partial data consume the whole stream first. The totals
    (``plaintext_size``, ``plaintext_sha256``, ``ciphertext_size``, ``ciphertext_sha256`` over all
    bytes of the file, header and trailer included, and ``chunks``) exist only after a complete
    iteration. For a version-2 file, ``signature`` is the owner's statement; the final chunk is
    released only after the body and plaintext matched it.
    """

    def __init__(self, src: BinaryIO, header: DatasetHeader, payload_key: bytes, aad: bytes, prefix: bytes,
                 signature: OwnerSignature | None = None) -> None:
        self.header = header
        self.signature = signature
        self._src = src
        self._aead = AESGCM(payload_key)
        self._aad = aad
        threaded = header.chunk_size >= THREADED_HASH_MIN_CHUNK
        self._ct_hash = _Hasher(prefix, threaded)
        self._ct_size = len(prefix)
        self._pt_hash = _Hasher(b"", threaded)
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
        try:
            yield from self._chunks_of()
        finally:
            self._ct_hash.close()
            self._pt_hash.close()

    def _chunks_of(self) -> Iterator[bytes]:
        size = self.header.chunk_size + TAG_LEN
        buf = bytearray(size)  # reused: memory stays at one ciphertext block plus two plaintext chunks
        view = memoryview(buf)
        n = _fill(self._src, view)
        if n == 0:
            raise TruncatedDatasetError("the stream ended without a final chunk (no chunks after the header)")
        index = 0
        while True:
            peek = self._src.read(1) if n == size else b""  # look ahead: is this block the last one?
            block = view[:n]
            self._ct_hash.update(block)  # on the worker thread, while this thread decrypts
            offset = self._ct_size
            self._ct_size += n
            plain = self._open_inner(block, index, offset) if peek else self._open_last(block, index, offset)
            self._pt_hash.update(plain)
            self._pt_size += len(plain)
            self._chunks += 1
            if not peek:
                self._check_signed_statement()
            self._ct_hash.wait()  # ``buf`` is refilled below
            self.complete = not peek  # the final chunk verified and end-of-file follows it
            yield plain
            if self.complete:
                return
            index += 1
            buf[0] = peek[0]
            n = 1 + _fill(self._src, view[1:])

    def _check_signed_statement(self) -> None:
        """Version 2: the body and plaintext must be exactly what the owner signed; then hash the trailer."""
        sig = self.signature
        if sig is None:
            return
        if (self._ct_hash.hexdigest() != sig.body_sha256 or self._pt_size != sig.plaintext_size
                or self._pt_hash.hexdigest() != sig.plaintext_sha256):
            raise DatasetSignatureError("the dataset content differs from what the owner signed "
                                        "(body or plaintext hash mismatch): it was re-encrypted or replaced")
        self._ct_hash.update(sig.trailer)
        self._ct_size += TRAILER_LEN

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


def open_encrypted(src: BinaryIO, key: bytes, *, content_type: str = CONTENT_TYPE,
                   owner_public_key: bytes | None = None) -> DecryptedStream:
    """Authenticate the header (and, version 2, the owner signature) and return the chunk stream.

    Args:
        src: the encrypted file, positioned at its start; read sequentially, never whole (a
            version-2 file must be seekable: its trailer is read first).
        key: the 32-byte dataset key.
        content_type: the content type the caller expects (a dataset by default).
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
            raise DatasetSignatureError(f"the dataset is signed by owner key {signature.owner_key_id[:16]}…, not by the "
                                        f"pinned key {hashlib.sha256(bytes(owner_public_key)).hexdigest()[:16]}…")
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
    if header.content_type != content_type:
        raise DatasetFormatError(f"the file holds {header.content_type}, not {content_type}")
    return DecryptedStream(src, header, _derive(key, header.salt, b"payload", version), header_mac, prefix + tail,
                           signature)
