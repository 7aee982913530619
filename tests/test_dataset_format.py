"""The encrypted dataset format (app.dataset.format) and key sources (app.dataset.keys).

Bad-input cases from threats-and-faults.md §7: 1 wrong key, 2 cut at a chunk boundary, 3 cut
mid-chunk, 4 reorder, 5 duplicate, 6 bit flips (chunk / header / MAC), 7 trailing data, 9 file for
another key. Every failure test asserts the exact error class.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import re
import stat
import tracemalloc
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.dataset import (
    DEFAULT_CHUNK_SIZE,
    FORMAT_MAGIC,
    DerivedKeySource,
    KeyFileSource,
    KeySource,
    encrypt_file,
    encrypt_stream,
    open_encrypted,
    read_header,
    write_key_file,
)
from app.dataset import format as fmt
from app.errors import (
    ChunkIntegrityError,
    ConfigError,
    DataError,
    DatasetFormatError,
    HeaderIntegrityError,
    KeySourceError,
    TrailingDataError,
    TruncatedDatasetError,
    WrongKeyError,
)

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
CS = 4096
C = CS + 16  # ciphertext bytes of one full chunk


def plaintext(n: int, seed: int = 0) -> bytes:
    return hashlib.shake_256(f"{seed}:{n}".encode()).digest(n) if n else b""


def enc(pt: bytes, key: bytes = KEY, chunk_size: int = CS, **kw) -> bytes:
    out = io.BytesIO()
    kw.setdefault("dataset_id", "test-set")
    encrypt_stream(io.BytesIO(pt), out, key, chunk_size=chunk_size, **kw)
    return out.getvalue()


def body_start(data: bytes) -> int:
    return 12 + int.from_bytes(data[8:12], "big") + 64


def chunk_at(data: bytes, i: int) -> slice:
    start = body_start(data) + i * C
    return slice(start, start + C)


def decrypt_collect(data: bytes, key: bytes = KEY) -> tuple[list[bytes], BaseException | None]:
    """Plaintext released before the error (if any), and the error."""
    released: list[bytes] = []
    try:
        for piece in open_encrypted(io.BytesIO(data), key):
            released.append(piece)
    except Exception as exc:  # noqa: BLE001 - the caller asserts the class
        return released, exc
    return released, None


def expect(data: bytes, cls: type[BaseException], pt: bytes | None = None, key: bytes = KEY) -> BaseException:
    """Decryption raises exactly ``cls``; what was released is a prefix of ``pt``."""
    released, exc = decrypt_collect(data, key)
    assert type(exc) is cls, f"expected {cls.__name__}, got {type(exc).__name__}: {exc}"
    if pt is not None:
        assert pt.startswith(b"".join(released))
    return exc


def flip(data: bytes, pos: int, mask: int = 0x01) -> bytes:
    out = bytearray(data)
    out[pos] ^= mask
    return bytes(out)


# ---- an independent implementation written from the format docstring only (stdlib hmac, no app code)


def _spec_key(key: bytes, salt: bytes, label: bytes) -> bytes:
    return HKDF(hashes.SHA256(), 32, salt, b"cvm-tune/dataset/v1/" + label).derive(key)


def spec_encode(chunks: list[bytes], key: bytes, salt: bytes, header: dict) -> bytes:
    raw = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    pre = b"CVMTDS\x00\x01" + len(raw).to_bytes(4, "big") + raw
    kc = hmac.new(_spec_key(key, salt, b"check"), b"cvm-tune key check", hashlib.sha256).digest()
    mac = hmac.new(_spec_key(key, salt, b"header"), pre + kc, hashlib.sha256).digest()
    aead = AESGCM(_spec_key(key, salt, b"payload"))
    out = [pre, kc, mac]
    for i, c in enumerate(chunks):
        out.append(aead.encrypt(i.to_bytes(11, "big") + bytes([i == len(chunks) - 1]), c, mac))
    return b"".join(out)


def spec_decode(data: bytes, key: bytes) -> bytes:
    assert data[:8] == b"CVMTDS\x00\x01"
    hl = int.from_bytes(data[8:12], "big")
    header = json.loads(data[12 : 12 + hl])
    salt, cs = bytes.fromhex(header["salt"]), header["chunk_size"]
    kc, mac = data[12 + hl : 12 + hl + 32], data[12 + hl + 32 : 12 + hl + 64]
    assert hmac.compare_digest(hmac.new(_spec_key(key, salt, b"check"), b"cvm-tune key check", hashlib.sha256).digest(), kc)
    assert hmac.compare_digest(hmac.new(_spec_key(key, salt, b"header"), data[: 12 + hl] + kc, hashlib.sha256).digest(), mac)
    body = data[12 + hl + 64 :]
    blocks = [body[i : i + cs + 16] for i in range(0, len(body), cs + 16)]
    aead = AESGCM(_spec_key(key, salt, b"payload"))
    return b"".join(aead.decrypt(i.to_bytes(11, "big") + bytes([i == len(blocks) - 1]), b, mac) for i, b in enumerate(blocks))


def spec_header(salt: bytes, **extra) -> dict:
    return {"alg": "AES-256-GCM/HKDF-SHA256/STREAM-v1", "chunk_size": CS, "content_type": "application/jsonl",
            "dataset_id": "spec", "dataset_version": 0, "salt": salt.hex(), **extra}


def test_docstring_test_vector_decodes_independently() -> None:
    doc = fmt.__doc__
    block = doc[doc.index("## Test vector") :]
    hexdata = "".join(re.findall(r"^    ([0-9a-f]+)$", block, re.M))
    data = bytes.fromhex(hexdata)
    assert hashlib.sha256(data).hexdigest() in block
    assert f"{len(data)} bytes" in block
    assert spec_decode(data, bytes(range(32))) == b'{"text":"hello"}\n'
    assert b"".join(open_encrypted(io.BytesIO(data), bytes(range(32)))) == b'{"text":"hello"}\n'


def test_vector_is_stable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fmt.writer, "_fresh_salt", lambda: b"\x11" * 32)
    data = enc(b'{"text":"hello"}\n', dataset_id="kat", dataset_version=1)
    assert hashlib.sha256(data).hexdigest() in fmt.__doc__


@pytest.mark.parametrize("n", [0, 1, 17, CS + 5])
def test_spec_encoder_and_implementation_agree(n: int) -> None:
    pt = plaintext(n)
    assert spec_decode(enc(pt), KEY) == pt
    salt = os.urandom(32)
    pieces = [pt[i : i + CS] for i in range(0, len(pt), CS)] or [b""]
    assert b"".join(open_encrypted(io.BytesIO(spec_encode(pieces, KEY, salt, spec_header(salt))), KEY)) == pt


# ---- round trips


@pytest.mark.parametrize("n", [0, 1, CS - 1, CS, CS + 1, 3 * CS])
def test_round_trip_sizes_and_hashes(n: int) -> None:
    pt = plaintext(n)
    out = io.BytesIO()
    res = encrypt_stream(io.BytesIO(pt), out, KEY, dataset_id="ds", dataset_version=3, chunk_size=CS, metadata={"owner": "acme", "rows": 2})
    data = out.getvalue()
    chunks = max(1, -(-n // CS))
    assert (res.plaintext_size, res.plaintext_sha256) == (n, hashlib.sha256(pt).hexdigest())
    assert (res.ciphertext_size, res.ciphertext_sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert res.chunks == chunks
    assert len(data) == body_start(data) + n + 16 * chunks
    stream = open_encrypted(io.BytesIO(data), KEY)
    assert b"".join(stream) == pt
    assert (stream.plaintext_size, stream.plaintext_sha256, stream.chunks) == (n, res.plaintext_sha256, chunks)
    assert (stream.ciphertext_size, stream.ciphertext_sha256) == (len(data), res.ciphertext_sha256)
    assert stream.header == res.header
    assert (stream.header.dataset_id, stream.header.dataset_version, stream.header.metadata) == ("ds", 3, {"owner": "acme", "rows": 2})


def test_read_header_needs_no_key() -> None:
    data = enc(b"x", dataset_id="ds-1", dataset_version=7)
    h = read_header(io.BytesIO(data))
    assert (h.dataset_id, h.dataset_version, h.chunk_size, h.content_type) == ("ds-1", 7, CS, "application/jsonl")
    assert h.raw == data[12 : body_start(data) - 64]
    assert FORMAT_MAGIC == data[:8] and DEFAULT_CHUNK_SIZE == 1 << 20


class _Trickle:
    """A file-like object with only ``read``, returning at most 7 bytes per call."""

    def __init__(self, data: bytes) -> None:
        self._src = io.BytesIO(data)

    def read(self, n: int = -1) -> bytes:
        return self._src.read(min(n, 7) if n >= 0 else 7)


class _TrickleRaw(io.RawIOBase):
    """A raw stream whose ``readinto`` fills at most 7 bytes per call."""

    def __init__(self, data: bytes) -> None:
        self._src = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self._src.read(min(len(b), 7))
        b[: len(data)] = data
        return len(data)


@pytest.mark.parametrize("wrap", [_Trickle, _TrickleRaw])
def test_short_reads_are_handled(wrap) -> None:
    pt = plaintext(2 * CS + 3)
    data = enc(pt)
    assert b"".join(open_encrypted(wrap(data), KEY)) == pt
    out = io.BytesIO()
    encrypt_stream(wrap(pt), out, KEY, dataset_id="t", chunk_size=CS)
    assert spec_decode(out.getvalue(), KEY) == pt


class _PartialWriter(io.RawIOBase):
    """A raw writer that accepts at most 100 bytes per call."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        part = bytes(b[:100])
        self.data += part
        return len(part)


