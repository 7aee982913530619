"""dstack event log: parse, recompute runtime-event digests, replay RTMR0-3, read boot events.

Rules (``shared/reference/dstack.md`` §3, §6; ``threats-and-faults.md`` V9/V10):

* RTMR0-2 events come from the CCEL; their ``digest`` is the only thing replayable (payloads are
  stripped by OS >= 0.5.6).
* RTMR3 runtime events (``event_type == 0x08000001``) are **never trusted by their digest field**:
  the digest is recomputed from ``event`` and ``event_payload`` (v1:
  ``sha384(u32le(type) || ":" || name || ":" || payload)``; v2: sha384 of the JCS pre-image). A
  non-empty digest field that disagrees is a tampered log. dstack >= 0.5.6 leaves it empty.
* ``app-id``, ``compose-hash``, ``instance-id`` and ``key-provider`` count only before
  ``system-ready``, exactly once; a trusted name after the boundary is a privileged append.
* Names come from two allow-lists (the policy's): dstack's boot events before ``system-ready``, the
  app's events after it; a name containing ``:`` is always rejected (threats case 60: the v1 digest
  of ``("a:b", "c")`` equals that of ``("a", "b:c")``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from attestation.errors import EventLogError

# The runtime events a cvm-tune CVM emits into RTMR3: its audit chain's entry types (attestation.bundle.audit), each
# measured under this prefix. The default policy allows exactly these.
EVENT_PREFIX = "cvm-tune."
ENTRY_TYPES = ("run.start", "run.resume", "gpu.evidence", "train.batch", "train.done", "export",
               "checkpoint", "checkpoint.rejected", "run.abort",  # these three: metadata only
               "privacy.spent",  # DP-SGD: the manifest's privacy block (parameters and (epsilon, delta) spent)
               "promote")  # continual retraining: exports/PROMOTED moved to this run's bundle (after its export entry)

RUNTIME_EVENT_TYPE = 0x08000001
BOOT_TRUSTED_NAMES = ("app-id", "compose-hash", "instance-id", "key-provider")
SYSTEM_READY = "system-ready"
MAX_EVENTS = 10_000
_ZERO48 = bytes(48)


@dataclass(frozen=True)
class Event:
    """One event-log entry, decoded."""

    index: int
    imr: int
    event_type: int
    digest: bytes  # b"" when the agent stripped it
    event: str
    payload: bytes
    version: int = 1

    @property
    def is_runtime(self) -> bool:
        """True for dstack runtime (RTMR3) events."""
        return self.event_type == RUNTIME_EVENT_TYPE


def runtime_digest(name: str, payload: bytes, version: int = 1) -> bytes:
    """The RTMR3 extend value of a runtime event, recomputed from name and payload."""
    if version == 2:
        pre = json.dumps(
            {"name": name, "payload": payload.hex(), "type": RUNTIME_EVENT_TYPE},
            separators=(",", ":"),
            sort_keys=True,
            ensure_ascii=False,
        ).encode()
        return hashlib.sha384(pre).digest()
    return hashlib.sha384(RUNTIME_EVENT_TYPE.to_bytes(4, "little") + b":" + name.encode() + b":" + payload).digest()


def parse_event_log(data: str | bytes | list[Any]) -> tuple[Event, ...]:
    """Decode an event log given as JSON text (GetQuote's ``event_log`` string) or a parsed list.

    Raises:
        EventLogError: not a JSON list of well-formed events.
    """
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise EventLogError(f"event log is not valid JSON: {exc}") from exc
    if not isinstance(data, list):
        raise EventLogError("event log must be a JSON list of events")
    if len(data) > MAX_EVENTS:
        raise EventLogError(f"event log has {len(data)} events (limit {MAX_EVENTS})")
    return tuple(_parse_event(i, e) for i, e in enumerate(data))


def _parse_event(i: int, e: Any) -> Event:
    if not isinstance(e, dict):
        raise EventLogError(f"event {i} is not an object")
    try:
        imr, etype, digest, name, payload = e["imr"], e["event_type"], e["digest"], e["event"], e["event_payload"]
    except KeyError as exc:
        raise EventLogError(f"event {i} lacks field {exc.args[0]!r}") from exc
    version = e.get("version", 1)
    if not (isinstance(imr, int) and 0 <= imr <= 3):
        raise EventLogError(f"event {i}: imr must be 0..3")
    if not isinstance(etype, int) or isinstance(etype, bool) or not 0 <= etype < 2**32:
        raise EventLogError(f"event {i}: event_type must be a u32")
    if not all(isinstance(x, str) for x in (digest, name, payload)) or version not in (1, 2):
        raise EventLogError(f"event {i}: digest/event/event_payload must be strings, version 1 or 2")
    try:
        digest_b, payload_b = bytes.fromhex(digest), bytes.fromhex(payload)
    except ValueError as exc:
        raise EventLogError(f"event {i}: digest/event_payload are not hex") from exc
    if digest_b and len(digest_b) != 48:
        raise EventLogError(f"event {i}: digest is {len(digest_b)} bytes, expected 48 (SHA-384)")
    return Event(i, imr, etype, digest_b, name, payload_b, version)


@dataclass(frozen=True)
class Replay:
    """Result of replaying a log: the four RTMRs and every inconsistency found on the way."""

    rtmrs: tuple[bytes, bytes, bytes, bytes]
    problems: tuple[str, ...]


def replay(events: tuple[Event, ...]) -> Replay:
    """Fold every event into its RTMR, recomputing runtime-event digests."""
    mrs = [_ZERO48] * 4
    problems: list[str] = []
    for ev in events:
        if ev.is_runtime:
            digest = runtime_digest(ev.event, ev.payload, ev.version)
            if ev.digest and ev.digest != digest:
                problems.append(f"event {ev.index} ({ev.event!r}): digest field does not match its payload")
        elif ev.digest:
            digest = ev.digest
        else:
            problems.append(f"event {ev.index} (imr {ev.imr}): boot event without a digest")
            continue
        mrs[ev.imr] = hashlib.sha384(mrs[ev.imr] + digest).digest()
    return Replay((mrs[0], mrs[1], mrs[2], mrs[3]), tuple(problems))


@dataclass(frozen=True)
class BootInfo:
    """What dstack measured at boot, and the app events that followed ``system-ready``."""

    values: dict[str, bytes]  # trusted boot events found before system-ready
    system_ready: bool
    app_events: tuple[Event, ...]  # runtime events after system-ready, in order
    problems: tuple[str, ...]

    def hex(self, name: str) -> str | None:
        """Hex payload of a trusted boot event, or None."""
        value = self.values.get(name)
        return value.hex() if value is not None else None


def boot_info(events: tuple[Event, ...]) -> BootInfo:
    """Split RTMR3 at ``system-ready`` and apply the boundary rules (V10)."""
    values: dict[str, bytes] = {}
    problems: list[str] = []
    app: list[Event] = []
    ready = False
    for ev in (e for e in events if e.imr == 3):
        if not ev.is_runtime:
            problems.append(f"event {ev.index}: RTMR3 event of type 0x{ev.event_type:08x} is not a dstack runtime event")
            continue
        if not ready:
            if ev.event in values and ev.event in BOOT_TRUSTED_NAMES:
                problems.append(f"event {ev.index}: second {ev.event!r} before system-ready")
            if ev.event in BOOT_TRUSTED_NAMES:
                values.setdefault(ev.event, ev.payload)
            if ev.event == SYSTEM_READY:
                ready = True
            continue
        if ev.event in BOOT_TRUSTED_NAMES or ev.event == SYSTEM_READY:
            problems.append(f"event {ev.index}: {ev.event!r} after system-ready (privileged append)")
        app.append(ev)
    if not ready:
        problems.append("no system-ready event: the boot measurements are incomplete")
    return BootInfo(values, ready, tuple(app), tuple(problems))


def name_problems(events: tuple[Event, ...], *, boot_names: tuple[str, ...], app_names: tuple[str, ...]) -> list[str]:
    """RTMR3 runtime-event names against the allow-lists: ``boot_names`` up to and including the
    first ``system-ready``, ``app_names`` after it; a ``:`` in any name is rejected outright."""
    problems: list[str] = []
    ready = False
    for ev in events:
        if ev.imr != 3 or not ev.is_runtime:
            continue
        shown = repr(ev.event[:80])
        if ":" in ev.event:
            problems.append(f"event {ev.index}: name {shown} contains ':' (v1 digests of such names can collide)")
        elif ev.event not in (app_names if ready else boot_names):
            where = "after system-ready (app events)" if ready else "before system-ready (dstack boot events)"
            problems.append(f"event {ev.index}: {shown} is not an allowed event name {where}")
        ready = ready or ev.event == SYSTEM_READY
    return problems
