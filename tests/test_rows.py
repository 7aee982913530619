"""JSONL row validation (app.dataset.rows): threats-and-faults.md §7 cases 15-17, 20, 22.

Every bad row raises exactly RowError (or EmptyDatasetError) and no message, traceback or log
line ever carries row content (the CANARY tests).
"""

from __future__ import annotations

import io
import json
import logging
import traceback
import tracemalloc
from collections.abc import Iterator
from importlib import resources

import pytest

from app.dataset import encrypt_stream, open_encrypted, parse_jsonl
from app.dataset import rows as rows_mod
from app.errors import ConfigError, EmptyDatasetError, RowError, TruncatedDatasetError

KEY = bytes(range(32))
U = {"role": "user", "content": "hi"}
A = {"role": "assistant", "content": "hello"}
S = {"role": "system", "content": "be brief"}


def jl(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def parse(data: bytes, max_row_bytes: int = 1 << 20, chunk: int | None = None):
    pieces = [data] if chunk is None else [data[i : i + chunk] for i in range(0, len(data), chunk)]
    return parse_jsonl(pieces, source="ds.cvmds", max_row_bytes=max_row_bytes)


def row_error(data: bytes, **kw) -> RowError:
    with pytest.raises(RowError) as err:
        parse(data, **kw)
    assert type(err.value) is RowError
    return err.value


GOOD = jl({"messages": [U, A]}, {"messages": [S, U, A, U, A]}, {"text": "plain text row"}, {"messages": [U, A, U]})


def test_good_rows_of_both_kinds() -> None:
    rows, report = parse(GOOD)
    assert rows[2] == {"text": "plain text row"} and rows[0]["messages"][1] == A
    assert (report.rows_total, report.rows_kept, report.by_kind) == (4, 4, {"messages": 3, "text": 1})


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
def test_rows_spanning_chunk_boundaries(chunk: int) -> None:
    assert parse(GOOD, chunk=chunk) == parse(GOOD)


def test_rows_across_encrypted_chunks() -> None:
    long_rows = [{"text": f"row {i} " + "x" * 3000} for i in range(10)]
    data = jl(*long_rows)
    out = io.BytesIO()
    encrypt_stream(io.BytesIO(data), out, KEY, dataset_id="t", chunk_size=4096)
    stream = open_encrypted(io.BytesIO(out.getvalue()), KEY)
    rows, report = parse_jsonl(stream, source="t", max_row_bytes=4000)
    assert rows == long_rows and report.rows_kept == 10 and stream.chunks == 8


def test_bundled_sample_is_valid() -> None:
    data = (resources.files("app") / "data" / "sample.jsonl").read_bytes()
    _, report = parse(data)
    assert report.rows_kept == sum(report.by_kind.values()) > 0


def test_crlf_blank_lines_and_missing_final_newline() -> None:
    data = b'{"text":"a"}\r\n\r\n   \n\t\r\n{"text":"b"}\r\n{"text":"c"}'
    rows, report = parse(data)
    assert rows == [{"text": "a"}, {"text": "b"}, {"text": "c"}]
    assert report.rows_total == 3


@pytest.mark.parametrize("data", [b"", b"\n\n", b"  \r\n\t\n"])
def test_no_rows_is_empty_dataset(data: bytes) -> None:
    with pytest.raises(EmptyDatasetError):
        parse(data)


def test_malformed_json_reports_its_line() -> None:
    err = row_error(jl({"text": "a"}) + b"\n" + jl({"text": "b"}) + b'{"text": "truncated\n' + jl({"text": "c"}))
    assert str(err).startswith("ds.cvmds line 4: invalid JSON (")


@pytest.mark.parametrize("chunk", [None, 5])
def test_non_utf8_reports_line_and_byte_offset(chunk) -> None:
    data = b'{"text":"ok"}\n{"text":"a\xffb"}\n'
    err = row_error(data, chunk=chunk)
    assert "line 2: invalid UTF-8 at byte offset 24" in str(err)
    assert data[24] == 0xFF


@pytest.mark.parametrize(
    "data, words",
    [
        (b'\xff\xfe{\x00"\x00}\x00\n', "invalid UTF-8 at byte offset 0"),  # UTF-16 BOM
        (b'{"text":"\xed\xa0\x80"}\n', "invalid UTF-8"),  # a surrogate encoded as UTF-8
        (b'{"text":"a\\ud800b"}\n', "text: contains a lone surrogate"),  # ... or as a JSON escape
        (b'\xef\xbb\xbf{"text":"a"}\n', "invalid JSON"),  # UTF-8 BOM
        (b'{"text":"a","text":"b"}\n', "duplicate key"),
        (b'{"text":NaN}\n', "NaN"),
        (b'{"text":' + b"1" * 5000 + b"}\n", "invalid JSON (ValueError)"),
    ],
)
def test_encoding_and_json_edge_cases(data: bytes, words: str) -> None:
    assert words in str(row_error(data))


@pytest.mark.parametrize(
    "row, where",
    [
        ({}, "line 1: missing 'messages' or 'text'"),
        ([], "line 1: expected a JSON object, got array"),
        ({"text": "a", "id": 1}, "line 1: 1 unexpected key(s)"),
        ({"text": "a", "messages": [U, A]}, "both 'messages' and 'text'"),
        ({"text": ""}, "text: must not be empty"),
        ({"text": "  "}, "text: must not be empty"),
        ({"text": 5}, "text: expected a string, got number"),
        ({"messages": {}}, "messages: expected an array, got object"),
        ({"messages": []}, "messages: must not be empty"),
        ({"messages": [U, "x"]}, "messages[1]: expected an object, got string"),
        ({"messages": [U, {"role": "assistant"}]}, "messages[1].content: missing"),
        ({"messages": [{"content": "x"}, A]}, "messages[0].role: missing"),
        ({"messages": [U, {**A, "name": "bot"}]}, "messages[1]: 1 unexpected key(s)"),
        ({"messages": [U, {"role": "tool", "content": "x"}]}, "messages[1].role: must be one of system, user, assistant"),
        ({"messages": [U, {"role": 3, "content": "x"}]}, "messages[1].role: must be one of system, user, assistant, got number"),
        ({"messages": [U, {"role": "assistant", "content": None}]}, "messages[1].content: expected a string, got null"),
        ({"messages": [U, {"role": "assistant", "content": ""}]}, "messages[1].content: must not be empty"),
        ({"messages": [U, U, A]}, "messages[1].role: expected 'assistant'"),
        ({"messages": [A, U]}, "messages[0].role: expected 'user'"),
        ({"messages": [S, A]}, "messages[1].role: expected 'user'"),
        ({"messages": [U, A, S]}, "messages[2].role: a system message is allowed only first"),
        ({"messages": [S, S, U, A]}, "messages[1].role: a system message is allowed only first"),
        ({"messages": [U, A, A]}, "messages[2].role: expected 'user'"),
        ({"messages": [U]}, "messages: no assistant message"),
        ({"messages": [S, U]}, "messages: no assistant message"),
    ],
)
def test_schema_errors_name_line_and_field(row, where: str) -> None:
    err = row_error(jl(row))
    assert where in str(err)
    assert str(err).startswith("ds.cvmds line 1: ")


def test_schema_error_on_later_line() -> None:
    err = row_error(GOOD + jl({"messages": [U, A, U, U]}))
    assert str(err).startswith("ds.cvmds line 5: messages[3].role:")


def test_oversized_row_is_rejected_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_parsing(*_a, **_k):
        raise AssertionError("json.loads must not run on an oversized row")

    monkeypatch.setattr(rows_mod.json, "loads", no_parsing)
    err = row_error(b'{"text":"' + b"x" * 200 + b'"}\n', max_row_bytes=64)
    assert "line 1: row is longer than max_row_bytes (64)" in str(err)
    err = row_error(b'{"text":"' + b"x" * 200 + b'"}\n', max_row_bytes=64, chunk=10)
    assert "line 1: row is longer than max_row_bytes (64)" in str(err)


def test_row_at_the_limit_is_fine_with_crlf() -> None:
    row = b'{"text":"' + b"x" * 50 + b'"}'
    rows, _ = parse(row + b"\r\n" + row, max_row_bytes=len(row), chunk=7)
    assert len(rows) == 2
    row_error(row + b"\n", max_row_bytes=len(row) - 1)


def test_huge_row_keeps_buffering_bounded() -> None:
    """Case 20: a 64 MiB row without a newline, made on the fly, is rejected with bounded memory."""

    def chunks() -> Iterator[bytes]:
        yield b'{"text":"'
        for _ in range(64):
            yield b"x" * (1 << 20)
        yield b'"}\n'

    tracemalloc.start()
    try:
        with pytest.raises(RowError):
            parse_jsonl(chunks(), source="big", max_row_bytes=1 << 16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak


def test_deep_nesting_is_rejected_without_recursion() -> None:
    for depth in (33, 100_000):
        err = row_error(b'{"text":' + b"[" * depth + b"]" * depth + b"}\n", max_row_bytes=1 << 20)
        assert "nested deeper than 32 levels" in str(err)
    err = row_error(b'{"text":' + b"[" * 31 + b"]" * 31 + b"}\n")  # 32 levels: parsed, then a schema error
    assert "text: expected a string, got array" in str(err)


def test_brackets_inside_strings_and_long_chats_are_not_depth() -> None:
    rows, _ = parse(jl({"text": "[{" * 100 + '\\"[' * 50}, {"messages": [U, A] * 40}))
    assert len(rows) == 2


def test_integrity_error_wins_over_row_error() -> None:
    def chunks() -> Iterator[bytes]:
        yield b"not json\n"
        yield b'{"text":"a"}\n'
        raise TruncatedDatasetError("the stream ended without a final chunk")

    with pytest.raises(TruncatedDatasetError):
        parse_jsonl(chunks(), source="t", max_row_bytes=100)


def test_integrity_error_wins_over_row_error_in_a_real_file() -> None:
    out = io.BytesIO()
    encrypt_stream(io.BytesIO(b"{bad\n" + jl({"text": "y" * 100}) * 100), out, KEY, dataset_id="t", chunk_size=4096)
    data = out.getvalue()[:-5]
    with pytest.raises(TruncatedDatasetError):
        parse_jsonl(open_encrypted(io.BytesIO(data), KEY), source="t", max_row_bytes=1000)


def test_max_row_bytes_must_be_positive() -> None:
    with pytest.raises(ConfigError):
        parse(GOOD, max_row_bytes=0)


# ---- no content in errors or logs (case 22)

CANARY = "CANARY-7f3a"
C = CANARY.encode()

CANARY_ROWS = [
    b"{" + C + b"\n",  # invalid JSON
    b'{"text":"' + C + b'",}\n',  # invalid JSON near the canary
    b'{"text":"' + C + b"\xff" + b'"}\n',  # invalid UTF-8
    b'{"text":"' + C + b'\\ud800"}\n',  # lone surrogate
    b'{"text":"' + C + b'","text":"' + C + b'"}\n',  # duplicate key
    b'{"' + C + b'":"x"}\n',  # unexpected key named like the canary
    b'{"text":"' + C + b'","' + C + b'":1}\n',
    b'["' + C + b'"]\n',  # not an object
    b'{"text":["' + C + b'"]}\n',  # wrong type
    b'{"messages":[{"role":"' + C + b'","content":"x"}]}\n',  # bad role value
    b'{"messages":[{"role":"user","content":"' + C + b'","' + C + b'":1}]}\n',
    b'{"messages":[{"role":"user","content":"' + C + b'"},{"role":"user","content":"' + C + b'"}]}\n',
    b'{"messages":[{"role":"assistant","content":"' + C + b'"}]}\n',
    b'{"messages":[{"role":"user","content":"' + C + b'"}]}\n',
    b'{"text":"' + C * 20 + b'"}\n',  # oversized (max_row_bytes below)
    b'{"text":' + b"[" * 40 + b'"' + C + b'"' + b"]" * 40 + b"}\n",  # too deep
    b'{"text":"' + C + b'","n":' + b"1" * 5000 + b"}\n",  # integer too long for int()
]


@pytest.mark.parametrize("bad", CANARY_ROWS, ids=range(len(CANARY_ROWS)))
@pytest.mark.parametrize("chunk", [None, 3])
def test_canary_never_appears_in_errors_or_logs(bad: bytes, chunk, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    data = jl({"text": CANARY}) + bad
    with pytest.raises(RowError) as err:
        parse(data, max_row_bytes=150 if b"[" * 40 not in bad and len(bad) < 300 else 10_000, chunk=chunk)
    exc = err.value
    assert type(exc) is RowError
    rendered = "".join(traceback.format_exception(exc))
    for text in (str(exc), exc.message, exc.fix, repr(exc.args), rendered, caplog.text):
        assert "CANARY" not in text
    assert exc.__context__ is None and exc.__cause__ is None  # no chained parser error holding the row
