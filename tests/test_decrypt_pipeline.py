"""Two-stage decryption (app.dataset.format_blocks): the worker-thread path classifies every damage
exactly as the inline path, releases the same chunks, surfaces read errors in order and never
leaves a thread behind."""

from __future__ import annotations

import hashlib
import io
import threading

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from app.dataset import encrypt_stream, open_encrypted
from app.dataset import format_read
from app.errors import (
    ChunkIntegrityError,
    DatasetSignatureError,
    TrailingDataError,
    TruncatedDatasetError,
)

KEY = bytes(range(32))
CS = 4096
C = CS + 16
OWNER = Ed25519PrivateKey.from_private_bytes(b"\x07" * 32)


def _enc(pt: bytes, owner: Ed25519PrivateKey | None = None) -> bytes:
    out = io.BytesIO()
    encrypt_stream(io.BytesIO(pt), out, KEY, dataset_id="pipe", chunk_size=CS, owner_key=owner)
    return out.getvalue()


def _body(data: bytes) -> int:
    return 12 + int.from_bytes(data[8:12], "big") + 64


def _flip(data: bytes, pos: int) -> bytes:
    out = bytearray(data)
    out[pos] ^= 1
    return bytes(out)


PT = hashlib.shake_256(b"pipeline").digest(5 * CS + 123)
V1 = _enc(PT)
V2 = _enc(PT, OWNER)
B = _body(V1)
DAMAGES = {
    "intact": V1,
    "intact-v2": V2,
    "flip-chunk-1": _flip(V1, B + C + 5),
    "flip-last-chunk": _flip(V1, len(V1) - 3),
    "swap-chunks": V1[:B] + V1[B + C : B + 2 * C] + V1[B : B + C] + V1[B + 2 * C :],
    "cut-at-boundary": V1[: B + 3 * C],
    "cut-mid-chunk": V1[: B + 3 * C + 100],
    "trailing-bytes": V1 + b"\n",
    "no-chunks": V1[:B],
    "v2-body-replaced": _enc(PT[::-1], OWNER)[:-176] + V2[-176:],  # re-encrypted under the same key
}


def _decrypt(data: bytes) -> tuple[list[bytes], type[BaseException] | None, str]:
    released: list[bytes] = []
    try:
        stream = open_encrypted(io.BytesIO(data), KEY)
        for piece in stream:
            released.append(piece)
    except Exception as exc:  # noqa: BLE001 - compared below
        return released, type(exc), str(exc)
    return released, None, stream.ciphertext_sha256 + stream.plaintext_sha256


def _decrypt_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name == "cvm-tune-decrypt"}


@pytest.mark.parametrize("name", list(DAMAGES))
def test_threaded_path_matches_inline(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    inline = _decrypt(DAMAGES[name])
    monkeypatch.setattr(format_read, "THREADED_HASH_MIN_CHUNK", 0)  # force the worker thread at 4 KiB chunks
    threaded = _decrypt(DAMAGES[name])
    assert threaded == inline
    assert not _decrypt_threads()


def test_damage_classes_on_the_threaded_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(format_read, "THREADED_HASH_MIN_CHUNK", 0)
    expected = {"intact": None, "intact-v2": None, "flip-chunk-1": ChunkIntegrityError,
                "flip-last-chunk": TruncatedDatasetError, "swap-chunks": ChunkIntegrityError,
                "cut-at-boundary": TruncatedDatasetError, "cut-mid-chunk": TruncatedDatasetError,
                "trailing-bytes": TrailingDataError, "no-chunks": TruncatedDatasetError,
                "v2-body-replaced": DatasetSignatureError}
    got = {name: _decrypt(data)[1] for name, data in DAMAGES.items()}
    assert got == expected
    released, _, _ = _decrypt(DAMAGES["flip-chunk-1"])
    assert released == [PT[:CS]]  # chunk 0 only: nothing after the bad chunk


class _FailingRead(io.BytesIO):
    def __init__(self, data: bytes, fail_at: int) -> None:
        super().__init__(data)
        self.fail_at = fail_at

    def readinto(self, b) -> int:  # type: ignore[override]
        if self.tell() >= self.fail_at:
            raise OSError(5, "Input/output error")
        return super().readinto(b)


def test_read_error_surfaces_in_order_and_joins_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(format_read, "THREADED_HASH_MIN_CHUNK", 0)
    src = _FailingRead(V1, B + 2 * C + 1)
    released = []
    with pytest.raises(OSError):
        for piece in open_encrypted(src, KEY):
            released.append(piece)
    assert released == [PT[:CS], PT[CS : 2 * CS]]
    assert not _decrypt_threads()


def test_abandoned_and_unread_streams_leave_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(format_read, "THREADED_HASH_MIN_CHUNK", 0)
    open_encrypted(io.BytesIO(V1), KEY)  # never iterated: no thread started
    assert not _decrypt_threads()
    stream = open_encrypted(io.BytesIO(V1), KEY)
    it = iter(stream)
    assert next(it) == PT[:CS]
    it.close()  # the caller stops early (e.g. a bad row)
    assert not _decrypt_threads()
    with pytest.raises(RuntimeError):
        stream.plaintext_sha256  # noqa: B018 - totals exist only after a complete read
