"""Dataset format version 2: reading the owner-signature trailer (decoding step 1, version 2).

The trailer itself (layout, signature) is :mod:`attestation.bundle.dataset_sig`; the normative file
format is the docstring of :mod:`app.dataset.format`.
"""

from __future__ import annotations

import os
from typing import BinaryIO

from app.dataset.format_header import MAC_LEN, TRAILING_SEARCH, _parse_header, _read_prefix, _read_upto
from app.errors import DatasetFormatError, DatasetSignatureError, TrailingDataError, TruncatedDatasetError
from attestation.bundle.dataset_sig import TRAILER_LEN, TRAILER_MAGIC, OwnerSignature, TrailerError, parse_trailer


class _Bounded:
    """A read-only view of ``src`` that ends ``limit`` bytes after its current position."""

    def __init__(self, src: BinaryIO, limit: int) -> None:
        self._src = src
        self.left = limit

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = self._src.read(n) if n else b""
        self.left -= len(data)
        return data

    def readinto(self, b: memoryview | bytearray) -> int:
        view = memoryview(b)[: self.left]
        if not view:
            return 0
        readinto = getattr(self._src, "readinto", None)
        if readinto is not None:
            n = readinto(view) or 0
        else:
            data = self._src.read(len(view))
            n = len(data)
            view[:n] = data
        self.left -= n
        return n

def _read_trailer(src: BinaryIO, pos: int) -> tuple[OwnerSignature, BinaryIO]:
    """Version 2, decoding step 2: the owner-signature trailer at end-of-file.

    Returns the verified signature and ``src`` positioned at ``pos``, bounded to end before the
    trailer (the chunks are then decoded exactly as in version 1).
    """
    try:
        size = src.seek(0, os.SEEK_END)
    except (AttributeError, OSError, ValueError):
        raise DatasetFormatError("a signed (version 2) dataset must be read from a seekable file") from None
    if size < pos + 2 * MAC_LEN:
        raise DatasetFormatError("the file ends inside the dataset header (key check / MAC)")
    if size < pos + 2 * MAC_LEN + TRAILER_LEN:
        raise TruncatedDatasetError("the file ends without chunks and owner-signature trailer: it was cut short")
    search = min(size - pos - 2 * MAC_LEN, TRAILER_LEN + TRAILING_SEARCH)
    src.seek(size - search)
    end = _read_upto(src, search)
    try:
        signature = parse_trailer(end[-TRAILER_LEN:])
    except TrailerError as exc:
        if end[-TRAILER_LEN:].startswith(TRAILER_MAGIC):  # a trailer whose signature fails
            raise DatasetSignatureError(str(exc)) from None
        at = end.rfind(TRAILER_MAGIC, 0, len(end) - TRAILER_LEN - 1 + len(TRAILER_MAGIC))  # a trailer ending earlier
        if at >= 0 and _is_trailer(end[at : at + TRAILER_LEN]):
            raise TrailingDataError(f"{len(end) - at - TRAILER_LEN} bytes follow the owner-signature trailer") from None
        raise TruncatedDatasetError("the file ends without an owner-signature trailer: it was cut short") from None
    src.seek(pos)
    return signature, _Bounded(src, size - TRAILER_LEN - pos)  # type: ignore[return-value]  # file-like


def _is_trailer(raw: bytes) -> bool:
    try:
        parse_trailer(raw)
    except TrailerError:
        return False
    return True


def read_signature(src: BinaryIO) -> OwnerSignature | None:
    """The owner signature of a dataset file (``None`` for version 1), without a key.

    The trailer's signature is verified under the key it names; whether that key is the expected
    owner, and whether the content matches the statement, is the caller's (or decryption's) job.

    Raises:
        DatasetFormatError: not a dataset, or a malformed header.
        TruncatedDatasetError, TrailingDataError, DatasetSignatureError: as in :func:`open_encrypted`.
    """
    prefix = _read_prefix(src)
    _parse_header(prefix[12:])
    if prefix[7] == 1:
        return None
    return _read_trailer(src, len(prefix))[0]
