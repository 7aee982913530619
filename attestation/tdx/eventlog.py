"""dstack event log: parse, recompute runtime-event digests, replay RTMR0-3, read boot events.

Rules (``shared/reference/dstack.md`` §3, §6; ``threats-and-faults.md`` V9/V10):

* RTMR0-2 events come from the CCEL; their ``digest`` is the only thing replayable (payloads are
  stripped by OS >= 0.5.6).
* RTMR3 runtime events (``event_type == 0x08000001``) are **never trusted by their digest field**:
  the digest is recomputed from ``event`` and ``event_payload`` (v1:
  ``sha384(u32le(type) || ":" || name || ":" || payload)``; v2: sha384 of the JCS pre-image). A
  non-empty digest field that disagrees is a tampered log. dstack >= 0.5.6 leaves it empty.
* A version 2 runtime event carries ``preimage``: the hex of the canonical JSON its digest is taken over. It must
  be present and equal, byte for byte, the JSON rebuilt from the name and payload (dstack's
  ``validate_v2_preimages``); a preimage is never a reason to accept an event, only a way to reject one.
* dstack's boot events count only before ``system-ready``, in dstack's order (:data:`BOOT_ORDER`), each at most
  once (``init-script-hash`` up to five times); a boot name after the boundary is a privileged append. On a
  dstack 0.6 boot (one that measured ``gpu-policy-hash``, which 0.6 emits on every boot) nothing at all may follow
  ``system-ready``: 0.6 has no EmitEvent, so such an event was extended by privileged code in the CVM.
* Names come from two allow-lists (the policy's): dstack's boot events before ``system-ready``, the
  app's events after it; a name containing ``:`` is always rejected (threats case 60: the v1 digest
  of ``("a:b", "c")`` equals that of ``("a", "b:c")``).
"""

from __future__ import annotations

import hashlib
import json
import re
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
SYSTEM_READY = "system-ready"
# dstack's RTMR3 boot events in the order dstack emits them (0.6: ``dstack-util/src/system_setup.rs``; 0.5.x is the
# same sequence without the GPU and epoch events). Equal ranks may come in either order; only init-script-hash repeats.
BOOT_ORDER = {
    "system-preparing": 1, "app-id": 2, "compose-hash": 3, "init-script-hash": 4, "gpu-policy-hash": 5,
    "gpu-attestation": 6, "instance-id": 7, "boot-mr-done": 8, "mr-kms": 9, "os-image-hash": 9, "key-provider": 10,
    "app-epoch": 11, "storage-fs": 12, SYSTEM_READY: 13,
}
BOOT_TRUSTED_NAMES = tuple(n for n in BOOT_ORDER if n not in ("init-script-hash", SYSTEM_READY))  # each at most once
INIT_SCRIPT = "init-script-hash"
MAX_INIT_SCRIPTS = 5
DSTACK06_MARKER = "gpu-policy-hash"  # emitted on every dstack 0.6 boot, by no 0.5.x release
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
    preimage: str | None = None  # V2 events: hex of the canonical JSON the digest is taken over

    @property
    def is_runtime(self) -> bool:
        """True for dstack runtime (RTMR3) events."""
        return self.event_type == RUNTIME_EVENT_TYPE


_HEX = re.compile(r"(?:[0-9a-fA-F]{2})*")


def v2_preimage(name: str, payload: bytes) -> bytes:
    """The canonical JSON a version 2 runtime event's digest is taken over (keys name, payload, type)."""
    return json.dumps({"name": name, "payload": payload.hex(), "type": RUNTIME_EVENT_TYPE}, separators=(",", ":"),
                      sort_keys=True, ensure_ascii=False).encode()


def runtime_digest(name: str, payload: bytes, version: int = 1) -> bytes:
    """The RTMR3 extend value of a runtime event, recomputed from name and payload."""
    if version == 2:
        return hashlib.sha384(v2_preimage(name, payload)).digest()
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
    if not (isinstance(imr, int) and not isinstance(imr, bool) and 0 <= imr <= 3):
        raise EventLogError(f"event {i}: imr must be 0..3")
    if not isinstance(etype, int) or isinstance(etype, bool) or not 0 <= etype < 2**32:
        raise EventLogError(f"event {i}: event_type must be a u32")
    if (not all(isinstance(x, str) for x in (digest, name, payload)) or not isinstance(version, int)
            or isinstance(version, bool) or version not in (1, 2)):
        raise EventLogError(f"event {i}: digest/event/event_payload must be strings, version 1 or 2")
    if not (_HEX.fullmatch(digest) and _HEX.fullmatch(payload)):  # either case; no prefix, no whitespace
        raise EventLogError(f"event {i}: digest/event_payload are not hex")
    digest_b, payload_b = bytes.fromhex(digest), bytes.fromhex(payload)
    if digest_b and len(digest_b) != 48:
        raise EventLogError(f"event {i}: digest is {len(digest_b)} bytes, expected 48 (SHA-384)")
    preimage = e.get("preimage")
    if preimage is not None and not isinstance(preimage, str):
        raise EventLogError(f"event {i}: preimage must be a hex string")
    return Event(i, imr, etype, digest_b, name, payload_b, version, preimage)


