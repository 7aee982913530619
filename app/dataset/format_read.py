"""Decoding steps 4-5: the authenticated chunk stream of an opened dataset file.

Stage one (:class:`app.dataset.format_blocks.BlockReader`) reads and hashes the ciphertext; this
module opens each block with AES-GCM, hashes the plaintext, classifies every failure (the table in
:mod:`app.dataset.format`) and checks the version-2 signed statement before the final chunk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import BinaryIO

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from app.dataset.format_blocks import BlockReader
from app.dataset.format_header import TAG_LEN, TRAILING_SEARCH, DatasetHeader, _nonce
from app.errors import ChunkIntegrityError, DatasetFormatError, DatasetSignatureError, TrailingDataError, TruncatedDatasetError
from attestation.bundle.dataset_sig import OwnerSignature

# Chunks at least this large are read, hashed and opened on a worker thread (hashlib and reads release the GIL):
# the ciphertext hash overlaps the plaintext hash; smaller chunks are handled inline.
THREADED_HASH_MIN_CHUNK = 64 << 10


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

    def __init__(self, src: BinaryIO, header: DatasetHeader, aead: AESGCM, aad: bytes, prefix: bytes,
                 signature: OwnerSignature | None = None) -> None:
        self.header = header
        self.signature = signature
        self._aead = aead  # keyed with the payload key
        self._aad = aad
        self._blocks = BlockReader(src, header.chunk_size + TAG_LEN, prefix, self._open,
                                   threaded=header.chunk_size >= THREADED_HASH_MIN_CHUNK)
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
        return self._blocks.size

    @property
    def ciphertext_sha256(self) -> str:
        self._totals()
        return self._blocks.hexdigest()

    @property
    def chunks(self) -> int:
        self._totals()
        return self._chunks

    def _run(self) -> Iterator[bytes]:
        try:
            yield from self._chunks_of()
        finally:
            self._blocks.close()

    def _chunks_of(self) -> Iterator[bytes]:
        for plain, last in self._blocks:
            if plain is None:
                raise TruncatedDatasetError("the stream ended without a final chunk (no chunks after the header)")
            self._pt_size += len(plain)
            self._chunks += 1
            if last:
                self._pt_hash.update(plain)
                self._check_signed_statement()
                self.complete = True  # the final chunk verified and end-of-file follows it
                yield plain
                return
            yield plain
            self._blocks.advance()  # stage one opens the next block while this thread hashes this one
            self._pt_hash.update(plain)

    def _open(self, block: memoryview, index: int, offset: int, final: bool) -> bytes:
        """Stage one's callback: AES-GCM-open block ``index``, or raise the classified error."""
        return self._open_last(block, index, offset) if final else self._open_inner(block, index, offset)

    def _check_signed_statement(self) -> None:
        """Version 2: the body and plaintext must be exactly what the owner signed; then hash the trailer."""
        sig = self.signature
        if sig is None:
            return
        if (self._blocks.hexdigest() != sig.body_sha256 or self._pt_size != sig.plaintext_size
                or self._pt_hash.hexdigest() != sig.plaintext_sha256):
            raise DatasetSignatureError("the dataset content differs from what the owner signed "
                                        "(body or plaintext hash mismatch): it was re-encrypted or replaced")
        self._blocks.update(sig.trailer)

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