def test_partial_writes_are_completed() -> None:
    pt = plaintext(CS + 7)
    out = _PartialWriter()
    res = encrypt_stream(io.BytesIO(pt), out, KEY, dataset_id="w", chunk_size=CS)
    assert res.ciphertext_size == len(out.data) and spec_decode(bytes(out.data), KEY) == pt


def test_unicode_and_escapes_in_header_round_trip() -> None:
    meta = {"note": 'a "quoted" \\ back\\slash, é ✓ 日本 \U0001F600', "n": -(2**53 - 1), "empty": ""}
    data = enc(b"x", dataset_id="données/2026 ✓", metadata=meta)
    h = open_encrypted(io.BytesIO(data), KEY).header
    assert (h.dataset_id, h.metadata) == ("données/2026 ✓", meta)
    assert h.raw == canon(json.loads(h.raw))
    assert spec_decode(data, KEY) == b"x"


def test_same_plaintext_twice_gives_different_ciphertexts() -> None:
    pt = plaintext(2 * CS)
    a, b = enc(pt), enc(pt)
    assert read_header(io.BytesIO(a)).salt != read_header(io.BytesIO(b)).salt
    assert a[chunk_at(a, 0)] != b[chunk_at(b, 0)] and a[chunk_at(a, 1)] != b[chunk_at(b, 1)]


