"""Encoding: the chunks and the version-2 trailer after an already derived header (the writer's half).

:func:`app.dataset.format.encrypt_stream` builds and checks the header; this writes the rest.
"""

from __future__ import annotations

import hashlib
from typing import BinaryIO

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from app.dataset.format_header import DatasetHeader, EncryptResult, _nonce, _read_upto
from attestation.bundle.dataset_sig import make_trailer, parse_trailer


def write_chunks(src: BinaryIO, dst: BinaryIO, *, header: DatasetHeader, head: bytes, aead: AESGCM, aad: bytes,
                 owner_key: Ed25519PrivateKey | None) -> EncryptResult:
    """Write ``head`` (magic to header MAC), every chunk of ``src`` and, with ``owner_key``, the trailer."""
    chunk_size = header.chunk_size
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

    emit(head)
    index, plain_size = 0, 0
    cur = _read_upto(src, chunk_size)
    while True:
        nxt = _read_upto(src, chunk_size) if len(cur) == chunk_size else b""
        final = not nxt  # a full chunk followed by end-of-file is itself the final chunk
        pt_hash.update(cur)
        plain_size += len(cur)
        emit(aead.encrypt(_nonce(index, final), cur, aad))
        index += 1
        if final:
            break
        cur = nxt
    signature = None
    if owner_key is not None:
        trailer = make_trailer(owner_key, plaintext_size=plain_size, plaintext_sha256=pt_hash.digest(),
                               body_sha256=ct_hash.digest())
        signature = parse_trailer(trailer)
        emit(trailer)
    return EncryptResult(header=header, plaintext_size=plain_size, plaintext_sha256=pt_hash.hexdigest(),
                         ciphertext_size=written, ciphertext_sha256=ct_hash.hexdigest(), chunks=index,
                         signature=signature)
