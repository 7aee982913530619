"""threats-and-faults.md §7, cases 1-23 (group A: dataset/encryption, group B: row validation).

Each case runs the real pipeline (``run_once``, embedded simulator) on an owner-signed dataset and
asserts the exact error class, that no training step ran (``app.training.train`` never called, no
checkpoint, no export) and that no plaintext reached the disk, the logs, the progress lines or the
error: every dataset carries a canary string, the plaintext exists only in memory (encrypted from
a BytesIO), and everything under the test's directory is scanned for it. Counted policy decisions
(19, 21) assert the counts instead. The end-to-end release flow and a real rollback after a real
run are in test_key_release.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest

import app.training
from app.config import Config
from app.dataset import DerivedKeySource, KeyFileSource, parse_jsonl, write_key_file
from app.dataset.versions import record_version
from app.errors import (
    AllRowsFilteredError,
    ChunkIntegrityError,
    CvmTuneError,
    DatasetFormatError,
    DatasetRollbackError,
    DatasetSignatureError,
    DatasetTooLargeError,
    EmptyDatasetError,
    HeaderIntegrityError,
    RowError,
    StateError,
    TrailingDataError,
    TruncatedDatasetError,
    UnsignedDatasetError,
    WrongKeyError,
    ZeroTrainableTokensError,
)
from app.run.pipeline import run_once
from app.simulator import GuestAgentSimulator
from attestation.bundle.dataset_sig import TRAILER_LEN, public_key_bytes
from tests.owner_fixtures import (
    CANARY,
    INJECTION,
    KEY,
    all_logs,
    chat_row,
    encrypt_to,
    files_containing,
    jsonl,
    owner_key,
    tiny_model_dir,
)

OWNER = owner_key()
ROWS = [chat_row(i) for i in range(200)]
CS = 4096  # small chunks: the 200 rows (~45 KB) span 11 chunks
C = CS + 16


class Case:
    """One pipeline run that must fail cleanly; collects everything the run printed or logged."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp = tmp
        self.ds = tmp / "volume" / "data.cvmds"
        self.ds.parent.mkdir()
        self.key_file = tmp / "dataset.key"
        write_key_file(self.key_file, KEY)
        self.out = tmp / "out"
        self.progress: list[str] = []
        self.trained: list[object] = []
        real = app.training.train
        monkeypatch.setattr(app.training, "train", lambda req: (self.trained.append(req), real(req))[1])

    def config(self, **dataset: object) -> Config:
        ds = {"source": "encrypted-file", "path": str(self.ds), "owner_public_key": public_key_bytes(OWNER).hex(),
              "key": {"source": "file", "file": str(self.key_file)}, **dataset}
        return Config.model_validate({"dataset": ds, "output": {"dir": str(self.out)},
                                      "base_model": {"source": "local-dir", "path": str(tiny_model_dir())},
                                      "training": {"max_steps": 2, "save_steps": 2}})

    def fails(self, cls: type[CvmTuneError], cfg: Config | None = None, **dataset: object) -> CvmTuneError:
        """Run; assert exactly ``cls``, no training, no leak. Returns the error."""
        with all_logs() as logs:
            with pytest.raises(CvmTuneError) as err:
                run_once(cfg or self.config(**dataset), progress=self.progress.append)
        exc = err.value
        assert type(exc) is cls, f"expected {cls.__name__}, got {type(exc).__name__}: {exc.message}"
        assert self.trained == [], "a training step ran"
        runs = self.out / "runs"
        assert not runs.exists() or not any(runs.rglob("checkpoint-*")), "a checkpoint was written"
        assert not any((self.out / "exports").iterdir()), "something was exported"
        said = "\n".join([*logs, *self.progress, exc.message, exc.fix, *traceback.format_exception(exc)])
        assert CANARY not in said, "plaintext reached a log, a progress line or the error"
        assert files_containing(self.tmp, CANARY.encode()) == [], "plaintext reached the disk"
        return exc

    def write(self, plain: bytes = jsonl(ROWS), **kw: object) -> bytes:
        kw.setdefault("signer", OWNER)
        kw.setdefault("chunk_size", CS)
        res = encrypt_to(self.ds, plain, **kw)  # type: ignore[arg-type]
        assert res.chunks >= 6 or plain != jsonl(ROWS)  # the chunk-level cases need that many
        return self.ds.read_bytes()

    def body_start(self, data: bytes) -> int:
        return 12 + int.from_bytes(data[8:12], "big") + 64