def test_totals_only_after_full_iteration_and_iterate_once() -> None:
    stream = open_encrypted(io.BytesIO(enc(plaintext(2 * CS))), KEY)
    it = iter(stream)
    next(it)
    with pytest.raises(RuntimeError):
        _ = stream.plaintext_sha256
    list(it)
    assert stream.complete and stream.chunks == 2
    with pytest.raises(RuntimeError):
        iter(stream)


# ---- keys and key checks (cases 1, 9)


class _SpyAESGCM:
    calls = 0

    def __init__(self, key: bytes) -> None:
        self._inner = AESGCM(key)

    def decrypt(self, *args):
        _SpyAESGCM.calls += 1
        return self._inner.decrypt(*args)


def test_wrong_key_fails_before_any_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    data = enc(plaintext(3 * CS), key=OTHER_KEY)  # another tenant's valid file
    monkeypatch.setattr(fmt.reader, "AESGCM", _SpyAESGCM)
    _SpyAESGCM.calls = 0
    with pytest.raises(WrongKeyError):
        open_encrypted(io.BytesIO(data), KEY)
    assert _SpyAESGCM.calls == 0


@pytest.mark.parametrize("key", [b"", b"k" * 31, b"k" * 33, "k" * 32])
def test_key_must_be_32_bytes(key) -> None:
    data = enc(b"x")
    with pytest.raises(KeySourceError) as err:
        open_encrypted(io.BytesIO(data), key)
    assert type(err.value) is KeySourceError
    with pytest.raises(KeySourceError):
        encrypt_stream(io.BytesIO(b"x"), io.BytesIO(), key, dataset_id="x")