def preimage_problem(ev: Event) -> str | None:
    """Why a version 2 runtime event's ``preimage`` is not the canonical JSON of its name and payload (None: it is;
    version 1 events have none to check)."""
    if ev.version != 2 or not ev.is_runtime:
        return None
    if ev.preimage is None:
        return f"event {ev.index} ({ev.event[:80]!r}): version 2 event without its preimage"
    if not re.fullmatch(r"(?:[0-9a-fA-F]{2})*", ev.preimage):
        return f"event {ev.index} ({ev.event[:80]!r}): preimage is not hex"
    if bytes.fromhex(ev.preimage) != v2_preimage(ev.event, ev.payload):
        return (f"event {ev.index} ({ev.event[:80]!r}): preimage is not the canonical JSON of its name and payload "
                "(a reordered or altered preimage is refused even when its SHA-384 is the digest)")
    return None


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
            if why := preimage_problem(ev):
                problems.append(why)
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

    values: dict[str, bytes]  # once-only boot events found before system-ready
    system_ready: bool
    app_events: tuple[Event, ...]  # runtime events after system-ready, in order
    problems: tuple[str, ...]
    init_scripts: tuple[bytes, ...] = ()  # init-script-hash payloads before system-ready, in order

    def hex(self, name: str) -> str | None:
        """Hex payload of a once-only boot event, or None."""
        value = self.values.get(name)
        return value.hex() if value is not None else None

    @property
    def dstack06(self) -> bool:
        """True when the boot measured ``gpu-policy-hash`` (every dstack 0.6 boot does; no 0.5.x release does)."""
        return DSTACK06_MARKER in self.values


def boot_info(events: tuple[Event, ...]) -> BootInfo:
    """Split RTMR3 at ``system-ready`` and apply the boundary, order and once-only rules (V10; dstack 0.6 §3)."""
    values: dict[str, bytes] = {}
    scripts: list[bytes] = []
    problems: list[str] = []
    app: list[Event] = []
    ready, rank, last = False, 0, ""
    for ev in (e for e in events if e.imr == 3):
        if not ev.is_runtime:
            problems.append(f"event {ev.index}: RTMR3 event of type 0x{ev.event_type:08x} is not a dstack runtime event")
            continue
        if not ready:
            if ev.event in BOOT_TRUSTED_NAMES:
                if ev.event in values:
                    problems.append(f"event {ev.index}: second {ev.event!r} before system-ready")
                values.setdefault(ev.event, ev.payload)
            elif ev.event == INIT_SCRIPT:
                scripts.append(ev.payload)
                if len(scripts) == MAX_INIT_SCRIPTS + 1:
                    problems.append(f"event {ev.index}: more than {MAX_INIT_SCRIPTS} init-script-hash events")
            if ev.event in BOOT_ORDER:
                if BOOT_ORDER[ev.event] < rank:
                    problems.append(f"event {ev.index}: {ev.event!r} after {last!r}: not the order dstack measures "
                                    "its boot events in")
                rank, last = max(rank, BOOT_ORDER[ev.event]), ev.event
            if ev.event == SYSTEM_READY:
                ready = True
            continue
        if ev.event in BOOT_ORDER:
            problems.append(f"event {ev.index}: {ev.event!r} after system-ready (privileged append)")
        app.append(ev)
    if not ready:
        problems.append("no system-ready event: the boot measurements are incomplete")
    if DSTACK06_MARKER in values and app:
        problems.append(f"event {app[0].index}: {app[0].event[:80]!r} after system-ready on a dstack 0.6 boot "
                        f"({len(app)} such event(s)): 0.6 has no EmitEvent, so only privileged code in the CVM "
                        "could have extended RTMR3; nothing after system-ready is trusted")
    return BootInfo(values, ready, tuple(app), tuple(problems), tuple(scripts))


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
