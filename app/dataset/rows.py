"""JSONL rows from decrypted chunks, validated in memory.

A row is one line: a JSON object with exactly one of

* ``"messages"``: a non-empty array of ``{"role": ..., "content": ...}``; an optional ``system``
  message first, then turns alternating ``user`` / ``assistant`` starting with ``user``, and at
  least one ``assistant`` message; every ``content`` a non-blank string; or
* ``"text"``: a non-blank string.

or, for preference training (``training.objective: dpo``), exactly ``"prompt"``, ``"chosen"`` and
``"rejected"``: three non-blank strings, or (conversational) a ``prompt`` of messages as above that ends
with a ``user`` turn and ``chosen`` / ``rejected`` each one ``assistant`` message;

and optionally ``"split"``: ``"train"`` (the default) or ``"eval"`` (held out for the promotion gate).

Lines end in ``\\n`` (a ``\\r`` before it is dropped); blank lines are skipped. The first bad row
rejects the dataset. Error messages name the source, line, byte offset, field path and JSON type
names, **never row content** (rows may be secret and logs may be public).

Counted policy decisions (never errors): duplicate rows are dropped in file order, the first
occurrence kept (``dedup``: ``exact`` compares the parsed JSON, so key order, whitespace and
escapes do not matter; ``normalized`` also folds Unicode (NFKC), case and runs of whitespace in
every string; ``off`` keeps all). Rows are held in memory for training, so a plaintext larger
than ``max_plaintext_bytes`` is refused (after the rest of the stream was authenticated).
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from app.errors import ConfigError, DatasetTooLargeError, EmptyDatasetError, RowError
from attestation.io.hashing import canonical_json

Dedup = Literal["exact", "normalized", "off"]

MAX_DEPTH = 32
ROLES = ("system", "user", "assistant")
PREFERENCE = ("prompt", "chosen", "rejected")  # a preference (DPO) row
SPLITS = ("train", "eval")  # optional "split" key: eval rows are held out for the promotion gate, never trained on
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


@dataclass(frozen=True)
class RowReport:
    """Row counts (never content)."""

    rows_total: int  # valid rows read
    rows_kept: int  # after dropping duplicates
    by_kind: dict[str, int]  # of the kept rows
    duplicates_dropped: int = 0
    lines: tuple[int, ...] = ()  # the line number of each kept row (positions for later policy decisions)
    duplicate_lines: tuple[int, ...] = ()  # the line numbers of the dropped duplicates


def parse_jsonl(chunks: Iterable[bytes], *, source: str, max_row_bytes: int, dedup: Dedup = "off",
                max_plaintext_bytes: int | None = None, keep_rows: bool = True) -> tuple[list[dict], RowReport]:
    """Split, decode and validate JSONL rows from plaintext chunks (a row may span chunks).

    The whole of ``chunks`` is consumed before anything is returned, so rows from an encrypted
    stream come back only after its final chunk authenticated. If a row is bad (or the data too
    large), the rest of the stream is still read: an integrity error there wins over the row error.

    Args:
        chunks: plaintext pieces, e.g. a :class:`~app.dataset.format.DecryptedStream`.
        source: a name for error messages (a file name, not a secret path).
        max_row_bytes: rows longer than this (without the line ending) are rejected unparsed.
        dedup: duplicate-row policy (module docstring).
        max_plaintext_bytes: refuse more plaintext than this (``None``: no limit).
        keep_rows: ``False`` checks every row and keeps none (memory: one row at a time; ``dataset encrypt``'s check
            of a file that may be larger than memory); the rows returned are then empty, the counts complete.

    Returns:
        The kept rows and their counts.

    Raises:
        RowError: the first bad row (line, byte offset, field path; no content).
        EmptyDatasetError: no rows at all.
        DatasetTooLargeError: more than ``max_plaintext_bytes`` of plaintext.
        ConfigError: ``max_row_bytes`` is not positive, or an unknown ``dedup`` policy.
    """
    if max_row_bytes < 1:
        raise ConfigError("max_row_bytes must be at least 1")
    if dedup not in ("exact", "normalized", "off"):
        raise ConfigError(f"unknown dedup policy {dedup!r}")
    stream = iter(chunks)
    splitter = _Lines(source, max_row_bytes)
    rows: list[dict] = []
    by_kind = {"messages": 0, "text": 0}
    seen: set[bytes] | None = None if dedup == "off" else set()
    kept_at: list[int] = []
    dup_lines: list[int] = []
    total = fed = dropped = 0
    try:
        for chunk in stream:
            fed += len(chunk)
            if max_plaintext_bytes is not None and fed > max_plaintext_bytes:
                rows.clear()  # nothing more is kept while the rest is authenticated
                raise DatasetTooLargeError(f"{source} holds more than max_plaintext_bytes ({max_plaintext_bytes}) of "
                                           "plaintext; training keeps every row in memory")
            for where, line in splitter.feed(chunk):
                total += _take(line, where, max_row_bytes, rows, by_kind, seen, dedup, kept_at, dup_lines)
            if not keep_rows:
                dropped += len(rows)
                rows.clear()
        for where, line in splitter.finish():
            total += _take(line, where, max_row_bytes, rows, by_kind, seen, dedup, kept_at, dup_lines)
    except (RowError, DatasetTooLargeError):
        for _ in stream:  # authenticate the rest: tampering or truncation is the real error then
            pass
        raise
    kept = len(rows) + dropped
    if not keep_rows:
        rows.clear()
    if not kept:
        raise EmptyDatasetError(f"{source} has no rows", fix="the dataset must hold at least one JSONL row")
    return rows, RowReport(rows_total=total, rows_kept=kept, by_kind=by_kind, duplicates_dropped=total - kept,
                           lines=tuple(kept_at), duplicate_lines=tuple(dup_lines))


def row_digest(row: Any, dedup: Dedup) -> bytes:
    """The identity of a row for deduplication (a SHA-256, so only digests are kept in memory)."""
    if dedup == "normalized":
        row = _normalize(row)
    return hashlib.sha256(canonical_json(row)).digest()


def _normalize(value: Any) -> Any:
    if isinstance(value, str):
        return " ".join(unicodedata.normalize("NFKC", value).casefold().split())
    if isinstance(value, list):
        return [_normalize(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalize(v) for k, v in value.items()}
    return value


class _Lines:
    """Splits chunks into lines, buffering at most ``max_row_bytes + 1`` bytes of one row."""

    def __init__(self, source: str, max_row_bytes: int) -> None:
        self.source = source
        self.limit = max_row_bytes + 1  # + 1 leaves room for a "\r" before the "\n"
        self.buf = bytearray()
        self.line_no = 1
        self.start = 0  # byte offset of the current line in the plaintext

    def _where(self) -> _Where:
        return _Where(self.source, self.line_no, self.start)

    def feed(self, chunk: bytes) -> Iterator[tuple[_Where, bytes]]:
        pos = 0
        while True:
            nl = chunk.find(b"\n", pos)
            end = len(chunk) if nl < 0 else nl
            if len(self.buf) + end - pos > self.limit:  # stop before buffering an oversized row
                raise RowError(f"{self._where()}: row is longer than max_row_bytes ({self.limit - 1})")
            if nl < 0:
                self.buf += chunk[pos:]
                return
            if self.buf:
                self.buf += chunk[pos:nl]
                line = bytes(self.buf)
                self.buf.clear()
            else:
                line = chunk[pos:nl]
            yield self._where(), line
            self.start += len(line) + 1
            self.line_no += 1
            pos = nl + 1

    def finish(self) -> Iterator[tuple[_Where, bytes]]:
        if self.buf:  # a last row without a final newline
            yield self._where(), bytes(self.buf)
            self.buf.clear()


@dataclass(frozen=True)
class _Where:
    source: str
    line: int
    offset: int

    def __str__(self) -> str:
        return f"{self.source} line {self.line}"


def _take(line: bytes, where: _Where, max_row_bytes: int, rows: list[dict], by_kind: dict[str, int],
          seen: set[bytes] | None, dedup: Dedup, kept_at: list[int], dup_lines: list[int]) -> int:
    """Validate one line; keep it unless it duplicates an earlier row. Returns 1 for a row, 0 for a blank line."""
    if line.endswith(b"\r"):
        line = line[:-1]
    if not line.strip(b" \t\r"):
        return 0
    if len(line) > max_row_bytes:
        raise RowError(f"{where}: row is longer than max_row_bytes ({max_row_bytes})")
    row = _decode(line, where)
    kind = _check_row(row, where)
    if seen is not None:
        digest = row_digest(row, dedup)
        if digest in seen:
            dup_lines.append(where.line)
            return 1
        seen.add(digest)
    by_kind[kind] = by_kind.get(kind, 0) + 1
    rows.append(row)
    kept_at.append(where.line)
    return 1


def _decode(line: bytes, where: _Where) -> Any:
    """Strict UTF-8, a depth check, then ``json.loads``.

    Errors are raised outside the ``except`` blocks so the new error does not carry the decoder's
    exception (which holds the row's bytes) as its context.
    """
    problem = None
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        problem = f"invalid UTF-8 at byte offset {where.offset + exc.start} ({exc.reason})"
    if problem is not None:
        raise RowError(f"{where}: {problem}")
    if _too_deep(line):
        raise RowError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        problem = f"invalid JSON ({exc.msg} at column {exc.colno}, byte offset {where.offset + len(text[:exc.pos].encode())})"
    except _RowValueError as exc:
        problem = f"invalid JSON ({exc.args[0]})"
    except (ValueError, RecursionError) as exc:  # e.g. an integer with too many digits
        problem = f"invalid JSON ({type(exc).__name__})"
    raise RowError(f"{where}: {problem}")


def _too_deep(line: bytes) -> bool:
    """Whether the JSON nests deeper than MAX_DEPTH (checked before parsing; no recursion)."""
    if line.count(b"[") + line.count(b"{") <= MAX_DEPTH:  # cheap: cannot be deeper than this
        return False
    depth = 0
    for c in _STRING.sub(b"", line).translate(None, _NOT_BRACKETS):  # brackets outside strings
        depth += 1 if c in b"[{" else -1
        if depth > MAX_DEPTH:
            return True
    return False


class _RowValueError(ValueError):
    """A content-free parse problem raised from our json hooks."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):  # the key itself is content: do not name it
        raise _RowValueError("duplicate key in an object")
    return obj


def _no_constant(_name: str) -> Any:
    raise _RowValueError("NaN/Infinity are not JSON")


def _type(value: Any) -> str:
    return "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)


def _check_text(value: Any, where: _Where, path: str) -> None:
    if not isinstance(value, str):
        raise RowError(f"{where}: {path}: expected a string, got {_type(value)}")
    if not value.strip():
        raise RowError(f"{where}: {path}: must not be empty or whitespace only")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            bad = True
        else:
            bad = False
        if bad:
            raise RowError(f"{where}: {path}: contains a lone surrogate (an unpaired \\uD800-\\uDFFF escape)")


def _check_row(row: Any, where: _Where) -> str:
    """Check one parsed row; returns its kind (``messages`` or ``text``)."""
    if not isinstance(row, dict):
        raise RowError(f"{where}: expected a JSON object, got {_type(row)}")
    if "split" in row and row["split"] not in SPLITS:
        raise RowError(f"{where}: split: expected \"train\" or \"eval\"")
    if row.keys() & {"chosen", "rejected"}:  # a preference row (a lone "prompt" is an unexpected key below)
        return _check_preference(row, where)
    extra = len(row.keys() - {"messages", "text", "split"})
    if extra:
        raise RowError(f"{where}: {extra} unexpected key(s); a row has exactly one of 'messages' or 'text' "
                       "(and optionally 'split'), or 'prompt', 'chosen' and 'rejected'")
    if "messages" in row and "text" in row:
        raise RowError(f"{where}: has both 'messages' and 'text'; a row has exactly one")
    if "text" in row:
        _check_text(row["text"], where, "text")
        return "text"
    if "messages" not in row:
        raise RowError(f"{where}: missing 'messages' or 'text'")
    _check_messages(row["messages"], where)
    return "messages"


def _check_preference(row: dict, where: _Where) -> str:
    """A preference row (DPO): plain strings, or a conversational prompt and one assistant answer each."""
    extra = len(row.keys() - {*PREFERENCE, "split"})
    if extra:
        raise RowError(f"{where}: {extra} unexpected key(s); a preference row has exactly 'prompt', 'chosen' and "
                       "'rejected' (and optionally 'split')")
    for key in PREFERENCE:
        if key not in row:
            raise RowError(f"{where}: {key}: missing (a preference row has 'prompt', 'chosen' and 'rejected')")
    if all(isinstance(row[k], str) for k in PREFERENCE):
        for key in PREFERENCE:
            _check_text(row[key], where, key)
        return "preference"
    if not all(isinstance(row[k], list) for k in PREFERENCE):
        kinds = ", ".join(f"{k} {_type(row[k])}" for k in PREFERENCE)
        raise RowError(f"{where}: prompt, chosen and rejected must all be strings or all be message arrays ({kinds})")
    _check_messages(row["prompt"], where, "prompt", answered=False)
    for key in ("chosen", "rejected"):
        answer = row[key]
        if len(answer) != 1:
            raise RowError(f"{where}: {key}: expected exactly one assistant message, got {len(answer)} messages")
        _check_message(answer[0], where, f"{key}[0]")
        if answer[0]["role"] != "assistant":
            raise RowError(f"{where}: {key}[0].role: expected 'assistant'")
    return "preference"


def _check_message(msg: Any, where: _Where, path: str) -> None:
    if not isinstance(msg, dict):
        raise RowError(f"{where}: {path}: expected an object, got {_type(msg)}")
    extra = len(msg.keys() - {"role", "content"})
    if extra:
        raise RowError(f"{where}: {path}: {extra} unexpected key(s); a message has exactly 'role' and 'content'")
    for key in ("role", "content"):
        if key not in msg:
            raise RowError(f"{where}: {path}.{key}: missing")
    role = msg["role"]
    if role not in ROLES:  # the bad value itself is never echoed
        got = "" if isinstance(role, str) else f", got {_type(role)}"
        raise RowError(f"{where}: {path}.role: must be one of {', '.join(ROLES)}{got}")
    _check_text(msg["content"], where, f"{path}.content")


def _check_messages(messages: Any, where: _Where, name: str = "messages", *, answered: bool = True) -> None:
    """A conversation; ``answered``: it has an assistant message (a chat row), else it ends with a user turn (a
    preference row's prompt)."""
    if not isinstance(messages, list):
        raise RowError(f"{where}: {name}: expected an array, got {_type(messages)}")
    if not messages:
        raise RowError(f"{where}: {name}: must not be empty")
    expected, assistants = "user", 0
    for i, msg in enumerate(messages):
        path = f"{name}[{i}]"
        _check_message(msg, where, path)
        role = msg["role"]
        if role == "system":
            if i != 0:
                raise RowError(f"{where}: {path}.role: a system message is allowed only first")
            continue
        if role != expected:
            raise RowError(f"{where}: {path}.role: expected {expected!r} (turns alternate user/assistant, starting with user)")
        assistants += role == "assistant"
        expected = "assistant" if role == "user" else "user"
    if answered and not assistants:
        raise RowError(f"{where}: {name}: no assistant message")
    if not answered and expected != "assistant":
        raise RowError(f"{where}: {name}: must end with a user message (the answers are chosen and rejected)")


def split_eval_rows(rows: list[dict], lines: tuple[int, ...]) -> tuple[list[dict], tuple[int, ...], list[dict]]:
    """(training rows, their line numbers, eval rows): the owner's ``"split": "eval"`` rows are held out for the
    promotion gate and never trained on; the ``split`` key is dropped from both."""
    train, train_lines, held_out = [], [], []
    for i, row in enumerate(rows):
        clean = {k: v for k, v in row.items() if k != "split"}
        if row.get("split") == "eval":
            held_out.append(clean)
        else:
            train.append(clean)
            if i < len(lines):
                train_lines.append(lines[i])
    return train, tuple(train_lines), held_out