# ---- truncation (cases 2, 3)

PT4 = plaintext(3 * CS + 100)  # chunks 0-2 full, chunk 3 final with 100 bytes
DATA4 = enc(PT4)


def test_fixture_layout() -> None:
    assert len(DATA4) == body_start(DATA4) + 3 * C + 116


def test_cut_at_chunk_boundary_is_truncation() -> None:
    exc = expect(DATA4[: body_start(DATA4) + 3 * C], TruncatedDatasetError, PT4)
    assert "without a final chunk" in str(exc)
    released, _ = decrypt_collect(DATA4[: body_start(DATA4) + 3 * C])
    # chunk 2 authenticated only as non-final, so it is never released: it could be the last one
    assert b"".join(released) == PT4[: 2 * CS]


def test_no_chunks_at_all_is_truncation() -> None:
    expect(DATA4[: body_start(DATA4)], TruncatedDatasetError)
    expect(enc(b"")[:-16], TruncatedDatasetError)


@pytest.mark.parametrize("cut", [1, 15, 16, 17, 100, 115, 117, 116 + C // 2, 116 + C - 1])
def test_cut_mid_chunk_is_truncation(cut: int) -> None:
    expect(DATA4[:-cut], TruncatedDatasetError, PT4)


def test_cut_inside_full_final_chunk_is_truncation() -> None:
    pt = plaintext(2 * CS)
    expect(enc(pt)[:-1], TruncatedDatasetError, pt)


@pytest.mark.parametrize("cut", [1, 30, 64, 70])
def test_cut_inside_header_is_format_error(cut: int) -> None:
    head = DATA4[: body_start(DATA4)]
    expect(head[:-cut], DatasetFormatError)


# ---- reorder, duplicate, bit flips (cases 4, 5, 6)


def test_swapped_chunks_fail_at_first_swapped_index() -> None:
    d = bytearray(DATA4)
    d[chunk_at(DATA4, 1)], d[chunk_at(DATA4, 2)] = DATA4[chunk_at(DATA4, 2)], DATA4[chunk_at(DATA4, 1)]
    exc = expect(bytes(d), ChunkIntegrityError, PT4)
    assert "chunk 1 " in str(exc)


def test_duplicated_chunk_is_chunk_integrity_error() -> None:
    s = chunk_at(DATA4, 1)
    exc = expect(DATA4[: s.stop] + DATA4[s] + DATA4[s.stop :], ChunkIntegrityError, PT4)
    assert "chunk 2 " in str(exc)


def test_duplicated_final_chunk_is_trailing_data() -> None:
    pt = plaintext(2 * CS)
    data = enc(pt)
    expect(data + data[chunk_at(data, 1)], TrailingDataError, pt)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_bit_flip_in_chunk(index: int) -> None:
    exc = expect(flip(DATA4, chunk_at(DATA4, index).start + 100), ChunkIntegrityError, PT4)
    assert f"chunk {index} " in str(exc)


def test_bit_flip_in_last_chunk_is_reported_as_truncation() -> None:
    # documented: a modified last chunk and a cut inside it leave the same evidence
    expect(flip(DATA4, len(DATA4) - 20), TruncatedDatasetError, PT4)
    expect(flip(DATA4, len(DATA4) - 1), TruncatedDatasetError, PT4)


def _header_pos(data: bytes, needle: bytes) -> int:
    return 12 + data[12 : body_start(data) - 64].index(needle)


def test_header_edit_is_header_integrity_error() -> None:
    data = enc(b"abc", dataset_id="set-a", dataset_version=5)
    expect(flip(data, _header_pos(data, b"set-a") + 4, ord("a") ^ ord("b")), HeaderIntegrityError)  # set-b
    expect(flip(data, _header_pos(data, b'"dataset_version":5') + 18, 0x05 ^ 0x06), HeaderIntegrityError)  # version 6
    expect(flip(data, _header_pos(data, b'"chunk_size":4096') + 13, ord("4") ^ ord("5")), HeaderIntegrityError)  # 5096


def test_header_salt_edit_is_wrong_key() -> None:
    data = enc(b"abc")
    pos = _header_pos(data, b'"salt":"') + 8
    new = b"1" if data[pos : pos + 1] != b"1" else b"2"
    expect(flip(data, pos, data[pos] ^ new[0]), WrongKeyError)


def test_header_edit_that_breaks_json_is_format_error() -> None:
    data = enc(b"abc")
    expect(flip(data, 12, ord("{") ^ ord("[")), DatasetFormatError)


def test_bit_flip_in_key_check_and_mac() -> None:
    b = body_start(DATA4)
    expect(flip(DATA4, b - 64), WrongKeyError)
    expect(flip(DATA4, b - 33), WrongKeyError)
    expect(flip(DATA4, b - 32), HeaderIntegrityError)
    expect(flip(DATA4, b - 1), HeaderIntegrityError)


# ---- trailing data (case 7)


@pytest.mark.parametrize("n", [3 * CS + 100, 2 * CS, 0])
@pytest.mark.parametrize("garbage", [b"\n", b"\x00" * 16, b"\xa5" * fmt.TRAILING_SEARCH], ids=["newline", "16-zeros", "max-search"])
def test_trailing_garbage_is_rejected(n: int, garbage: bytes) -> None:
    pt = plaintext(n)
    expect(enc(pt) + garbage, TrailingDataError, pt)


def test_long_garbage_after_full_final_chunk_is_trailing() -> None:
    pt = plaintext(2 * CS)
    expect(enc(pt) + os.urandom(3 * C), TrailingDataError, pt)


def test_long_garbage_after_short_final_chunk_is_rejected_as_documented() -> None:
    # beyond TRAILING_SEARCH bytes the end of a short final chunk cannot be found
    expect(DATA4 + os.urandom(2000), TruncatedDatasetError, PT4)
    expect(DATA4 + os.urandom(2 * C), ChunkIntegrityError, PT4)


def test_empty_final_chunk_after_data_is_format_error() -> None:
    salt = os.urandom(32)
    data = spec_encode([plaintext(CS), b""], KEY, salt, spec_header(salt))
    expect(data, DatasetFormatError)


# ---- malformed files


def craft(raw_header: bytes, magic: bytes = FORMAT_MAGIC, length: int | None = None) -> bytes:
    n = len(raw_header) if length is None else length
    return magic + n.to_bytes(4, "big") + raw_header + bytes(64) + bytes(32)


GOOD_HEADER = spec_header(b"\x22" * 32)


def canon(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@pytest.mark.parametrize(
    "data, words",
    [
        (b"", "empty"),
        (b"PK\x03\x04" + bytes(200), "not a cvm-tune"),
        (b'{"text":"plain jsonl"}\n', "not a cvm-tune"),
        (b"CVMT", "ends inside"),
        (craft(canon(GOOD_HEADER), magic=b"CVMTDS\x00\x03"), "unsupported version 3"),
        (craft(canon(GOOD_HEADER), magic=b"CVMTDS\x00\x00"), "unsupported version 0"),
        (craft(b"", length=0), "outside 1..65536"),
        (craft(b"{}", length=65537), "outside 1..65536"),
        (craft(b"{}", length=5000), "ends inside"),
        (craft(b"not json"), "not valid JSON"),
        (craft(b"\xff\xfe{}"), "not valid JSON"),
        (craft(b"[]"), "not a JSON object"),
        (craft(canon({**GOOD_HEADER, "signature": "x"})), "unknown header key"),
        (craft(canon({k: v for k, v in GOOD_HEADER.items() if k != "salt"})), "lacks salt"),
        (craft(json.dumps(GOOD_HEADER).encode()), "not canonical"),
        (craft(canon(GOOD_HEADER)[:-1] + b',"alg":"x"}'), "not valid JSON"),  # duplicate key
        (craft(canon({**GOOD_HEADER, "chunk_size": 1024})), "chunk_size"),
        (craft(canon({**GOOD_HEADER, "chunk_size": 4096.0})), "chunk_size"),
        (craft(canon({**GOOD_HEADER, "chunk_size": (16 << 20) + 1})), "chunk_size"),
        (craft(canon({**GOOD_HEADER, "alg": "AES-128-GCM"})), "alg"),
        (craft(canon({**GOOD_HEADER, "salt": "AB" * 32})), "salt"),
        (craft(canon({**GOOD_HEADER, "content_type": "text/csv"})), "content_type"),
        (craft(canon({**GOOD_HEADER, "dataset_id": ""})), "dataset_id"),
        (craft(canon({**GOOD_HEADER, "dataset_version": -1})), "dataset_version"),
        (craft(canon({**GOOD_HEADER, "dataset_version": True})), "dataset_version"),
        (craft(canon({**GOOD_HEADER, "metadata": {"bad key": "v"}})), "metadata"),
        (craft(canon({**GOOD_HEADER, "metadata": {"k": 1.5}})), "metadata"),
        (craft(canon({**GOOD_HEADER, "metadata": []})), "metadata"),
    ],
)
def test_malformed_file_is_format_error(data: bytes, words: str) -> None:
    exc = expect(data, DatasetFormatError)
    assert words in str(exc)
    with pytest.raises(DatasetFormatError):
        read_header(io.BytesIO(data))


@pytest.mark.parametrize(
    "kw",
    [
        {"chunk_size": 4095}, {"chunk_size": (16 << 20) + 1}, {"dataset_id": ""}, {"dataset_id": "a\nb"},
        {"dataset_version": -1}, {"dataset_version": True}, {"metadata": {"a b": "x"}}, {"metadata": {"k": 0.5}},
        {"metadata": {"k": "x" * 1025}}, {"metadata": {f"k{i}": i for i in range(65)}},
    ],
)
def test_encrypt_rejects_bad_header_parameters(kw: dict) -> None:
    kw = {"dataset_id": "ok", **kw}
    out = io.BytesIO()
    with pytest.raises(ConfigError):
        encrypt_stream(io.BytesIO(b"x"), out, KEY, **kw)
    assert out.getvalue() == b""


# ---- property tests


SMALL_PT = plaintext(2 * CS + 300, seed=1)
SMALL = enc(SMALL_PT, metadata={"k": "v"})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pos=st.integers(0, len(SMALL) - 1), mask=st.integers(1, 255))
def test_any_single_byte_change_is_detected(pos: int, mask: int) -> None:
    released, exc = decrypt_collect(flip(SMALL, pos, mask))
    assert isinstance(exc, DataError | KeySourceError), f"byte {pos} ^ {mask:#x}: {exc!r}"
    assert SMALL_PT.startswith(b"".join(released))  # never wrong plaintext, only authenticated prefixes


@settings(max_examples=200, deadline=None)
@given(cut=st.integers(1, len(SMALL)))
def test_any_truncation_is_detected(cut: int) -> None:
    released, exc = decrypt_collect(SMALL[:-cut])
    assert isinstance(exc, DatasetFormatError | TruncatedDatasetError), f"cut {cut}: {exc!r}"
    assert SMALL_PT.startswith(b"".join(released))


# ---- bounded memory


class _Generated(io.RawIOBase):
    """``total`` pseudo-random bytes made on the fly (never all in memory); hashes what it hands out."""

    def __init__(self, total: int) -> None:
        self.left, self.sha = total, hashlib.sha256()
        self._block = hashlib.shake_256(b"seed").digest(1 << 16)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), self.left, len(self._block))
        b[:n] = self._block[:n]
        self.sha.update(self._block[:n])
        self._block = self._block[1:] + self._block[:1]  # vary the content a little
        self.left -= n
        return n


