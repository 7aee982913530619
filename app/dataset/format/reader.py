"""Reading a dataset file: :func:`open_encrypted` and the authenticated chunk stream."""

from __future__ import annotations

import dataclasses
import hashlib
import queue
import threading
from collections import deque
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
    """SHA-256 whose updates run in order on one worker thread, up to ``depth`` of them queued.

    hashlib releases the GIL on large buffers, so the plaintext hash proceeds on another core while
    the caller decrypts the next chunk. Updates must be immutable ``bytes`` (they are queued, not copied).
    """

    def __init__(self, threaded: bool, depth: int = 2) -> None:
        self._h = hashlib.sha256()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cvm-tune-hash") if threaded else None
        self._pending: deque[Future[None]] = deque()
        self._depth = depth

    def update(self, data: bytes) -> None:
        if self._pool is None:
            self._h.update(data)
            return
        while len(self._pending) >= self._depth:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self._h.update, data))

    def hexdigest(self) -> str:
        while self._pending:
            self._pending.popleft().result()
        return self._h.hexdigest()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # finishes pending updates: no thread outlives the stream
            self._pool = None


class _Blocks:
    """Stage one of decryption: the ciphertext read in blocks of ``size`` bytes and hashed in order.

    Iterating yields ``(block, final)``: ``final`` means end-of-file follows the block (the last
    block may be short, or empty when nothing follows the header). Threaded, a reader thread fills
    a ring of buffers and hashes each block (file read and SHA-256 both release the GIL) while the
    caller decrypts earlier ones (stage two); a yielded block stays valid until the next one is
    requested. ``hash`` covers every block yielded so far, and is complete once a final block was.
    """

    RING = 4  # buffers: one being decrypted, one queued, one being read, one spare

    def __init__(self, src: BinaryIO, size: int, prefix: bytes, threaded: bool) -> None:
        self.hash = hashlib.sha256(prefix)
        self._src = src
        self._size = size
        self._threaded = threaded
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __iter__(self) -> Iterator[tuple[memoryview, bool]]:
        if not self._threaded:
            return self._inline()
        return self._from_thread()

    def _inline(self) -> Iterator[tuple[memoryview, bool]]:
        cur, nxt = memoryview(bytearray(self._size)), memoryview(bytearray(self._size))
        n = _fill(self._src, cur)
        while True:
            m = _fill(self._src, nxt) if n == self._size else 0  # look ahead: is this block the last one?
            self.hash.update(cur[:n])
            yield cur[:n], m == 0
            if m == 0:
                return
            cur, nxt, n = nxt, cur, m

    def _from_thread(self) -> Iterator[tuple[memoryview, bool]]:
        free: queue.Queue[memoryview | None] = queue.Queue()
        for _ in range(self.RING):
            free.put(memoryview(bytearray(self._size)))
        ready: queue.Queue[tuple[memoryview, int, bool] | BaseException] = queue.Queue()
        self._thread = threading.Thread(target=self._read_ahead, args=(free, ready), name="cvm-tune-read", daemon=True)
        self._thread.start()
        try:
            held = None
            while True:
                item = ready.get()
                if isinstance(item, BaseException):
                    raise item
                if held is not None:
                    free.put(held)  # the caller is done with the previous block
                held, n, final = item
                yield held[:n], final
                if final:
                    return
        finally:
            self._stop.set()
            free.put(None)  # wakes a reader waiting for a buffer
            self._thread.join()

    def _read_ahead(self, free: queue.Queue, ready: queue.Queue) -> None:
        try:
            cur = free.get()
            n = _fill(self._src, cur)
            while not self._stop.is_set():
                nxt = free.get() if n == self._size else None
                if n == self._size and nxt is None:
                    return  # stopped while waiting for a buffer
                m = _fill(self._src, nxt) if nxt is not None else 0
                self.hash.update(cur[:n])
                ready.put((cur, n, m == 0))
                if m == 0:
                    if nxt is not None:
                        free.put(nxt)
                    return
                cur, n = nxt, m
        except BaseException as exc:  # handed to the caller, raised where it iterates
            ready.put(exc)


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
        self._blocks = _Blocks(src, header.chunk_size + TAG_LEN, prefix, threaded)
        self._ct_size = len(prefix)
        self._pt_hash = _Hasher(threaded)
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
        return self._blocks.hash.hexdigest()

    @property
    def chunks(self) -> int:
        self._totals()
        return self._chunks

    def _run(self) -> Iterator[bytes]:
        try:
            yield from self._chunks_of()
        finally:
            self._pt_hash.close()

    def _chunks_of(self) -> Iterator[bytes]:
        """Stage two: each block (read and hashed by :class:`_Blocks`) decrypted and its plaintext hashed."""
        blocks = iter(self._blocks)
        try:
            for index, (block, final) in enumerate(blocks):
                if not block:
                    raise TruncatedDatasetError("the stream ended without a final chunk (no chunks after the header)")
                offset = self._ct_size
                self._ct_size += len(block)
                plain = self._open_last(block, index, offset) if final else self._open_inner(block, index, offset)
                self._pt_hash.update(plain)
                self._pt_size += len(plain)
                self._chunks += 1
                if final:
                    self._check_signed_statement()
                self.complete = final  # the final chunk verified and end-of-file follows it
                yield plain
        finally:
            blocks.close()  # type: ignore[attr-defined]  # a generator: stops and joins the reader thread

    def _check_signed_statement(self) -> None:
        """Version 2: the body and plaintext must be exactly what the owner signed; then hash the trailer."""
        sig = self.signature
        if sig is None:
            return
        if (self._blocks.hash.hexdigest() != sig.body_sha256 or self._pt_size != sig.plaintext_size
                or self._pt_hash.hexdigest() != sig.plaintext_sha256):
            raise DatasetSignatureError("the dataset content differs from what the owner signed "
                                        "(body or plaintext hash mismatch): it was re-encrypted or replaced")
        self._blocks.hash.update(sig.trailer)
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
