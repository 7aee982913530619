"""Audit anchors: a quote over the audit chain's head at each durable step (pure; shared by writer and verifier).

On dstack 0.6 an app can no longer extend RTMR3 (EmitEvent always fails), so between two exports nothing measured
the chain. The service then anchors it instead: right after it writes a ``checkpoint`` or ``promote`` entry it asks
the guest agent for a quote whose report_data commits to that entry, and appends one anchor line to
``state/audit-anchors.jsonl``; a bundle carries the anchors of its slice as ``audit-anchors.jsonl`` (bound through
``manifest.files``; ``manifest.audit.anchors`` counts them). Each line is canonical JSON::

    {"event_log":"<the quote's event log, JSON text as the agent returned it>","head":"<entry hash>",
     "quote":"<hex>","seq":N,"v":1}

    report_data = SHA-512("cvm-tune-audit-anchor-v1:" || decimal seq || ":" || head)

The quote is taken before the entry is appended, so no entry of an anchored type is ever left without its anchor;
a crash between the two leaves an anchor of an entry that never joined the chain, which is never exported
(:func:`of_chain`). Verification: :func:`anchor_problems` (docs/verifier-spec.md section 4a).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from attestation.bundle.audit import AuditEntry
from attestation.bundle.manifest import AUDIT_ANCHORS, Manifest
from attestation.errors import AttestationError
from attestation.io.hashing import canonical_json, canonical_or_none
from attestation.policy import Policy
from attestation.tdx.dcap import Collateral
from attestation.tdx.eventlog import parse_event_log
from attestation.tdx.quote import Quote
from attestation.verify import QuoteFindings, verify_quote


ANCHOR_TAG = b"cvm-tune-audit-anchor-v1"
ANCHORED_TYPES = ("checkpoint", "promote")  # the durable steps a verifier relies on (export: the bundle's own quote)
MAX_ANCHORS = 10_000
_KEYS = {"event_log", "head", "quote", "seq", "v"}
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX = re.compile(r"(?:[0-9a-f]{2})+")
# The TD report fields an anchor's quote must share with the bundle's own quote: the same TD image, VM
# configuration and app (MRCONFIGID). RTMR3 may differ across a reboot (per-boot GPU evidence, a new key epoch).
SAME_TD = ("mr_td", "mr_config_id", "mr_owner", "mr_owner_config", "td_attributes", "xfam", "rt_mr0", "rt_mr1",
           "rt_mr2")
# The boot events that name the app and its deployment: equal in every anchor's event log and the bundle's.
SAME_BOOT = ("app-id", "compose-hash", "instance-id", "os-image-hash", "key-provider")


class AnchorFormatError(ValueError):
    """A line is not a canonical cvm-tune audit anchor."""


@dataclass(frozen=True)
class Anchor:
    seq: int
    head: str
    quote: bytes
    event_log: str
    line: bytes  # exact canonical bytes


def report_data(seq: int, head: str) -> bytes:
    """The 64-byte report_data that binds a quote to the chain entry ``seq`` whose hash is ``head``."""
    return hashlib.sha512(ANCHOR_TAG + b":" + str(seq).encode() + b":" + head.encode()).digest()


def make_anchor(entry: AuditEntry, quote: bytes, event_log: str) -> Anchor:
    """The anchor line for ``entry`` (the writer's side)."""
    return parse_anchor(canonical_json({"v": 1, "seq": entry.seq, "head": entry.hash, "quote": quote.hex(),
                                        "event_log": event_log}))


def parse_anchor(line: bytes) -> Anchor:
    """Parse one line and insist it is canonical.

    Raises:
        AnchorFormatError: not JSON, not canonical, or not exactly the v1 members with their types.
    """
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AnchorFormatError("anchor line is not JSON") from exc
    if not isinstance(obj, dict) or set(obj) != _KEYS or obj["v"] != 1 or type(obj["v"]) is not int:
        raise AnchorFormatError("anchor line does not have the v1 members")
    if canonical_or_none(obj) != line:  # not canonical, or no canonical form at all (NaN, a lone surrogate)
        raise AnchorFormatError("anchor line is not in canonical form")
    seq, head, quote, log = obj["seq"], obj["head"], obj["quote"], obj["event_log"]
    if type(seq) is not int or seq < 0 or not isinstance(head, str) or not _HEX64.fullmatch(head):
        raise AnchorFormatError("anchor line has a bad seq or head")
    if not isinstance(quote, str) or not _HEX.fullmatch(quote) or not isinstance(log, str):
        raise AnchorFormatError("anchor line has a bad quote or event_log")
    return Anchor(seq, head, bytes.fromhex(quote), log, line)


def parse_anchor_lines(text: bytes) -> list[Anchor]:
    """Parse an ``audit-anchors.jsonl`` body (every line ends with a newline).

    Raises:
        AnchorFormatError: a bad line, a missing final newline, or more than :data:`MAX_ANCHORS` lines.
    """
    if text and not text.endswith(b"\n"):
        raise AnchorFormatError("audit-anchors.jsonl does not end with a newline")
    lines = text.split(b"\n")[:-1] if text else []
    if len(lines) > MAX_ANCHORS:
        raise AnchorFormatError(f"more than {MAX_ANCHORS} anchors")
    return [parse_anchor(line) for line in lines]


def of_chain(anchors: Iterable[Anchor], entries: list[AuditEntry]) -> list[Anchor]:
    """The anchors of entries of ``entries`` (one per entry, the last written; an anchor whose entry never joined
    the chain is left out), in chain order."""
    by_seq = {e.seq: e for e in entries}
    kept: dict[int, Anchor] = {}
    for a in anchors:
        e = by_seq.get(a.seq)
        if e is not None and e.hash == a.head:
            kept[a.seq] = a
    return [kept[s] for s in sorted(kept)]


def check(f: QuoteFindings, root: Path, m: Manifest, entries: list[AuditEntry] | Exception, *, policy: Policy,
          now: int, collateral: Collateral | None, mr_config: bytes | None) -> None:
    """Check ``audit.anchors`` (after the quote steps, so ``f`` holds what the bundle's own quote showed)."""
    count = m.audit.anchors
    if count is None:
        if m.audit.rtmr3 == "emit_event":
            f.add("audit.anchors", "skip", "not anchored: every audit entry was measured into RTMR3 as it was written")
        else:
            f.add("audit.anchors", "fail" if policy.require_audit_anchors else "skip",
                  "no audit anchors: between the run's start and its export only report_data binds the chain")
        return
    if isinstance(entries, Exception):
        f.add("audit.anchors", "fail", "audit.jsonl unreadable: the anchors name entries of it")
        return
    try:
        anchors = parse_anchor_lines((root / AUDIT_ANCHORS).read_bytes())
    except (OSError, AnchorFormatError) as exc:
        f.add("audit.anchors", "fail", f"{AUDIT_ANCHORS} unreadable: {exc}")
        return
    problems = [] if len(anchors) == count else [f"{len(anchors)} anchors, the manifest says {count}"]
    main_failed = {c.name for c in f.checks if c.status == "fail"}
    main_td = _td_fields(f.quote)
    main_boot = {k: f.boot.hex(k) for k in SAME_BOOT} if f.boot is not None else {}

    def quote_check(raw: bytes, log: str, expected: bytes) -> tuple[set[str], dict[str, bytes], dict[str, str | None]]:
        try:
            events = parse_event_log(log)
        except AttestationError:
            events = None  # its event_log.* steps are then skipped: the boot identity below cannot match
        g = verify_quote(raw, policy=policy, now=now, collateral=collateral, events=events,
                         expected_report_data=expected, mr_config=mr_config)
        failed = {c.name for c in g.checks if c.status == "fail"}
        return failed, _td_fields(g.quote), {k: g.boot.hex(k) for k in SAME_BOOT} if g.boot is not None else {}

    problems += anchor_problems(anchors, entries, quote_check, main_failed=main_failed, main_td=main_td,
                                main_boot=main_boot)
    f.add("audit.anchors", "fail" if problems else "pass", "; ".join(problems[:5]) or (
        f"{len(anchors)} checkpoint(s) anchored by quotes of this TD" if anchors else "no checkpoint to anchor"))


def _td_fields(q: Quote | None) -> dict[str, bytes]:
    return {k: getattr(q.td, k) for k in SAME_TD} if q is not None and q.td is not None else {}


# (quote bytes, event log text, expected report_data) -> (names of its failed quote checks, TD report fields, boot
# event values)
QuoteCheck = Callable[[bytes, str, bytes], tuple[set[str], dict[str, bytes], dict[str, str | None]]]


def anchor_problems(anchors: list[Anchor], entries: list[AuditEntry], check: QuoteCheck, *,
                    main_failed: set[str], main_td: dict[str, bytes], main_boot: dict[str, str | None]) -> list[str]:
    """Why the anchors do not anchor this slice (empty list: they do).

    Every anchor names an entry of the slice of an anchored type by its seq and hash; seqs increase; every
    ``checkpoint`` entry of the slice has one; each quote fails no quote step the bundle's own quote passes (its
    report_data is the anchor's), comes from the same TD (:data:`SAME_TD`) and names the same app and deployment in
    its boot events (:data:`SAME_BOOT`).
    """
    problems: list[str] = []
    by_seq = {e.seq: e for e in entries}
    seqs = [a.seq for a in anchors]
    if seqs != sorted(set(seqs)):
        problems.append("anchors are not in increasing seq order, or one entry has two")
    for a in anchors:
        e = by_seq.get(a.seq)
        if e is None or e.hash != a.head:
            problems.append(f"anchor seq {a.seq}: no entry of the slice has that seq and hash")
            continue
        if e.type not in ANCHORED_TYPES:
            problems.append(f"anchor seq {a.seq}: a {e.type} entry is not anchored")
            continue
        failed, td, boot = check(a.quote, a.event_log, report_data(a.seq, a.head))
        if extra := sorted(failed - main_failed):
            problems.append(f"anchor seq {a.seq}: its quote fails {', '.join(extra)}")
        if differ := [k for k in SAME_TD if td.get(k) != main_td.get(k)]:
            problems.append(f"anchor seq {a.seq}: its quote is of another TD ({', '.join(differ)} differ)")
        if differ := [k for k in SAME_BOOT if boot.get(k) != main_boot.get(k)]:
            problems.append(f"anchor seq {a.seq}: its boot events name another deployment ({', '.join(differ)} differ)")
    anchored = {a.seq for a in anchors}
    for e in entries:
        if e.type == "checkpoint" and e.seq not in anchored:
            problems.append(f"checkpoint entry seq {e.seq} has no anchor")
    return problems