def test_memory_is_bounded_by_a_few_chunks(tmp_path: Path) -> None:
    total, cs = 64 << 20, DEFAULT_CHUNK_SIZE
    src = _Generated(total)
    dst = tmp_path / "big.cvmds"
    tracemalloc.start()
    try:
        with open(dst, "wb") as out:
            res = encrypt_stream(io.BufferedReader(src, 1 << 16), out, KEY, dataset_id="big")
        _, enc_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        h = hashlib.sha256()
        with open(dst, "rb") as fh:
            stream = open_encrypted(fh, KEY)
            for piece in stream:
                h.update(piece)
        _, dec_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert res.plaintext_sha256 == src.sha.hexdigest() == h.hexdigest() == stream.plaintext_sha256
    assert stream.ciphertext_size == dst.stat().st_size == res.ciphertext_size
    assert enc_peak < 5 * cs, enc_peak
    assert dec_peak < 4 * cs, dec_peak


# ---- encrypt_file atomicity


def _listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_encrypt_file_writes_atomically(tmp_path: Path) -> None:
    src = tmp_path / "rows.jsonl"
    src.write_bytes(plaintext(3 * CS))
    dst = tmp_path / "rows.cvmds"
    res = encrypt_file(src, dst, KEY, dataset_id="rows", chunk_size=CS)
    assert _listing(tmp_path) == ["rows.cvmds", "rows.jsonl"]
    assert hashlib.sha256(dst.read_bytes()).hexdigest() == res.ciphertext_sha256
    assert spec_decode(dst.read_bytes(), KEY) == src.read_bytes()


