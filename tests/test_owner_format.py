"""Dataset format version 2: the owner-signature trailer (app.dataset.format, attestation.bundle.dataset_sig).

An independent decoder written from the format docstring checks the version-2 test vector; every
single-bit flip and every truncation of a small signed file is detected without releasing the
whole plaintext; the signer is checked before the key is used; a signature cannot be stripped by
relabelling the file as version 1.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import re

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from app.dataset import encrypt_stream, open_encrypted
from app.dataset import format as fmt
from app.dataset.format import read_signature
from app.dataset.keys import EnvKeySource
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
from attestation.bundle.dataset_sig import TRAILER_LEN, TrailerError, owner_key_id, read_signed_file

KEY = bytes(range(32))
OWNER = Ed25519PrivateKey.from_private_bytes(b"\x22" * 32)
PUB = OWNER.public_key().public_bytes_raw()
CS = 4096
DETECTED = (DatasetFormatError, WrongKeyError, HeaderIntegrityError, ChunkIntegrityError, TruncatedDatasetError,
            TrailingDataError, DatasetSignatureError)


def enc2(pt: bytes, key: bytes = KEY, signer: Ed25519PrivateKey | None = OWNER, **kw) -> bytes:
    out = io.BytesIO()
    kw.setdefault("dataset_id", "v2-set")
    encrypt_stream(io.BytesIO(pt), out, key, chunk_size=kw.pop("chunk_size", CS), owner_key=signer, **kw)
    return out.getvalue()


def decode(data: bytes, key: bytes = KEY, pub: bytes | None = None) -> tuple[bytes, BaseException | None]:
    released = []
    try:
        for piece in open_encrypted(io.BytesIO(data), key, owner_public_key=pub):
            released.append(piece)
    except Exception as exc:  # noqa: BLE001 - callers check the class
        return b"".join(released), exc
    return b"".join(released), None


def spec_decode_v2(data: bytes, key: bytes) -> tuple[bytes, bytes]:
    """From the docstring only: returns (plaintext, owner public key)."""
    assert data[:8] == b"CVMTDS\x00\x02"
    trailer, body = data[-176:], data[:-176]
    assert trailer[:8] == b"CVMTDSIG"
    statement, sig = trailer[:112], trailer[112:]
    Ed25519PublicKey.from_public_bytes(statement[8:40]).verify(sig, b"cvm-tune/dataset-signature/v2\x00" + statement)
    assert hashlib.sha256(body).digest() == statement[80:112]

    def k(label: bytes) -> bytes:
        return HKDF(hashes.SHA256(), 32, salt, b"cvm-tune/dataset/v2/" + label).derive(key)

    hl = int.from_bytes(body[8:12], "big")
    import json

    header = json.loads(body[12 : 12 + hl])
    salt, cs = bytes.fromhex(header["salt"]), header["chunk_size"]
    kc, mac = body[12 + hl : 12 + hl + 32], body[12 + hl + 32 : 12 + hl + 64]
    assert hmac.compare_digest(hmac.new(k(b"check"), b"cvm-tune key check", hashlib.sha256).digest(), kc)
    assert hmac.compare_digest(hmac.new(k(b"header"), body[: 12 + hl] + kc, hashlib.sha256).digest(), mac)
    chunks = body[12 + hl + 64 :]
    blocks = [chunks[i : i + cs + 16] for i in range(0, len(chunks), cs + 16)]
    aead = AESGCM(k(b"payload"))
    pt = b"".join(aead.decrypt(i.to_bytes(11, "big") + bytes([i == len(blocks) - 1]), b, mac) for i, b in enumerate(blocks))
    assert len(pt) == int.from_bytes(statement[40:48], "big") and hashlib.sha256(pt).digest() == statement[48:80]
    return pt, statement[8:40]


def test_v2_docstring_vector_decodes_independently() -> None:
    doc = fmt.__doc__
    block = doc[doc.index("## Version 2 test vector") : doc.index("## Test vector")]
    data = bytes.fromhex("".join(re.findall(r"^      ([0-9a-f]+)$", block, re.M)))
    assert f"{len(data)} bytes" in block and hashlib.sha256(data).hexdigest() in block
    pt, pub = spec_decode_v2(data, KEY)
    assert pt == b'{"text":"hello"}\n' and pub == PUB and pub.hex() in block
    stream = open_encrypted(io.BytesIO(data), KEY, owner_public_key=PUB)
    assert b"".join(stream) == pt and stream.signature.commitment in block


def test_v2_vector_is_reproduced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fmt, "_fresh_salt", lambda: b"\x11" * 32)
    data = enc2(b'{"text":"hello"}\n', dataset_id="kat", dataset_version=1)
    assert hashlib.sha256(data).hexdigest() in fmt.__doc__


@pytest.mark.parametrize("n, cs", [(0, CS), (1, CS), (CS, CS), (3 * CS + 5, CS), (5 * 65536 + 3, 65536)])
def test_v2_round_trip_hashes_cover_the_whole_file(n: int, cs: int) -> None:
    pt = hashlib.shake_256(str(n).encode()).digest(n)
    out = io.BytesIO()
    res = encrypt_stream(io.BytesIO(pt), out, KEY, dataset_id="r", chunk_size=cs, owner_key=OWNER)
    data = out.getvalue()
    assert (res.ciphertext_size, res.ciphertext_sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert res.header.format_version == 2 and res.signature is not None
    assert (res.signature.plaintext_size, res.signature.plaintext_sha256) == (n, hashlib.sha256(pt).hexdigest())
    assert res.signature.body_sha256 == hashlib.sha256(data[:-TRAILER_LEN]).hexdigest()
    stream = open_encrypted(io.BytesIO(data), KEY, owner_public_key=PUB)  # threaded hashing for 64 KiB chunks
    assert b"".join(stream) == pt
    assert (stream.ciphertext_size, stream.ciphertext_sha256, stream.plaintext_sha256) == (
        len(data), res.ciphertext_sha256, res.plaintext_sha256)
    assert stream.signature == res.signature == read_signature(io.BytesIO(data))
    assert read_signed_file_bytes(data).file_sha256 == res.ciphertext_sha256


def read_signed_file_bytes(data: bytes):
    """``read_signed_file`` on bytes: written to a scratch file, removed again (also when the read raises)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "f.cvmds"
        path.write_bytes(data)
        return read_signed_file(path)