@pytest.fixture
def case(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Case:
    return Case(tmp_path, monkeypatch)


def _flip(data: bytes, pos: int) -> bytes:
    out = bytearray(data)
    out[pos] ^= 0x01
    return bytes(out)


# ---- A. dataset / encryption


def test_case_01_wrong_key_from_another_getkey_path(case: Case) -> None:
    sim = GuestAgentSimulator()  # same deterministic test KMS as the run's embedded simulator
    other = DerivedKeySource(lambda p, purpose: bytes.fromhex(sim.get_key(p, purpose, "")["key"]), "cvm-tune/dataset/other")
    case.write(key=other.dataset_key())
    exc = case.fails(WrongKeyError, key={"source": "getkey"})  # the run derives cvm-tune/dataset/v1
    assert "nothing was decrypted" in exc.message


def test_case_02_truncated_at_a_chunk_boundary(case: Case) -> None:
    data = case.write()
    body = case.body_start(data)
    last = body + ((len(data) - TRAILER_LEN - body - 1) // C) * C  # start of the final chunk
    case.ds.write_bytes(data[:last] + data[-TRAILER_LEN:])  # final chunk dropped, signature kept
    assert "cut at a chunk boundary" in case.fails(TruncatedDatasetError).message


@pytest.mark.parametrize("cut", [1, 100, TRAILER_LEN + 5])
def test_case_03_truncated_mid_chunk(case: Case, cut: int) -> None:
    data = case.write()
    case.ds.write_bytes(data[:-cut])
    case.fails(TruncatedDatasetError)


def test_case_03_cut_inside_the_last_chunk_with_the_trailer_kept(case: Case) -> None:
    data = case.write()
    case.ds.write_bytes(data[: -TRAILER_LEN - 10] + data[-TRAILER_LEN:])
    case.fails(TruncatedDatasetError)


def test_case_04_reordered_chunks_fail_at_chunk_3(case: Case) -> None:
    data = case.write()
    b = case.body_start(data)
    c3, c4 = data[b + 3 * C : b + 4 * C], data[b + 4 * C : b + 5 * C]
    case.ds.write_bytes(data[: b + 3 * C] + c4 + c3 + data[b + 5 * C :])
    assert "chunk 3 " in case.fails(ChunkIntegrityError).message


def test_case_05_duplicated_chunk(case: Case) -> None:
    data = case.write()
    b = case.body_start(data)
    case.ds.write_bytes(data[: b + 3 * C] + data[b + 2 * C : b + 3 * C] + data[b + 3 * C :])
    case.fails(ChunkIntegrityError)


@pytest.mark.parametrize("where, cls", [
    ("chunk", ChunkIntegrityError),  # payload failure
    ("header_json", DatasetFormatError),  # header failure (no longer parses)
    ("header_value", HeaderIntegrityError),  # header edited, still well-formed: MAC failure
    ("header_mac", HeaderIntegrityError),  # MAC failure
    ("signature", DatasetSignatureError),  # owner signature failure
])
def test_case_06_bit_flips_each_have_their_error_class(case: Case, where: str, cls: type[CvmTuneError]) -> None:
    data = case.write()
    b = case.body_start(data)
    header = data[12 : b - 64]
    pos = {"chunk": b + C + 7, "header_json": 12, "header_value": 12 + header.index(b'"dataset_version":3') + 18,
           "header_mac": b - 1, "signature": len(data) - 1}[where]
    case.ds.write_bytes(_flip(data, pos))
    case.fails(cls)


@pytest.mark.parametrize("extra", [1, 1024])
def test_case_07_trailing_garbage(case: Case, extra: int) -> None:
    data = case.write()
    case.ds.write_bytes(data + os.urandom(extra))
    case.fails(TrailingDataError)


def test_case_07_garbage_between_final_chunk_and_trailer(case: Case) -> None:
    data = case.write()
    case.ds.write_bytes(data[:-TRAILER_LEN] + b"\0" * 40 + data[-TRAILER_LEN:])
    case.fails(TrailingDataError)


def test_case_08_older_version_than_the_last_trained_is_refused(case: Case) -> None:
    case.write(dataset_version=3)
    record_version(case.out / "state", "owner-set", 4, "0" * 64)  # what a run on v4 left behind
    assert "older than v4" in case.fails(DatasetRollbackError).message


def test_case_08_same_version_with_other_content_is_refused(case: Case) -> None:
    case.write(dataset_version=4)
    record_version(case.out / "state", "owner-set", 4, "0" * 64)
    case.fails(DatasetRollbackError)


def test_case_09_other_tenants_file_signed_by_another_owner(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """A valid file of another tenant: refused on its signer, before the key is even tried."""
    case.write(key=os.urandom(32), signer=owner_key(b"\x07" * 32))
    calls = []
    real = KeyFileSource.dataset_key
    monkeypatch.setattr(KeyFileSource, "dataset_key", lambda self: (calls.append(1), real(self))[1])
    assert "not by the pinned key" in case.fails(DatasetSignatureError).message
    assert calls == [1]  # one key, one attempt: no key-trying loop


def test_case_09_other_tenants_unsigned_file_is_a_wrong_key(case: Case) -> None:
    case.write(key=os.urandom(32), signer=None)
    case.fails(WrongKeyError, owner_public_key=None)


def test_case_10_signature_missing(case: Case) -> None:
    case.write(signer=None)  # format version 1: no owner signature at all
    case.fails(UnsignedDatasetError)


def test_case_10_signed_statement_tampered(case: Case) -> None:
    data = bytearray(case.write())
    data[-TRAILER_LEN + 40 + 7] ^= 0x01  # plaintext_size in the signed statement
    case.ds.write_bytes(bytes(data))
    assert "does not verify" in case.fails(DatasetSignatureError).message


def test_case_10_trailer_stripped(case: Case) -> None:
    case.ds.write_bytes(case.write()[:-TRAILER_LEN])
    case.fails(TruncatedDatasetError)


def test_case_10_content_replaced_under_the_same_header_and_signature(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whoever holds the key re-encrypts other rows with the same salt and keeps the owner's trailer."""
    from app.dataset import format as fmt

    monkeypatch.setattr(fmt, "_fresh_salt", lambda: b"\x33" * 32)
    genuine = case.write()
    forged = case.write(jsonl([chat_row(i + 100) for i in range(40)]), signer=owner_key(b"\x09" * 32))
    case.ds.write_bytes(forged[:-TRAILER_LEN] + genuine[-TRAILER_LEN:])
    assert "differs from what the owner signed" in case.fails(DatasetSignatureError).message


@pytest.mark.parametrize("plain", [b"", b"\n\n   \n"])
def test_case_11_empty_dataset(case: Case, plain: bytes) -> None:
    case.write(plain)
    case.fails(EmptyDatasetError)


def test_case_12_all_rows_filtered(case: Case) -> None:
    case.write(jsonl([chat_row(i, words=80) for i in range(10)]))
    exc = case.fails(AllRowsFilteredError, too_long="drop")
    assert "of 10 rows, 10 longer than max_length (128 tokens) were dropped" in exc.message


def test_case_13_larger_than_the_memory_limit_is_refused_clearly(case: Case) -> None:
    case.write(jsonl([chat_row(i, words=200) for i in range(200)]))  # ~240 KB
    assert "max_plaintext_bytes (65536)" in case.fails(DatasetTooLargeError, max_plaintext_bytes=65536).message


_STREAM_CHILD = textwrap.dedent("""
    import json, resource, sys
    limit = int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # before the imports: they count too
    from app.dataset import open_encrypted, parse_jsonl
    with open(sys.argv[1], "rb") as fh:
        stream = open_encrypted(fh, bytes.fromhex(sys.argv[2]), owner_public_key=bytes.fromhex(sys.argv[4]))
        try:
            parse_jsonl(stream, source="big", max_row_bytes=1 << 20, max_plaintext_bytes=1 << 20)
        except Exception as exc:
            err = type(exc).__name__
    # VmHWM: this process image's peak RSS (ru_maxrss would include the parent's, inherited at fork)
    hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    print(json.dumps({"error": err, "plaintext_size": stream.plaintext_size, "sha": stream.plaintext_sha256,
                      "maxrss_mib": hwm / 1024}))
""")


class _Rows:
    """A raw stream of ``total`` bytes of valid JSONL rows, generated on the fly (never whole in memory)."""

    def __init__(self, total: int) -> None:
        import hashlib

        self.left, self.sha, self._i = total, hashlib.sha256(), 0
        self._buf = b""

    def read(self, n: int = -1) -> bytes:
        while len(self._buf) < n and len(self._buf) < self.left:
            self._buf += jsonl([chat_row(self._i, words=30)])
            self._i += 1
        out, self._buf = self._buf[: min(n, self.left)], self._buf[min(n, self.left) :]
        self.left -= len(out)
        self.sha.update(out)
        return out


@pytest.mark.parametrize("size_mib, limit_mib", [
    (160, 128),
    pytest.param(1536, 160, marks=pytest.mark.slow),
])
def test_case_13_streaming_decrypt_of_a_file_larger_than_the_process_memory(tmp_path: Path, size_mib: int,
                                                                            limit_mib: int) -> None:
    """Decrypt + authenticate under RLIMIT_AS below the file size: bounded memory, then a clear
    DatasetTooLargeError from the row limit (training cannot hold such a dataset in memory)."""
    from app.dataset import encrypt_stream

    path = tmp_path / "big.cvmds"
    src = _Rows(size_mib << 20)
    with open(path, "wb") as out:
        encrypt_stream(src, out, KEY, dataset_id="big", owner_key=OWNER)  # type: ignore[arg-type]
    assert path.stat().st_size > limit_mib << 20
    proc = subprocess.run([sys.executable, "-c", _STREAM_CHILD, str(path), KEY.hex(), str(limit_mib << 20),
                           public_key_bytes(OWNER).hex()], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    assert got["error"] == "DatasetTooLargeError"
    assert (got["plaintext_size"], got["sha"]) == (size_mib << 20, src.sha.hexdigest())  # authenticated to the end
    assert got["maxrss_mib"] < 0.75 * limit_mib, got  # a few chunks over the interpreter (~53 MiB at 160 MiB)
    assert CANARY not in proc.stdout + proc.stderr and files_containing(tmp_path, CANARY.encode()) == []


_NO_WRITE_CHILD = textwrap.dedent("""
    import json, resource, signal, sys, tempfile
    tempfile.tempdir = "/tmp"  # gettempdir() would probe by writing a file
    from app.config import Config
    from app.errors import CvmTuneError
    from app.run.pipeline import run_once
    cfg = Config.model_validate(json.loads(sys.argv[1]))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # from here on no file may grow by one byte
    lines = []
    try:
        run_once(cfg, progress=lines.append)
    except CvmTuneError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": exc.message, "progress": lines}))
""")


def test_case_14_disk_full_decrypt_and_validate_write_nothing(case: Case) -> None:
    """No scratch: with every file write failing (RLIMIT_FSIZE 0), key, decrypt, validation and the
    token pass all complete; the first write (the dataset-version record) fails cleanly."""
    case.write()
    cfg = case.config().model_dump(mode="json")
    proc = subprocess.run([sys.executable, "-c", _NO_WRITE_CHILD, json.dumps(cfg)], capture_output=True, text=True,
                          cwd=case.tmp, timeout=600, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    assert got["error"] == StateError.__name__ and "cannot record the dataset version" in got["message"]
    assert any(line.startswith("tokens: 200 rows") for line in got["progress"])  # validation finished first
    assert not [p for p in case.out.rglob("*") if p.is_file()]  # no file at all, not even a temp
    assert CANARY not in proc.stdout + proc.stderr
    assert files_containing(case.tmp, CANARY.encode()) == []


def test_case_14_disk_full_while_the_owner_encrypts(tmp_path: Path) -> None:
    plain = tmp_path / "rows.jsonl"  # the owner's own plaintext, on the owner's machine
    plain.write_bytes(jsonl([{"text": f"row {i} " + "x" * 100} for i in range(2000)]))
    child = textwrap.dedent("""
        import resource, signal, sys
        from pathlib import Path
        from app.dataset import encrypt_file
        from app.errors import DataError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        try:
            encrypt_file(Path(sys.argv[1]), Path(sys.argv[2]), bytes(32), dataset_id="x")
        except DataError as exc:
            print(type(exc).__name__, exc.message)
    """)
    proc = subprocess.run([sys.executable, "-c", child, str(plain), str(tmp_path / "rows.cvmds")], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    assert proc.stdout.startswith("DataError encrypting rows.jsonl"), proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]  # no temp, no half file


# ---- B. row validation


def test_case_15_malformed_json_line_names_file_line_and_offset(case: Case) -> None:
    rows = [json.dumps(r).encode() for r in ROWS[:5]] + [json.dumps(chat_row(99)).encode()[:-10]] + [json.dumps(ROWS[6]).encode()]
    case.write(b"\n".join(rows) + b"\n")
    exc = case.fails(RowError)
    line_start = sum(len(r) + 1 for r in rows[:5])
    assert exc.message.startswith("data.cvmds line 6: invalid JSON (")
    column = int(exc.message.split(" at column ")[1].split(",")[0])
    assert f"byte offset {line_start + column - 1}," in exc.message or exc.message.endswith(f"byte offset {line_start + column - 1})")


@pytest.mark.parametrize("bad, words", [
    (b"\xff\xfe" + '{"text": "x"}'.encode("utf-16-le"), "invalid UTF-8 at byte offset"),  # UTF-16 with BOM
    (json.dumps({"text": f"{CANARY} \ud800 lone"}).encode(), "lone surrogate"),
    (f'{{"text": "{CANARY} '.encode() + b"\xc3\x28" + b'"}', "invalid UTF-8 at byte offset"),
])
def test_case_16_non_utf8(case: Case, bad: bytes, words: str) -> None:
    case.write(jsonl([*ROWS[:3], bad, *ROWS[3:6]]))
    exc = case.fails(RowError)
    assert exc.message.startswith("data.cvmds line 4:") and words in exc.message


@pytest.mark.parametrize("row, words", [
    ({"prompt": CANARY}, "unexpected key"),
    ({"messages": CANARY}, "messages: expected an array, got string"),
    ({"text": 7}, "text: expected a string, got number"),
    ({"messages": [{"role": "user", "content": CANARY, "name": "x"}]}, "messages[0]: 1 unexpected key"),
])
def test_case_17_wrong_schema_names_the_field_path(case: Case, row: dict, words: str) -> None:
    case.write(jsonl([*ROWS[:2], row]))
    exc = case.fails(RowError)
    assert exc.message.startswith("data.cvmds line 3:") and words in exc.message


@pytest.mark.parametrize("messages, words", [
    ([{"role": "user", "content": CANARY}, {"role": "user", "content": CANARY}], "messages[1].role: expected 'assistant'"),
    ([{"role": "hacker", "content": CANARY}], "messages[0].role: must be one of"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": CANARY}], "system message is allowed only first"),
])
def test_case_18_wrong_roles_or_order(case: Case, messages: list, words: str) -> None:
    case.write(jsonl([ROWS[0], {"messages": messages}]))
    assert words in case.fails(RowError).message


def test_case_19_too_long_truncate_and_drop_are_counted(case: Case) -> None:
    """Both policies count; the end-to-end run (test_key_release.py) shows the counts in the manifest."""
    from app.training.tokens import apply_token_policy

    rows = [chat_row(i, words=80 if i % 4 == 0 else 2) for i in range(12)]
    kw = {"base_model_dir": tiny_model_dir(), "max_length": 128, "assistant_only_loss": False}
    with all_logs() as logs:
        kept, rep = apply_token_policy(rows, too_long="truncate", **kw)
        assert (rep.rows_in, rep.too_long, rep.truncated, rep.dropped_too_long, rep.rows_out) == (12, 3, 3, 0, 12)
        assert kept == rows and rep.tokens <= 12 * 128 and rep.too_long_lines == (1, 5, 9)
        kept, rep = apply_token_policy(rows, too_long="drop", lines=[10 * i for i in range(12)], **kw)
        assert (rep.too_long, rep.truncated, rep.dropped_too_long, rep.rows_out) == (3, 0, 3, 9)
        assert kept == [r for i, r in enumerate(rows) if i % 4] and rep.too_long_lines == (0, 40, 80)
    assert CANARY not in "\n".join(logs)


def test_case_20_pathological_rows_rejected_before_parsing(case: Case) -> None:
    huge = b'{"text": "' + CANARY.encode() * (10_000_000 // len(CANARY)) + b'"}'  # 10 MB string
    case.write(jsonl([ROWS[0], huge]), chunk_size=1 << 20)
    assert "line 2: row is longer than max_row_bytes" in case.fails(RowError).message
    deep = b'{"text": "x", "a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    case.write(jsonl([ROWS[0], deep]), chunk_size=1 << 20)
    assert "nested deeper than 32 levels" in case.fails(RowError, max_row_bytes=1 << 20).message


def test_case_21_duplicates_are_dropped_deterministically_and_counted() -> None:
    a, b = chat_row(1), chat_row(2)
    respaced = json.dumps(a, indent=1).replace("\n", "").encode()  # same JSON value, other bytes
    shouty = json.loads(json.dumps(b).replace("answer", "ANSWER  "))  # equal only after normalisation
    data = jsonl([a, b, respaced, a, shouty])
    with all_logs() as logs:
        for policy, kept, dropped, lines in (("exact", [a, b, shouty], 2, (3, 4)), ("normalized", [a, b], 3, (3, 4, 5)),
                                             ("off", None, 0, ())):
            rows, rep = parse_jsonl([data], source="d", max_row_bytes=1 << 20, dedup=policy)  # type: ignore[arg-type]
            assert (rep.rows_total, rep.duplicates_dropped, rep.rows_kept, rep.duplicate_lines) == (5, dropped, 5 - dropped, lines)
            if kept is not None:
                assert rows == kept  # first occurrences, in file order: the same on every run
            assert parse_jsonl([data[:7], data[7:]], source="d", max_row_bytes=1 << 20, dedup=policy)[0] == rows  # type: ignore[arg-type]
    assert CANARY not in "\n".join(logs)


def test_case_22_injected_or_secret_looking_content_never_printed(case: Case) -> None:
    case.write(jsonl([*ROWS[:3], {"messages": [{"role": "user", "content": INJECTION}, {"role": "tool", "content": INJECTION}]}]))
    exc = case.fails(RowError)  # the whole row is secret; the error names position and field only
    assert "hunter2" not in exc.message and "IGNORE" not in exc.message


def test_case_23_labels_all_masked_is_refused_before_training(case: Case) -> None:
    case.write(jsonl([chat_row(i, words=60) for i in range(8)]))
    cfg = case.config()
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"assistant_only_loss": True, "max_length": 64})})
    exc = case.fails(ZeroTrainableTokensError, cfg=cfg)  # every prompt fills max_length: no assistant token left
    assert "8 had zero trainable tokens" in exc.message


def test_every_case_1_to_23_has_a_test() -> None:
    names = " ".join(n for n in globals() if n.startswith("test_case_"))
    assert [n for n in range(1, 24) if f"test_case_{n:02d}_" not in names] == []
