"""The encrypted dataset: streaming AEAD file format, key sources and JSONL row validation.

Plaintext exists only in memory: :func:`open_encrypted` yields authenticated chunks and
:func:`parse_jsonl` turns them into validated rows. The file format is specified in
:mod:`app.dataset.format`.
"""

from app.dataset.format import (
    DEFAULT_CHUNK_SIZE,
    FORMAT_MAGIC,
    DatasetHeader,
    DecryptedStream,
    EncryptResult,
    encrypt_file,
    encrypt_stream,
    open_encrypted,
    read_header,
)
from app.dataset.keys import DerivedKeySource, KeyFileSource, KeySource, write_key_file
from app.dataset.rows import RowReport, parse_jsonl

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "FORMAT_MAGIC",
    "DatasetHeader",
    "DecryptedStream",
    "DerivedKeySource",
    "EncryptResult",
    "KeyFileSource",
    "KeySource",
    "RowReport",
    "encrypt_file",
    "encrypt_stream",
    "open_encrypted",
    "parse_jsonl",
    "read_header",
    "write_key_file",
]