def test_v1_has_no_signature_and_is_refused_when_an_owner_is_pinned() -> None:
    v1 = enc2(b'{"text":"a"}\n', signer=None)
    assert read_signature(io.BytesIO(v1)) is None
    assert decode(v1)[1] is None
    assert type(decode(v1, pub=PUB)[1]) is UnsignedDatasetError


def test_the_signer_is_checked_before_the_key() -> None:
    data = enc2(b'{"text":"a"}\n', signer=Ed25519PrivateKey.from_private_bytes(b"\x01" * 32))
    released, exc = decode(data, key=bytes(32), pub=PUB)  # wrong key AND wrong signer
    assert type(exc) is DatasetSignatureError and released == b""
    assert owner_key_id(PUB)[:16] in str(exc)


def test_a_signature_cannot_be_stripped_by_relabelling_as_version_1() -> None:
    data = enc2(b'{"text":"a"}\n')
    v1 = b"CVMTDS\x00\x01" + data[8:-TRAILER_LEN]
    assert type(decode(v1)[1]) is WrongKeyError  # per-version keys
    assert type(decode(v1, pub=PUB)[1]) is UnsignedDatasetError


def test_v2_needs_a_seekable_file() -> None:
    class Pipe(io.RawIOBase):
        def __init__(self, data: bytes) -> None:
            self._b = io.BytesIO(data)

        def readable(self) -> bool:
            return True

        def readinto(self, b) -> int:
            return self._b.readinto(b)

    with pytest.raises(DatasetFormatError, match="seekable"):
        open_encrypted(Pipe(enc2(b"x")), KEY)


PT = hashlib.shake_256(b"pt").digest(CS + 100)  # two chunks: 8.6 KB of file, every byte tried
SMALL = enc2(PT)


_BODY = 12 + int.from_bytes(SMALL[8:12], "big") + 64
_OUTSIDE_CHUNKS = [*range(_BODY), *range(len(SMALL) - TRAILER_LEN, len(SMALL))]


@pytest.mark.parametrize("bit, positions", [
    (0x01, _OUTSIDE_CHUNKS + list(range(_BODY, len(SMALL) - TRAILER_LEN, 97))),  # chunk flips cost ~1000 AES tries each
    pytest.param(0x80, range(len(SMALL)), marks=pytest.mark.slow),
])
def test_every_single_bit_flip_is_detected_without_releasing_the_whole_plaintext(bit: int, positions) -> None:
    for pos in positions:
        bad = bytearray(SMALL)
        bad[pos] ^= bit
        released, exc = decode(bytes(bad), pub=PUB)
        assert isinstance(exc, DETECTED), (pos, exc)
        assert PT.startswith(released) and len(released) < len(PT), pos


def test_every_truncation_and_short_append_is_detected() -> None:
    for cut in range(1, len(SMALL)):
        released, exc = decode(SMALL[:cut], pub=PUB)
        assert isinstance(exc, DatasetFormatError | TruncatedDatasetError), (cut, exc)
        assert released == b""  # the trailer is read first: nothing is released from a cut file
    for extra in (1, 16, 176, 1024):
        assert type(decode(SMALL + bytes(extra), pub=PUB)[1]) is TrailingDataError
    assert type(decode(SMALL + bytes(1025), pub=PUB)[1]) is TruncatedDatasetError  # as documented


def test_read_signed_file_recomputes_the_body(tmp_path) -> None:
    bad = bytearray(SMALL)
    bad[200] ^= 1
    with pytest.raises(TrailerError, match="body hash mismatch"):
        read_signed_file_bytes(bytes(bad))
    with pytest.raises(TrailerError, match="not a signed"):
        read_signed_file_bytes(enc2(b"x", signer=None))


@pytest.mark.parametrize("value", [None, "", "zz" * 32, "ab" * 31, "ab" * 33])
def test_env_key_source_never_echoes_the_value(value: str | None) -> None:
    env = {} if value is None else {"K": value}
    with pytest.raises(KeySourceError) as err:
        EnvKeySource("K", env).dataset_key()
    if value:
        assert value not in err.value.message
    assert EnvKeySource("K", {"K": " " + KEY.hex().upper() + "\n"}).dataset_key() == KEY
