"""Parquet and Arrow IPC datasets: a table of rows, read from memory and validated like JSONL rows.

The owner encrypts the table file as it is (``cvm-tune dataset encrypt`` checks every row first); the header's
``content_type`` says which format the plaintext is (:data:`CONTENT_TYPES`). Inside the CVM the decrypted bytes are
collected in memory and read with pyarrow from a ``pa.BufferReader`` (never from a path: plaintext stays off disk),
then each table row becomes a row dict and goes through the same checks as a JSONL row (:mod:`app.dataset.rows`),
with errors naming the row number (1-based), never content.

Schema rules (checked before any row; :class:`~app.errors.TableError` naming the column):

* the columns are those of one row kind: ``text`` and/or ``messages`` (supervised), or ``prompt``, ``chosen`` and
  ``rejected`` (preference), plus an optional ``split``; any other column (a nested ``metadata`` struct, an id) is
  refused, so nothing the objective does not use is carried into the CVM;
* ``text``, ``split`` and plain ``prompt`` / ``chosen`` / ``rejected``: string columns (dictionary-encoded strings,
  a categorical column, too); ``messages`` and conversational ``prompt`` / ``chosen`` / ``rejected``: lists of
  ``struct<role: string, content: string>``;
* a null cell means the key is absent in that row (a columnar file cannot leave a key out), so one file can mix text
  and chat rows; whatever is left must be a valid row.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.dataset.rows import PREFERENCE, RowReport, _check_row, row_digest
from app.errors import DataError, DatasetTooLargeError, EmptyDatasetError, TableError

PARQUET = "application/vnd.apache.parquet"
ARROW = "application/vnd.apache.arrow.file"
CONTENT_TYPES = {PARQUET: "parquet", ARROW: "arrow"}
SUFFIXES = {".parquet": PARQUET, ".arrow": ARROW, ".feather": ARROW, ".ipc": ARROW}
SFT_COLUMNS = frozenset({"text", "messages", "split"})
DPO_COLUMNS = frozenset({*PREFERENCE, "split"})
_STRING_ONLY = frozenset({"text", "split"})


@dataclass(frozen=True)
class _Row:
    source: str
    line: int  # the row number, 1-based (RowReport.lines holds these for table rows)
    offset: int = 0

    def __str__(self) -> str:
        return f"{self.source} row {self.line}"


def format_name(content_type: str) -> str:
    """``jsonl``, ``parquet`` or ``arrow`` for a dataset content type."""
    return CONTENT_TYPES.get(content_type, "jsonl")


def read_table(data: bytes | bytearray | memoryview, content_type: str, *, source: str) -> Any:
    """The ``pyarrow.Table`` in ``data`` (Parquet or Arrow IPC file / stream), read from memory.

    Raises:
        TableError: not a readable file of that format (truncated, corrupt, another format).
    """
    import pyarrow as pa

    buf = pa.py_buffer(bytes(data) if isinstance(data, bytearray) else data)
    problem = None
    try:
        if content_type == PARQUET:
            import pyarrow.parquet as pq

            return pq.read_table(pa.BufferReader(buf))
        try:
            return pa.ipc.open_file(pa.BufferReader(buf)).read_all()
        except pa.ArrowInvalid:
            return pa.ipc.open_stream(pa.BufferReader(buf)).read_all()
    except (pa.ArrowException, OSError, ValueError) as exc:  # message names the format problem, never cell values
        problem = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    raise TableError(f"{source} is not a readable {format_name(content_type)} file ({problem})",
                     fix="write the table again (pyarrow.parquet.write_table / pyarrow.feather.write_feather) and "
                     "encrypt the complete file")


def check_schema(table: Any, *, source: str) -> str:
    """Check the columns (module docstring); returns the row family, ``sft`` or ``dpo``.

    Raises:
        TableError: an unknown or mistyped column, or columns of both families.
    """
    import pyarrow as pa

    names = list(table.schema.names)
    if len(set(names)) != len(names):
        raise TableError(f"{source} has duplicate column names")
    cols = set(names)
    family = "dpo" if cols & set(PREFERENCE) else "sft"
    allowed = DPO_COLUMNS if family == "dpo" else SFT_COLUMNS
    extra = sorted(cols - allowed)
    if extra:
        shown = ", ".join(repr(c[:64]) for c in extra[:5])
        raise TableError(f"{source}: column(s) {shown} not used by {'preference' if family == 'dpo' else 'text/chat'} "
                         f"rows (allowed: {', '.join(sorted(allowed))})", fix="drop those columns before encrypting")
    if family == "sft" and not cols & {"text", "messages"}:
        raise TableError(f"{source} has neither a 'text' nor a 'messages' column (nor 'prompt', 'chosen', 'rejected')")
    if family == "dpo" and not cols >= set(PREFERENCE):
        raise TableError(f"{source} needs all of 'prompt', 'chosen' and 'rejected' columns "
                         f"(missing: {', '.join(sorted(set(PREFERENCE) - cols))})")
    for field in table.schema:
        if _is_text(field.type) and field.name != "messages":
            continue
        if field.name not in _STRING_ONLY and _is_messages(field.type):
            continue
        want = "string" if field.name in _STRING_ONLY else (
            "list<struct<role: string, content: string>>" if field.name == "messages" else
            "string or list<struct<role: string, content: string>>")
        raise TableError(f"{source}: column {field.name!r} has type {field.type}, expected {want}")
    return family


def _is_text(t: Any) -> bool:
    """A string column: plain, large, a string view, or dictionary-encoded strings (a categorical column, as pandas
    writes one); each cell reads back as a Python ``str``."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_messages(t: Any) -> bool:
    import pyarrow as pa

    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return False
    v = t.value_type
    if not pa.types.is_struct(v) or sorted(v.field(i).name for i in range(v.num_fields)) != ["content", "role"]:
        return False
    return all(_is_text(v.field(i).type) for i in range(v.num_fields))