class _FailingFile(io.BytesIO):
    def __init__(self, data: bytes, fail_after: int, exc: BaseException) -> None:
        super().__init__(data)
        self.fail_after, self.exc = fail_after, exc

    def read(self, n: int = -1) -> bytes:
        if self.tell() >= self.fail_after:
            raise self.exc
        return super().read(n)


@pytest.mark.parametrize("exc, cls", [(OSError(5, "Input/output error"), DataError), (KeyboardInterrupt(), KeyboardInterrupt)])
@pytest.mark.parametrize("existing", [False, True])
def test_encrypt_file_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc, cls, existing: bool) -> None:
    src = tmp_path / "rows.jsonl"
    src.write_bytes(plaintext(5 * CS))
    dst = tmp_path / "rows.cvmds"
    if existing:
        dst.write_bytes(b"previous good file")
    monkeypatch.setattr(fmt.writer, "open", lambda p, mode: _FailingFile(Path(p).read_bytes(), 2 * CS, exc), raising=False)
    with pytest.raises(cls) as err:
        encrypt_file(src, dst, KEY, dataset_id="rows", chunk_size=CS)
    assert type(err.value) is cls
    assert _listing(tmp_path) == (["rows.cvmds", "rows.jsonl"] if existing else ["rows.jsonl"])
    if existing:
        assert dst.read_bytes() == b"previous good file"


