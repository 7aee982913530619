"""Datasets: a dictionary-encoded (categorical) string column of a Parquet or Arrow table is read as the strings it
encodes, in the owner's check and in the CVM; `cvm-tune dataset encrypt` checks every JSONL row (text, chat and
preference rows) before it writes anything, as it does for a table: a bad row is a RowError naming the file, the line
and the field (exit 3), and neither the ciphertext nor a new key file is written."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from app.cli import main
from app.dataset.tabular import ARROW, PARQUET, check_file, parse_table
from app.errors import DataError, EmptyDatasetError, RowError

CHAT = {"messages": [{"role": "user", "content": "how do I reset it?"},
                     {"role": "assistant", "content": "hold the button for ten seconds"}]}
PAIR = {"prompt": "reset?", "chosen": "hold the button", "rejected": "throw it away"}


def _table_bytes(t: pa.Table, fmt: str) -> bytes:
    buf = io.BytesIO()
    (pq.write_table if fmt == "parquet" else feather.write_feather)(t, buf)
    return buf.getvalue()


def _categorical() -> list[pa.Table]:
    split = pa.array(["train", "eval", "train"]).dictionary_encode()
    role = pa.array(["user", "assistant"] * 3).dictionary_encode()
    messages = pa.ListArray.from_arrays([0, 2, 4, 6], pa.StructArray.from_arrays(
        [role, pa.array(["q1", "a1", "q2", "a2", "q3", "a3"])], names=["role", "content"]))
    return [pa.table({"text": pa.array(["one", "two", "one"]).dictionary_encode(), "split": split}),
            pa.table({"messages": messages, "split": split}),
            pa.table({name: pa.array([v, v, v]).dictionary_encode() for name, v in PAIR.items()})]


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
@pytest.mark.parametrize("which", [0, 1, 2], ids=["text", "messages", "preference"])
def test_a_dictionary_encoded_string_column_is_accepted(tmp_path: Path, fmt: str, which: int) -> None:
    t = _categorical()[which]
    assert any(pa.types.is_dictionary(f.type) or "dictionary" in str(f.type) for f in t.schema)
    data = _table_bytes(t, fmt)
    path = tmp_path / f"cat.{fmt}"
    path.write_bytes(data)
    content_type, line = check_file(path)  # the owner's check before encrypting
    assert content_type == (PARQUET if fmt == "parquet" else ARROW) and "3 rows validated" in line
    rows, rep = parse_table([data], content_type, source=path.name)  # the CVM's reading
    assert rep.rows_kept == 3 and all(isinstance(v, str) for r in rows for k, v in r.items() if k != "messages")
    assert rows == [{k: v for k, v in r.items() if v is not None} for r in t.to_pylist()]


BAD = [([{"text": "fine"}, {"text": 5}], "line 2", "text"),
       ([CHAT, {"messages": [{"role": "robot", "content": "x"}]}], "line 2", "role"),
       ([PAIR, {**PAIR, "chosen": ["not", "a", "turn"]}], "line 2", "chosen"),
       ([PAIR, {"prompt": "only a prompt"}], "line 2", ""),
       ([{"text": "fine"}, b"{not json"], "line 2", "invalid JSON")]


def _jsonl(rows: list[Any]) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


@pytest.mark.parametrize(("rows", "where", "field"), BAD, ids=["text-type", "chat-role", "pref-chosen",
                                                               "pref-missing", "json"])
def test_a_bad_jsonl_row_is_a_row_error_naming_its_line(tmp_path: Path, rows: list[Any], where: str,
                                                        field: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(_jsonl(rows))
    with pytest.raises(RowError) as exc:
        check_file(path)
    assert exc.value.message.startswith(f"bad.jsonl {where}: ") and field in exc.value.message, exc.value.message
    assert "fine" not in exc.value.message and "robot" not in exc.value.message  # never content


def test_good_jsonl_is_counted_and_empty_jsonl_refused(tmp_path: Path) -> None:
    path = tmp_path / "good.jsonl"
    path.write_bytes(_jsonl([{"text": "one"}, CHAT, {"text": "two", "split": "eval"}]))
    assert check_file(path)[1] == "format: jsonl; 3 rows validated (messages 1, text 2)"
    (tmp_path / "empty.jsonl").write_bytes(b"\n\n")
    with pytest.raises(EmptyDatasetError):
        check_file(tmp_path / "empty.jsonl")


@pytest.mark.timeout(20)
def test_a_fifo_input_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "rows.jsonl")
    with pytest.raises(DataError, match="is a FIFO"):
        check_file(tmp_path / "rows.jsonl")


def _encrypt_args(tmp_path: Path, src: Path) -> list[str]:
    assert main(["keys", "new", "-o", str(tmp_path / "owner")]) == 0
    return ["dataset", "encrypt", str(src), "--owner-key", str(tmp_path / "owner.key"), "--key-file",
            str(tmp_path / "d.key"), "--dataset-id", "tickets", "--dataset-version", "1", "-o", str(tmp_path / "o.cvmds")]


def test_encrypt_accepts_a_categorical_parquet_column(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "cat.parquet"
    src.write_bytes(_table_bytes(_categorical()[0], "parquet"))
    assert main(_encrypt_args(tmp_path, src)) == 0
    assert (tmp_path / "o.cvmds").is_file() and "3 rows validated" in capsys.readouterr().out


@pytest.mark.parametrize(("rows", "where", "field"), BAD[:3], ids=["text-type", "chat-role", "pref-chosen"])
def test_encrypt_refuses_a_bad_jsonl_row_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            rows: list[Any], where: str, field: str) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_bytes(_jsonl(rows))
    args = _encrypt_args(tmp_path, src)
    capsys.readouterr()
    assert main(args) == RowError.exit_code == 3
    err = capsys.readouterr().err
    assert err.startswith(f"error: bad.jsonl {where}: ") and field in err and "Traceback" not in err, err
    assert not (tmp_path / "o.cvmds").exists() and not (tmp_path / "d.key").exists()
