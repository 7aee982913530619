"""The app's audit trail: a persistent hash chain on the output volume, mirrored into RTMR3.

``state/audit.jsonl`` is append-only (one canonical entry per line, fsynced); it continues across
runs and reboots, and each export carries its run's slice. Every entry is also emitted to the
guest agent as the RTMR3 event ``cvm-tune.<type>`` with the entry line as payload, when the agent
supports EmitEvent (format and verification: ``attestation.bundle.audit``).

Order: emit first, then append. An emit that fails leaves the chain untouched, so the measured
events and the chain never disagree because of an agent error.

Where the agent cannot measure events (dstack 0.6 has no EmitEvent), each ``checkpoint`` and ``promote`` entry is
anchored instead: a quote over the entry's hash, appended to ``state/audit-anchors.jsonl`` before the entry joins
the chain (format and verification: ``attestation.bundle.anchors``), and ``on_anchor`` is told the new head (the
service publishes it to ``state.rollback_anchor``, outside the volume).
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from attestation.bundle.anchors import ANCHORED_TYPES, Anchor, AnchorFormatError, make_anchor, parse_anchor_lines
from attestation.bundle.anchors import report_data as anchor_report_data
from attestation.errors import QuoteParseError
from attestation.tdx.quote import Quote
from attestation.bundle.audit import GENESIS, AuditEntry, AuditFormatError, chain_problems, make_entry, parse_lines

from app.errors import StateError, TeeError
from app.fsutil import atomic_write_bytes, fsync_dir
from app.tee import EmitUnsupported, GuestAgent

RtmrMode = Literal["emit_event", "unsupported"]


def utc_now() -> str:
    """Wall time for audit entries (host-influenced in a CVM: informational, never used for decisions)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class AuditLog:
    """The persistent chain file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.anchors_path = self.path.with_name("audit-anchors.jsonl")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.repaired = False
        self.entries = self._load()

    def _load(self) -> list[AuditEntry]:
        data = self._complete_lines(self.path)
        if data is None:
            return []
        try:
            entries = parse_lines(data)
        except AuditFormatError as exc:
            raise StateError(f"audit log {self.path} is corrupt: {exc}", fix="restore it from a backup; never edit it") from exc
        problems = chain_problems(entries)
        if problems:
            raise StateError(f"audit log {self.path} is broken: {problems[0]}", fix="restore it from a backup; never edit it")
        return entries

    def _complete_lines(self, path: Path) -> bytes | None:
        """The file's bytes; a partial last line (a crash in the middle of an append) is dropped from the file: it
        was never complete (an entry not in the chain; an anchor whose entry was never appended)."""
        if not path.exists():
            return None
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            data = data[: data.rfind(b"\n") + 1]
            atomic_write_bytes(path, data)
            self.repaired = True
        return data

    def anchors(self) -> list[Anchor]:
        """Every anchor written so far (those of entries that never joined the chain included)."""
        try:
            return parse_anchor_lines(self._complete_lines(self.anchors_path) or b"")
        except AnchorFormatError as exc:
            raise StateError(f"audit anchors {self.anchors_path} are corrupt: {exc}",
                             fix="restore them from a backup; never edit them") from exc

    @property
    def head(self) -> str:
        return self.entries[-1].hash if self.entries else GENESIS

    def next_entry(self, run_id: str, type_: str, data: dict[str, Any]) -> AuditEntry:
        """The entry that would be appended next (not yet written)."""
        seq = self.entries[-1].seq + 1 if self.entries else 0
        return make_entry(seq=seq, run_id=run_id, type=type_, time=utc_now(), data=data, prev=self.head)

    def append(self, entry: AuditEntry) -> None:
        """Append one line durably (O_APPEND + fsync)."""
        if entry.prev != self.head:
            raise StateError("audit entry does not extend the current chain head")
        _append_line(self.path, entry.line)
        self.entries.append(entry)

    def append_anchor(self, anchor: Anchor) -> None:
        """Append one anchor line durably (before its entry joins the chain)."""
        _append_line(self.anchors_path, anchor.line)

    def run_slice(self, run_id: str) -> list[AuditEntry]:
        """This run's entries from its (last) run.start to the end of the chain."""
        starts = [i for i, e in enumerate(self.entries) if e.run_id == run_id and e.type == "run.start"]
        if not starts:
            raise StateError(f"audit log has no run.start for run {run_id}")
        return self.entries[starts[-1] :]


def _append_line(path: Path, line: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)


class AuditRecorder:
    """Appends entries and mirrors them into RTMR3 through the guest agent (or anchors them with quotes)."""

    def __init__(self, log: AuditLog, agent: GuestAgent, *, require_emit: bool,
                 on_anchor: Callable[[str], None] | None = None) -> None:
        self.log = log
        self.agent = agent
        self.require_emit = require_emit
        self.on_anchor = on_anchor
        self.rtmr3: RtmrMode | None = None  # decided by the first record()
        self.note: str | None = None

    def record(self, run_id: str, type_: str, data: dict[str, Any]) -> AuditEntry:
        """Emit (if supported) then append one entry.

        Raises:
            TeeError: EmitEvent failed after it had worked, or is unsupported while required.
        """
        entry = self.log.next_entry(run_id, type_, data)
        if self.rtmr3 != "unsupported":
            try:
                self.agent.emit(entry.event_name, entry.line)
                if self.rtmr3 is None and self.agent.last_runtime_event() != (entry.event_name, entry.line):
                    # The agent said OK but did not measure it (dstack simulator 0.5.3-0.5.8 no-op).
                    raise EmitUnsupported("guest agent accepted EmitEvent but did not record it in RTMR3")
                self.rtmr3 = "emit_event"
            except EmitUnsupported as exc:
                if self.rtmr3 == "emit_event" or self.require_emit:
                    raise TeeError(f"cannot measure audit events into RTMR3: {exc.message}",
                                   fix="use a dstack OS 0.5.x guest agent, or set tee.emit_events: auto") from exc
                self.rtmr3, self.note = "unsupported", exc.message
        anchored = self.rtmr3 == "unsupported" and type_ in ANCHORED_TYPES
        if anchored:  # the quote first: an anchored type never joins the chain without its anchor
            wanted = anchor_report_data(entry.seq, entry.hash)
            quote, event_log = self.agent.quote(wanted)
            try:
                got = Quote.from_bytes(quote).td
            except QuoteParseError as exc:
                raise TeeError(f"the guest agent's quote does not parse: {exc.message}") from exc
            if got is None or got.report_data != wanted:
                raise TeeError("the guest agent's quote is over other report_data than asked: the audit chain cannot "
                               "be anchored", fix="report this: the guest agent is inconsistent")
            self.log.append_anchor(make_anchor(entry, quote, event_log))
        self.log.append(entry)
        if anchored and self.on_anchor is not None:
            self.on_anchor(entry.hash)
        return entry
