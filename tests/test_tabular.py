"""Parquet and Arrow IPC datasets: encrypted as they are, read from memory in the CVM, validated like JSONL rows.

Run: ``python -m pytest tests/test_tabular.py -q`` (CPU, offline).
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from app.cli import main
from app.dataset import open_encrypted, parse_jsonl
from app.dataset.row_sets import rows_sha256
from app.dataset.tabular import ARROW, PARQUET, check_file, parse_table, read_table, rows_of_table
from app.errors import EmptyDatasetError, RowError, TableError
from attestation.io.hashing import canonical_json
from tests.owner_fixtures import CANARY, KEY, encrypt_to, files_containing, jsonl, owner_key

REPO = Path(__file__).resolve().parent.parent
SAMPLE = [json.loads(line) for line in (REPO / "app" / "data" / "sample.jsonl").read_text().splitlines() if line.strip()]
ROWS = SAMPLE[:20]  # chat and text rows mixed (nulls in the table)
MESSAGE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
SFT_SCHEMA = pa.schema([("messages", MESSAGE), ("text", pa.string()), ("split", pa.string())])
OWNER = owner_key()


def table(rows: list[dict[str, Any]], schema: pa.Schema = SFT_SCHEMA) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=schema)


def parquet_bytes(t: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(t, buf)
    return buf.getvalue()


def arrow_bytes(t: pa.Table, *, stream: bool = False) -> bytes:
    buf = io.BytesIO()
    with (pa.ipc.new_stream if stream else pa.ipc.new_file)(buf, t.schema) as w:
        w.write_table(t)
    return buf.getvalue()


def _encrypt_plain(dst: Path, data: bytes, content_type: str) -> None:
    from app.dataset import encrypt_stream

    with open(dst, "wb") as out:
        encrypt_stream(io.BytesIO(data), out, KEY, dataset_id="tickets", dataset_version=1, chunk_size=4096,
                       owner_key=OWNER, content_type=content_type)


# --- reading and validation ---------------------------------------------------------------------------------------


def test_parquet_arrow_and_jsonl_rows_are_the_same_rows_with_the_same_hash() -> None:
    from_jsonl, rep_j = parse_jsonl([jsonl(ROWS)], source="d.jsonl", max_row_bytes=100_000)
    t = table(ROWS)
    from_parquet, rep_p = parse_table([parquet_bytes(t)[:999], parquet_bytes(t)[999:]], PARQUET, source="d.parquet")
    from_file, _ = parse_table([arrow_bytes(t)], ARROW, source="d.arrow")
    from_stream, _ = parse_table([arrow_bytes(t, stream=True)], ARROW, source="d.arrows")
    buf = io.BytesIO()
    feather.write_feather(t, buf)
    from_feather, _ = parse_table([buf.getvalue()], ARROW, source="d.feather")
    assert from_jsonl == from_parquet == from_file == from_stream == from_feather
    assert rep_j.by_kind == rep_p.by_kind and rep_p.lines == tuple(range(1, 21))
    assert len({rows_sha256(r) for r in (from_jsonl, from_parquet, from_feather)}) == 1
    canonical = b"".join(canonical_json(r) + b"\n" for r in ROWS)  # a canonical JSONL file: the plaintext hash
    assert rows_sha256(from_jsonl) == hashlib.sha256(canonical).hexdigest()


def test_preference_tables_read_plain_and_conversational() -> None:
    plain = pa.table({"prompt": ["q1", "q2"], "chosen": ["a", "b"], "rejected": ["c", "d"], "split": [None, "eval"]})
    rows, rep = rows_of_table(plain, source="p.parquet")
    assert rows[1] == {"prompt": "q2", "chosen": "b", "rejected": "d", "split": "eval"} and "split" not in rows[0]
    chat = pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "q"}],
                                  "chosen": [{"role": "assistant", "content": "a"}],
                                  "rejected": [{"role": "assistant", "content": "b"}]}],
                                schema=pa.schema([(c, MESSAGE) for c in ("prompt", "chosen", "rejected")]))
    assert rows_of_table(chat, source="p.parquet")[1].by_kind["preference"] == 1 and rep.by_kind["preference"] == 2


@pytest.mark.parametrize(("build", "error", "message"), [
    (lambda: parquet_bytes(table(ROWS))[:-40], TableError, "d.parquet is not a readable parquet file"),
    (lambda: b"PAR1 not really", TableError, "not a readable parquet file"),
    (lambda: parquet_bytes(pa.table({"text": [1, 2]})), TableError, "column 'text' has type int64, expected string"),
    (lambda: parquet_bytes(pa.table({"text": ["a"], "meta": [{"source": "crm", "id": 7}]})), TableError,
     "column(s) 'meta' not used by text/chat rows"),
    (lambda: parquet_bytes(pa.table({"messages": [["a", "b"]]})), TableError, "column 'messages' has type list<element: string>"),
    (lambda: parquet_bytes(pa.table({"prompt": ["q"], "chosen": ["a"]})), TableError, "missing: rejected"),
    (lambda: parquet_bytes(pa.table({"prompt": ["q"], "chosen": ["a"], "rejected": ["b"], "text": ["t"]})), TableError,
     "column(s) 'text' not used by preference rows"),
    (lambda: parquet_bytes(pa.table({"id": [1]})), TableError, "column(s) 'id' not used"),
    (lambda: parquet_bytes(table([{"text": "ok"}, {"text": "  "}])), RowError, "d.parquet row 2: text: must not be empty"),
    (lambda: parquet_bytes(table([{"text": "ok"}, {"split": "eval"}])), RowError, "d.parquet row 2: missing 'messages'"),
    (lambda: parquet_bytes(table([])), EmptyDatasetError, "d.parquet has no rows"),
])
def test_bad_parquet_is_refused_with_its_error_class(build: Any, error: type, message: str) -> None:
    with pytest.raises(error) as exc:
        parse_table([build()], PARQUET, source="d.parquet")
    assert type(exc.value) is error and message in exc.value.message and exc.value.exit_code == 3


def test_encrypt_validates_a_table_first_and_writes_nothing_when_it_is_bad(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "new", "-o", str(tmp_path / "owner")]) == 0
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(parquet_bytes(pa.table({"text": ["fine"], "meta": [{"k": "v"}]})))
    with pytest.raises(TableError, match="column\\(s\\) 'meta'"):
        check_file(bad)
    args = ["dataset", "encrypt", "--owner-key", str(tmp_path / "owner.key"), "--key-file", str(tmp_path / "d.key"),
            "--dataset-id", "tickets", "--dataset-version", "1", "-o", str(tmp_path / "out.cvmds")]
    assert main([*args[:2], str(bad), *args[2:]]) == 3
    assert not (tmp_path / "out.cvmds").exists() and not (tmp_path / "d.key").exists()
    truncated = tmp_path / "cut.parquet"
    truncated.write_bytes(parquet_bytes(table(ROWS))[:200])
    assert main([*args[:2], str(truncated), *args[2:]]) == 3
    assert "error: cut.parquet is not a readable parquet file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.parquet", "cut.parquet", "owner.key", "owner.pub"]
    good = tmp_path / "good.feather"
    feather.write_feather(table(ROWS), str(good))
    assert main([*args[:2], str(good), *args[2:]]) == 0
    assert "format: arrow; 20 rows validated (messages 15, text 5)" in capsys.readouterr().out
    assert main(["dataset", "inspect", str(tmp_path / "out.cvmds"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["plaintext_format"], info["content_type"]) == ("arrow", ARROW)


def test_a_bad_table_inside_the_cvm_is_a_data_error_before_training(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Encrypted without the owner-side check (another tool): the run refuses it (exit 3), nothing trained."""
    data = tmp_path / "cut.cvmds"
    _encrypt_plain(data, parquet_bytes(table(ROWS))[:-30], PARQUET)
    with open(data, "rb") as fh:
        stream = open_encrypted(fh, KEY, content_type=(PARQUET,))
        with pytest.raises(TableError, match="cut.cvmds is not a readable parquet file"):
            parse_table(stream, stream.header.content_type, source="cut.cvmds")
    assert stream.complete  # the whole stream was authenticated before the table was read
    assert main(["run", "--config", str(_cfg(tmp_path, data))]) == 3
    assert "error: cut.cvmds is not a readable parquet file" in capsys.readouterr().err
    runs = tmp_path / "out" / "runs"
    assert not runs.exists() or not any(runs.iterdir())


