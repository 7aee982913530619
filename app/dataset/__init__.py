"""The encrypted dataset: streaming AEAD file format, key sources and JSONL row validation.

Plaintext exists only in memory: :func:`open_encrypted` yields authenticated chunks and
:func:`parse_jsonl` turns them into validated rows. The file format is specified in
:mod:`app.dataset.format`; the owner's keys in :mod:`app.dataset.owner`, the attested key release
in :mod:`app.dataset.release`, rollback protection in :mod:`app.dataset.versions`.
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
    read_signature,
)
from app.dataset.keys import DerivedKeySource, EnvKeySource, KeyFileSource, KeySource, write_key_file
from app.dataset.rows import RowReport, parse_jsonl

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "FORMAT_MAGIC",
    "DatasetHeader",
    "DecryptedStream",
    "DerivedKeySource",
    "EncryptResult",
    "EnvKeySource",
    "KeyFileSource",
    "KeySource",
    "RowReport",
    "encrypt_file",
    "encrypt_stream",
    "open_encrypted",
    "parse_jsonl",
    "read_header",
    "read_signature",
    "write_key_file",
]