def check_file(path: Path) -> tuple[str, str]:
    """What ``cvm-tune dataset encrypt`` checks before it writes anything: every row of the plaintext file, by the
    rules the CVM applies (a table by its suffix, :data:`SUFFIXES`, anything else JSONL). Returns the content type
    and a line to print. A JSONL file is read in chunks and no row is kept (it may be larger than memory); its rows
    are checked up to the largest ``dataset.max_row_bytes`` a configuration may set.

    Raises:
        DataError: the file cannot be read (a FIFO or device included: refused without blocking).
        TableError: a table that cannot be read, or its columns (exit 3).
        RowError: the first bad row: its number (or line and byte offset), the field, no content (exit 3).
        EmptyDatasetError: no rows.
    """
    from app.config import DatasetSettings
    from app.dataset.format import CONTENT_TYPE
    from app.dataset.rows import parse_jsonl
    from app.fsutil import open_regular

    content_type = SUFFIXES.get(path.suffix.lower(), CONTENT_TYPE)
    limit = next(m.le for m in DatasetSettings.model_fields["max_row_bytes"].metadata if hasattr(m, "le"))
    try:
        with open_regular(path) as fh:
            if content_type != CONTENT_TYPE:
                _rows, rep = rows_of_table(read_table(fh.read(), content_type, source=path.name), source=path.name)
            else:
                _rows, rep = parse_jsonl(iter(lambda: fh.read(1 << 20), b""), source=path.name, max_row_bytes=limit,
                                         keep_rows=False)
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}", fix="pass the plaintext JSONL, Parquet or Arrow file") \
            from None
    kinds = ", ".join(f"{k} {v}" for k, v in rep.by_kind.items() if v)
    return content_type, f"format: {format_name(content_type)}; {rep.rows_kept} rows validated ({kinds})"


def parse_table(chunks: Iterable[bytes], content_type: str, *, source: str, dedup: str = "off",
                max_plaintext_bytes: int | None = None) -> tuple[list[dict], RowReport]:
    """:func:`app.dataset.rows.parse_jsonl` for a table: every chunk is consumed (authenticated) first, then the
    table is read from memory, its schema checked and each row validated; duplicates dropped as for JSONL.

    Raises:
        DatasetTooLargeError: more than ``max_plaintext_bytes`` (the rest of the stream is still authenticated).
        TableError: unreadable file, bad schema.
        RowError: the first bad row (its 1-based number; no content).
        EmptyDatasetError: no rows.
    """
    buf = bytearray()
    stream = iter(chunks)
    for chunk in stream:
        buf += chunk
        if max_plaintext_bytes is not None and len(buf) > max_plaintext_bytes:
            buf.clear()
            for _ in stream:  # authenticate the rest: tampering or truncation is the real error then
                pass
            raise DatasetTooLargeError(f"{source} holds more than max_plaintext_bytes ({max_plaintext_bytes}) of "
                                       "plaintext; training keeps every row in memory")
    try:
        return rows_of_table(read_table(buf, content_type, source=source), source=source, dedup=dedup)
    finally:
        buf[:] = b"\0" * len(buf)  # the plaintext file bytes are not needed once the rows exist


def rows_of_table(table: Any, *, source: str, dedup: str = "off") -> tuple[list[dict], RowReport]:
    """Validated rows of a table (schema first, then row by row); see :func:`parse_table`."""
    check_schema(table, source=source)
    rows: list[dict] = []
    by_kind = {"messages": 0, "text": 0}
    seen: set[bytes] | None = None if dedup == "off" else set()
    kept_at: list[int] = []
    dup_lines: list[int] = []
    for n, raw in enumerate(table.to_pylist(), start=1):
        row = {k: v for k, v in raw.items() if v is not None}  # a null cell: the key is absent in this row
        kind = _check_row(row, _Row(source, n))
        if seen is not None:
            digest = row_digest(row, dedup)  # type: ignore[arg-type]
            if digest in seen:
                dup_lines.append(n)
                continue
            seen.add(digest)
        by_kind[kind] = by_kind.get(kind, 0) + 1
        rows.append(row)
        kept_at.append(n)
    if not rows:
        raise EmptyDatasetError(f"{source} has no rows", fix="the dataset must hold at least one row")
    total = table.num_rows
    return rows, RowReport(rows_total=total, rows_kept=len(rows), by_kind=by_kind, duplicates_dropped=total - len(rows),
                           lines=tuple(kept_at), duplicate_lines=tuple(dup_lines))
