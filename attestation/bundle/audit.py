"""The cvm-tune audit chain: format, hashing and verification (pure; shared by writer and verifier).

Each audit entry is one line of canonical JSON (``attestation.io.hashing.canonical_json``)::

    {"data":{...},"prev":"<hex sha256 of the previous line>","run_id":"...","seq":N,"time":"...Z","type":"run.start","v":1}

The entry hash is ``sha256(line bytes)``; the chain head is the hash of the last line; the first
entry ever has ``prev`` = 64 zeros. The same line bytes are the payload of the RTMR3 event
``cvm-tune.<type>`` (fixed, colon-free names: the v1 digest cannot separate ``a:b`` + ``c`` from
``a`` + ``b:c``), so a verifier can match the measured events with the chain.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from attestation.io.hashing import canonical_json, canonical_or_none, sha256_hex
from attestation.tdx.eventlog import ENTRY_TYPES, EVENT_PREFIX

GENESIS = "0" * 64
_KEYS = {"v", "seq", "run_id", "type", "time", "data", "prev"}


class AuditFormatError(ValueError):
    """A line is not a canonical cvm-tune audit entry."""


@dataclass(frozen=True)
class AuditEntry:
    """One parsed audit line."""

    seq: int
    run_id: str
    type: str
    time: str
    data: dict[str, Any]
    prev: str
    line: bytes  # exact canonical bytes

    @property
    def hash(self) -> str:
        """sha256 of the line: what the next entry's ``prev`` must be."""
        return sha256_hex(self.line)

    @property
    def event_name(self) -> str:
        """The RTMR3 event name this entry is emitted under."""
        return EVENT_PREFIX + self.type


def make_entry(*, seq: int, run_id: str, type: str, time: str, data: dict[str, Any], prev: str) -> AuditEntry:
    """Build an entry (the writer's side). ``data`` must hold hashes and counters, never dataset content."""
    if type not in ENTRY_TYPES:
        raise ValueError(f"unknown audit entry type {type!r}")
    obj = {"v": 1, "seq": seq, "run_id": run_id, "type": type, "time": time, "data": data, "prev": prev}
    return parse_entry(canonical_json(obj))


def parse_entry(line: bytes) -> AuditEntry:
    """Parse one line and insist it is already canonical (so its hash is unambiguous).

    Raises:
        AuditFormatError: not JSON, not canonical, unknown type or fields.
    """
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AuditFormatError("audit line is not JSON") from exc
    if not isinstance(obj, dict) or set(obj) != _KEYS or obj["v"] != 1:
        raise AuditFormatError("audit line does not have the v1 fields")
    if canonical_or_none(obj) != line:  # not canonical, or no canonical form at all (NaN, a lone surrogate)
        raise AuditFormatError("audit line is not in canonical form")
    if obj["type"] not in ENTRY_TYPES or not isinstance(obj["data"], dict):
        raise AuditFormatError(f"unknown audit entry type {obj['type']!r}")
    if not isinstance(obj["seq"], int) or not isinstance(obj["prev"], str) or len(obj["prev"]) != 64:
        raise AuditFormatError("audit line has a bad seq or prev")
    return AuditEntry(obj["seq"], obj["run_id"], obj["type"], obj["time"], obj["data"], obj["prev"], line)


def parse_lines(text: bytes) -> list[AuditEntry]:
    """Parse an ``audit.jsonl`` body (one entry per line, trailing newline required on each line)."""
    if text and not text.endswith(b"\n"):
        raise AuditFormatError("audit log does not end with a newline (truncated write?)")
    return [parse_entry(line) for line in text.split(b"\n")[:-1]] if text else []


def chain_problems(entries: list[AuditEntry]) -> list[str]:
    """Links and sequence numbers inside a contiguous slice of the chain (empty list = intact)."""
    problems = []
    for before, after in zip(entries, entries[1:], strict=False):  # consecutive pairs
        if after.prev != before.hash:
            problems.append(f"entry seq {after.seq}: prev does not match the hash of entry seq {before.seq}")
        if after.seq != before.seq + 1:
            problems.append(f"entry seq {after.seq} follows seq {before.seq}")
    if entries and entries[0].seq == 0 and entries[0].prev != GENESIS:
        problems.append("entry seq 0 does not start from the genesis hash")
    return problems