def test_encrypt_file_refuses_to_overwrite_its_input(tmp_path: Path) -> None:
    src = tmp_path / "rows.jsonl"
    src.write_bytes(b'{"text":"x"}\n')
    with pytest.raises(ConfigError):
        encrypt_file(src, src, KEY, dataset_id="rows")
    assert src.read_bytes() == b'{"text":"x"}\n' and _listing(tmp_path) == ["rows.jsonl"]


def test_encrypt_file_missing_source(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        encrypt_file(tmp_path / "nope.jsonl", tmp_path / "out.cvmds", KEY, dataset_id="x")
    assert type(err.value) is DataError and _listing(tmp_path) == []


# ---- key sources


def _key_file(tmp_path: Path, data: bytes, mode: int = 0o600) -> Path:
    p = tmp_path / "dataset.key"
    p.write_bytes(data)
    p.chmod(mode)
    return p


@pytest.mark.parametrize("data", [KEY, KEY.hex().encode(), KEY.hex().encode() + b"\n", KEY.hex().upper().encode()])
def test_key_file_raw_and_hex(tmp_path: Path, data: bytes) -> None:
    src = KeyFileSource(_key_file(tmp_path, data))
    assert isinstance(src, KeySource)
    assert src.dataset_key() == KEY
    assert src.describe() == "file:dataset.key"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_key_file_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    p = _key_file(tmp_path, KEY, mode)
    with pytest.raises(KeySourceError) as err:
        KeyFileSource(p).dataset_key()
    assert type(err.value) is KeySourceError
    assert err.value.fix == f"chmod 600 {p}"


@pytest.mark.parametrize("data", [b"", KEY[:31], KEY + b"\x00", KEY.hex().encode()[:-1], b"zz" * 32, KEY.hex().encode() + b"\n\n"])
def test_key_file_wrong_length_or_content(tmp_path: Path, data: bytes) -> None:
    with pytest.raises(KeySourceError) as err:
        KeyFileSource(_key_file(tmp_path, data)).dataset_key()
    assert type(err.value) is KeySourceError
    assert KEY.hex() not in str(err.value)


def test_key_file_missing_or_directory(tmp_path: Path) -> None:
    for p in (tmp_path / "missing.key", tmp_path):
        with pytest.raises(KeySourceError):
            KeyFileSource(p).dataset_key()


def test_write_key_file_creates_0600_and_refuses_overwrite(tmp_path: Path) -> None:
    p = tmp_path / "owner.key"
    write_key_file(p, KEY)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert KeyFileSource(p).dataset_key() == KEY
    with pytest.raises(KeySourceError):
        write_key_file(p, OTHER_KEY)
    assert KeyFileSource(p).dataset_key() == KEY
    assert _listing(tmp_path) == ["owner.key"]
    with pytest.raises(KeySourceError):
        write_key_file(tmp_path / "short.key", b"x" * 31)
    assert _listing(tmp_path) == ["owner.key"]


def test_write_key_file_refuses_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    (tmp_path / "link.key").symlink_to(target)
    with pytest.raises(KeySourceError):
        write_key_file(tmp_path / "link.key", KEY)
    assert not target.exists()


def _fake_get_key(path: str, purpose: str) -> bytes:
    return hashlib.sha256(f"app-123|{path}|{purpose}".encode()).digest()


def test_derived_key_is_deterministic_and_path_dependent() -> None:
    a = DerivedKeySource(_fake_get_key, "cvm-tune/dataset/v1")
    assert isinstance(a, KeySource)
    assert a.dataset_key() == DerivedKeySource(_fake_get_key, "cvm-tune/dataset/v1").dataset_key()
    assert len(a.dataset_key()) == 32
    assert a.dataset_key() != DerivedKeySource(_fake_get_key, "cvm-tune/dataset/v2").dataset_key()
    assert a.dataset_key() != DerivedKeySource(_fake_get_key, "cvm-tune/dataset/v1", purpose="other").dataset_key()
    assert a.dataset_key() != _fake_get_key("cvm-tune/dataset/v1", "cvm-tune-dataset-key")  # HKDF applied
    expected = HKDF(hashes.SHA256(), 32, None, b"cvm-tune/dataset-key/v1").derive(_fake_get_key("cvm-tune/dataset/v1", "cvm-tune-dataset-key"))
    assert a.dataset_key() == expected
    assert a.describe() == "getkey:cvm-tune/dataset/v1"


def test_derived_key_from_another_path_is_wrong_key() -> None:
    data = enc(b'{"text":"x"}\n', key=DerivedKeySource(_fake_get_key, "tenant-a").dataset_key())
    expect(data, WrongKeyError, key=DerivedKeySource(_fake_get_key, "tenant-b").dataset_key())


@pytest.mark.parametrize("material", [b"", b"x" * 31, None])
def test_derived_key_rejects_bad_material(material) -> None:
    with pytest.raises(KeySourceError):
        DerivedKeySource(lambda p, q: material, "p").dataset_key()
