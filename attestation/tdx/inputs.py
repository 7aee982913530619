"""What a relying party hands the verifier, read with bounded memory and turned into typed values.

* a quote file: raw bytes, hex text (``0x`` and whitespace allowed), a dstack GetQuote JSON
  response (``{"quote": "<hex>", "event_log": "<JSON string>", ...}``) or an Attest answer
  (``{"attestation": "<hex>"}``, decoded by :mod:`attestation.tdx.attest`), at most
  :data:`MAX_QUOTE_INPUT_BYTES`;
* an event log file: the JSON list, or any JSON object with an ``event_log`` member (a GetQuote
  response, Info's ``tcb_info``), at most :data:`MAX_EVENT_LOG_BYTES`;
* a collateral file (dcap-qvl ``QuoteCollateralV3`` JSON, see :mod:`attestation.tdx.dcap`);
* an expected report_data as hex (at most 64 bytes; shorter values are right-padded with zeros,
  as dstack's GetQuote does).

Every reader opens the file once and reads at most its limit + 1 bytes, so a 100 MB file costs no
more memory than a small one. Every failure is an :class:`~attestation.errors.AttestationError`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from attestation.tdx.dcap import MAX_COLLATERAL_BYTES, Collateral, parse_collateral
from attestation.errors import AttestationError, CollateralError, EventLogError, QuoteParseError, ReportDataError
from attestation.tdx.eventlog import Event, parse_event_log

MAX_QUOTE_INPUT_BYTES = 4 << 20  # a quote file: raw, hex, or a GetQuote JSON response with its event log
MAX_EVENT_LOG_BYTES = 16 << 20


def read_bounded(path: Path, limit: int, error: type[AttestationError], what: str) -> bytes:
    """Read at most ``limit`` bytes of ``path``.

    Raises:
        error: unreadable, empty, or longer than ``limit`` (one message naming the file).
    """
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror}", fix=f"pass an existing {what} file") from exc
    if not data:
        raise error(f"{what} {path} is empty")
    if len(data) > limit:
        raise error(f"{what} {path} is larger than {limit} bytes; this is not a {what}")
    return data


def decode_quote_input(data: bytes, *, source: str = "quote") -> bytes:
    """Accept raw quote bytes, hex text (``0x`` prefix and whitespace allowed) or a dstack GetQuote
    JSON response (``{"quote": "<hex>", ...}``) and return the raw bytes.

    Raises:
        QuoteParseError: empty, odd-length/invalid hex, JSON without a ``quote`` string, or too large.
    """
    return decode_quote_input_with_log(data, source=source)[0]


def decode_quote_input_with_log(data: bytes, *, source: str = "quote") -> tuple[bytes, str | list[Any] | None]:
    """:func:`decode_quote_input`, plus the ``event_log`` of a GetQuote JSON response (else None).

    Raises:
        QuoteParseError: as :func:`decode_quote_input`; also an ``event_log`` that is neither a
            JSON string nor a list.
    """
    if not data:
        raise QuoteParseError(f"{source} is empty")
    if len(data) > MAX_QUOTE_INPUT_BYTES:
        raise QuoteParseError(f"{source} is larger than {MAX_QUOTE_INPUT_BYTES} bytes; a DCAP quote is a few KB")
    head = data.lstrip()[:1]
    if head in (b"{", b"["):
        obj = _json(data, QuoteParseError, source)
        if not isinstance(obj, dict) or not isinstance(obj.get("quote"), str):
            raise QuoteParseError(f"{source} is JSON without a \"quote\" hex string (expected a GetQuote response)")
        log = obj.get("event_log")
        if log is not None and not isinstance(log, (str, list)):
            raise QuoteParseError(f"{source}: \"event_log\" must be a JSON string or list")
        return _from_hex(obj["quote"].encode(), source), log
    if _looks_like_hex(data):
        return _from_hex(data, source), None
    return bytes(data), None


def attest_answer(data: bytes) -> dict[str, Any] | str | None:
    """A guest agent ``Attest`` answer (a JSON object with an ``attestation`` member and no ``quote``): its parsed JSON,
    or why a file that names ``"attestation"`` does not parse (a truncated answer: a rejection, not a quote to read);
    None for any other quote input (its own reader reports what is wrong with it)."""
    if data.lstrip()[:1] != b"{" or b'"attestation"' not in data:
        return None
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        return f"the Attest answer is not JSON (truncated?): {str(exc)[:200]}"
    return obj if isinstance(obj, dict) and "attestation" in obj and "quote" not in obj else None


def getquote_mr_config(data: bytes) -> bytes | None:
    """The MrConfigV3 document a GetQuote JSON response's ``vm_config`` carries (``mr_config``; 0.6 hosts that put it
    there), as its exact UTF-8 bytes; None when there is none. Never trusted: it must hash to MRCONFIGID."""
    try:
        obj = json.loads(data) if data.lstrip()[:1] == b"{" else None
        vm = json.loads(obj["vm_config"]) if isinstance(obj, dict) and isinstance(obj.get("vm_config"), str) else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    doc = vm.get("mr_config") if isinstance(vm, dict) else None
    return doc.encode() if isinstance(doc, str) and doc else None


def _json(data: bytes, error: type[AttestationError], source: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise error(f"{source} looks like JSON but does not parse: {str(exc)[:200]}") from exc


def _looks_like_hex(data: bytes) -> bool:
    text = data.strip()
    if text[:2] in (b"0x", b"0X"):
        return True
    return bool(text) and all(c in b"0123456789abcdefABCDEF \t\r\n" for c in text)


def _from_hex(text: bytes, source: str) -> bytes:
    cleaned = b"".join(text.split())
    if cleaned[:2] in (b"0x", b"0X"):
        cleaned = cleaned[2:]
    if len(cleaned) % 2:
        raise QuoteParseError(f"{source}: hex text has an odd number of digits ({len(cleaned)})")
    try:
        return bytes.fromhex(cleaned.decode("ascii"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise QuoteParseError(f"{source}: not valid hex") from exc


def read_quote_file(path: Path) -> bytes:
    """Read a quote file in any accepted form (see :func:`decode_quote_input`).

    Raises:
        QuoteParseError: missing/unreadable file or undecodable content.
    """
    return read_quote_input(path)[0]


def read_quote_input(path: Path) -> tuple[bytes, str | list[Any] | None]:
    """Read a quote file and return ``(raw quote, event_log of a GetQuote response or None)``.

    Raises:
        QuoteParseError: missing/unreadable/empty/oversized file or undecodable content.
    """
    data = read_bounded(path, MAX_QUOTE_INPUT_BYTES, QuoteParseError, "quote")
    return decode_quote_input_with_log(data, source=str(path))


def event_log_from_json(data: str | bytes | list[Any], *, source: str = "event log") -> tuple[Event, ...]:
    """Decode an event log: a JSON list, or a JSON object carrying it under ``event_log``.

    Raises:
        EventLogError: not JSON, or no list of well-formed events.
    """
    obj = _json(data, EventLogError, source) if isinstance(data, (str, bytes)) else data
    if isinstance(obj, dict):
        if "event_log" not in obj:
            raise EventLogError(f"{source} is a JSON object without an \"event_log\" member")
        obj = obj["event_log"]
        if isinstance(obj, str):
            obj = _json(obj.encode(), EventLogError, f"{source}: event_log")
    return parse_event_log(obj)


def read_event_log_file(path: Path) -> tuple[Event, ...]:
    """Read an event-log file (see :func:`event_log_from_json`).

    Raises:
        EventLogError: unreadable, oversized or malformed.
    """
    return event_log_from_json(read_bounded(path, MAX_EVENT_LOG_BYTES, EventLogError, "event log"), source=str(path))


def read_collateral_file(path: Path) -> Collateral:
    """Read and parse a collateral JSON file.

    Raises:
        CollateralError: unreadable, oversized or not dcap-qvl collateral.
    """
    return parse_collateral(read_bounded(path, MAX_COLLATERAL_BYTES, CollateralError, "collateral"))


def parse_report_data_hex(text: str) -> bytes:
    """An expected report_data: hex (``0x`` allowed), at most 64 bytes, right-padded with zeros to 64.

    Raises:
        ReportDataError: not hex, odd length, or longer than 64 bytes.
    """
    cleaned = text.strip()
    if cleaned[:2] in ("0x", "0X"):
        cleaned = cleaned[2:]
    if len(cleaned) % 2 or not all(c in "0123456789abcdefABCDEF" for c in cleaned):
        raise ReportDataError(f"--report-data {text[:40]!r} is not an even number of hex digits")
    value = bytes.fromhex(cleaned)
    if len(value) > 64:
        raise ReportDataError(f"--report-data is {len(value)} bytes; report_data is at most 64 bytes")
    return value.ljust(64, b"\0")