def test_read_table_never_takes_a_path() -> None:
    with pytest.raises(TypeError):
        read_table("/etc/passwd", PARQUET, source="x")  # type: ignore[arg-type]


# --- the same adapter ------------------------------------------------------------------------------------------------


def _cfg(root: Path, data: Path) -> Path:
    key = root / "dataset.key"
    key.write_bytes(KEY)
    key.chmod(0o600)
    cfg = root / "cfg.json"
    cfg.write_text(json.dumps({
        "output": {"dir": str(root / "out")},
        "dataset": {"source": "encrypted-file", "path": str(data), "owner_public_key":
                    OWNER.public_key().public_bytes_raw().hex(), "key": {"source": "file", "file": str(key)}},
        "training": {"max_steps": 3, "save_steps": 3, "per_device_batch_size": 2, "gradient_accumulation_steps": 1,
                     "max_length": 64}}))
    return cfg


def test_parquet_and_jsonl_of_the_same_rows_train_the_same_adapter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   request: pytest.FixtureRequest) -> None:
    """Same rows hash, same adapter bytes; and no plaintext reaches the disk (the canary row is nowhere in clear:
    not on the volume, not in the system temporary directory the runs were given, not in their RAM directories)."""
    import tempfile

    from app.config import Config
    from app.run.inputs import scratch_dir

    import shutil

    private_tmp = Path(tempfile.mkdtemp(prefix="tab-"))  # short: the simulator's socket goes under it
    request.addfinalizer(lambda: shutil.rmtree(private_tmp, ignore_errors=True))
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    rows = [*ROWS, {"text": f"{CANARY} kept in memory only"}]
    manifests, weights = [], []
    for name, write in (("jsonl", lambda p: encrypt_to(p, jsonl(rows), signer=OWNER, dataset_id="tickets")),
                        ("parquet", lambda p: _encrypt_plain(p, parquet_bytes(table(rows)), PARQUET))):
        root = tmp_path / name
        root.mkdir()
        write(root / "d.cvmds")
        assert main(["run", "--config", str(_cfg(root, root / "d.cvmds"))]) == 0
        bundle = next(p for p in (root / "out" / "exports").iterdir() if p.is_dir())
        manifests.append(json.loads((bundle / "manifest.json").read_bytes()))
        weights.append((bundle / "adapter" / "adapter_model.safetensors").read_bytes())
    (j, p) = (m["dataset"] for m in manifests)
    assert (j["plaintext_format"], p["plaintext_format"]) == ("jsonl", "parquet")
    assert j["plaintext_sha256"] != p["plaintext_sha256"] and j["rows_sha256"] == p["rows_sha256"]
    assert j["rows"] == p["rows"] == 21 and weights[0] == weights[1]
    assert files_containing(tmp_path, CANARY.encode()) == []  # the volumes
    assert files_containing(private_tmp, CANARY.encode()) == []  # the temporary directory the runs were given
    for name in ("jsonl", "parquet"):
        ram = scratch_dir(Config(), (tmp_path / name / "out").resolve())
        for d in (x for x in ram.parent.iterdir() if x.name.startswith(ram.name)):
            assert files_containing(d, CANARY.encode()) == [], d
