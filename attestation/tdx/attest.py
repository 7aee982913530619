"""dstack's ``Attest`` answer: ``{"attestation": hex(VersionedAttestation)}``, in both encodings, read with bounds.

``shared/reference/dstack-0.6.md`` §2.4 (``dstack-attest/src/attestation.rs``, ``v1.rs``). The first byte selects:

* ``0x00``: legacy **SCALE V0**: ``00`` ‖ platform (``00`` TDX) ‖ ``Vec quote`` ‖ ``Vec<TdxEvent>`` (``u32le imr`` ‖
  ``u32le event_type`` ‖ ``Vec digest`` ‖ ``String event`` ‖ ``Vec payload``) ‖ ``Vec<RuntimeEvent>`` (``String`` ‖
  ``Vec``) ‖ ``[u8; 64] report_data`` ‖ ``String config``; Vec/String = SCALE compact length + bytes;
* a MessagePack map (``0x80..0x8f``, ``0xde``, ``0xdf``): **V1** ``{version: 1, platform: {kind, data}, stack: {kind,
  data}}``, nothing after it.

Only the ``tdx`` platform is accepted (cvm-tune attests Intel TDX CVMs); every other kind, known to dstack or not, is
refused by name. Every length is checked against what is left of the input and against a fixed limit before anything
is allocated, MessagePack extension types (and ``0xc1``) are refused, and nothing is trusted from the answer that the
quote does not sign: the verifier replays the event log against the quote's RTMRs and compares the answer's
``report_data`` and runtime events with them. Stdlib, plus ``msgpack`` imported only to read a V1 answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from attestation.errors import AttestationError
from attestation.tdx.eventlog import MAX_EVENTS, Event, parse_event_log

MAX_ATTESTATION_BYTES = 2 << 20  # decoded VersionedAttestation (the sample: 12,129 bytes)
MAX_QUOTE = 64 << 10
MAX_ITEM = 1 << 20  # one event payload, one string
MAX_ARRAY = MAX_QUOTE  # the quote is the longest array (of ints): 5,006 in the sample
MAX_MAP = 32
PLATFORM_KINDS = ("tdx", "gcp-tdx", "nitro-enclave", "aws-nitro-tpm", "sev-snp")  # dstack's; only tdx is read
SCALE_PLATFORMS = {0: "tdx", 1: "gcp-tdx", 2: "nitro-enclave", 3: "sev-snp", 4: "aws-nitro-tpm"}


class AttestationFormatError(AttestationError):
    """The ``attestation`` of an Attest answer is not a VersionedAttestation cvm-tune can read."""

    default_fix = "pass the guest agent's Attest answer exactly as it was returned ({\"attestation\": \"<hex>\"})"


@dataclass(frozen=True)
class VersionedAttestation:
    """A decoded Attest answer (TDX): what the quote signs, and what the verifier checks against it."""

    encoding: str  # "scale-v0" or "msgpack-v1"
    platform: str
    quote: bytes
    events: tuple[Event, ...]
    report_data: bytes  # stack.data.report_data (the quote's must be the same)
    runtime_events: tuple[tuple[str, bytes], ...]  # stack.data.runtime_events (the log's RTMR3 events must be these)
    config: str  # vm_config JSON, as the host declared it (never trusted; it may carry the MrConfigV3 document)

    @property
    def mr_config(self) -> bytes | None:
        """The MrConfigV3 document the host put in ``vm_config`` (``mr_config``), as its exact UTF-8 bytes, or None."""
        try:
            doc = json.loads(self.config)
        except (ValueError, RecursionError):
            return None
        value = doc.get("mr_config") if isinstance(doc, dict) else None
        return value.encode() if isinstance(value, str) and value else None


def decode_attestation(data: bytes) -> VersionedAttestation:
    """A VersionedAttestation's bytes (SCALE V0 or MessagePack V1), decoded and checked for shape.

    Raises:
        AttestationFormatError: empty, too large, truncated, trailing bytes, an unknown encoding, MessagePack type or
            platform kind, or a member of the wrong type or size.
    """
    if not data:
        raise AttestationFormatError("attestation is empty")
    if len(data) > MAX_ATTESTATION_BYTES:
        raise AttestationFormatError(f"attestation is {len(data)} bytes (limit {MAX_ATTESTATION_BYTES})")
    first = data[0]
    if first == 0x00:
        return _Scale(data).attestation()
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        return _from_msgpack(data)
    raise AttestationFormatError(f"attestation starts with byte 0x{first:02x}: neither SCALE V0 (0x00) nor a "
                                 "MessagePack V1 map")


class _Scale:
    """A bounded SCALE reader: every length is checked against the bytes left before it is used."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int, what: str) -> bytes:
        if n > len(self.data) - self.pos:
            raise AttestationFormatError(f"SCALE V0 attestation truncated in {what} (needs {n} bytes, "
                                         f"{len(self.data) - self.pos} left)")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def u32(self, what: str) -> int:
        return int.from_bytes(self.take(4, what), "little")

    def compact(self, what: str, limit: int) -> int:
        b = self.u8(what)
        mode = b & 3
        if mode == 0:
            n = b >> 2
        elif mode == 1:
            n = int.from_bytes(bytes([b]) + self.take(1, what), "little") >> 2
        elif mode == 2:
            n = int.from_bytes(bytes([b]) + self.take(3, what), "little") >> 2
        else:
            raise AttestationFormatError(f"SCALE V0 {what}: a length of more than 2^30 (big-integer compact form)")
        if n > limit:
            raise AttestationFormatError(f"SCALE V0 {what}: length {n} is over the limit {limit}")
        return n

    def vec(self, what: str, limit: int = MAX_ITEM) -> bytes:
        return self.take(self.compact(what, limit), what)

    def string(self, what: str) -> str:
        try:
            return self.vec(what).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise AttestationFormatError(f"SCALE V0 {what} is not UTF-8") from exc

    def attestation(self) -> VersionedAttestation:
        self.u8("version")
        kind = self.u8("platform")
        if kind != 0:
            name = SCALE_PLATFORMS.get(kind)
            raise AttestationFormatError(f"SCALE V0 platform {kind} ({name or 'unknown to dstack'}): cvm-tune reads "
                                         "Intel TDX (platform 0) only")
        quote = self.vec("quote", MAX_QUOTE)
        n = self.compact("event log", MAX_EVENTS)
        events = []
        for i in range(n):
            imr, etype = self.u32(f"event {i} imr"), self.u32(f"event {i} event_type")
            digest, name, payload = self.vec(f"event {i} digest", 48), self.string(f"event {i} name"), self.vec(f"event {i} payload")
            events.append({"imr": imr, "event_type": etype, "digest": digest.hex(), "event": name,
                           "event_payload": payload.hex()})
        n = self.compact("runtime events", MAX_EVENTS)
        runtime = tuple((self.string(f"runtime event {i} name"), self.vec(f"runtime event {i} payload")) for i in range(n))
        report_data = self.take(64, "report_data")
        config = self.string("config")
        if self.pos != len(self.data):
            raise AttestationFormatError(f"SCALE V0 attestation has {len(self.data) - self.pos} bytes after its end")
        return VersionedAttestation("scale-v0", "tdx", quote, _events(events), report_data, runtime, config)


def _from_msgpack(data: bytes) -> VersionedAttestation:
    try:
        import msgpack  # only a V1 answer needs it (pyproject dependencies; requirements/verify.lock)
    except ImportError as exc:  # an input error of this installation, not a rejection of the answer
        raise AttestationError("reading a MessagePack V1 Attest answer needs the msgpack package, which this "
                               "environment lacks", fix="install the verifier's lock: sh requirements/install.sh VENV "
                               "requirements/verify.lock") from exc

    def refuse_ext(code: int, _data: bytes) -> Any:
        raise ValueError(f"MessagePack extension type {code} is not part of a VersionedAttestation")

    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=refuse_ext, use_list=True,
                              max_str_len=MAX_ITEM, max_bin_len=MAX_ITEM, max_array_len=MAX_ARRAY, max_map_len=MAX_MAP,
                              max_ext_len=MAX_ITEM)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # truncated, trailing bytes, 0xc1, limits, ext
        raise AttestationFormatError(f"MessagePack V1 attestation does not decode: {type(exc).__name__}: "
                                     f"{str(exc)[:200] or 'truncated'}") from None
    _only_basic_types(obj)
    top = _map(obj, "attestation", ("version", "platform", "stack"))
    if top["version"] != 1 or isinstance(top["version"], bool):
        raise AttestationFormatError(f"MessagePack attestation version {top['version']!r:.40} is not 1")
    platform = _map(top["platform"], "platform", ("kind", "data"))
    kind = platform["kind"]
    if kind != "tdx":
        known = "a dstack platform" if kind in PLATFORM_KINDS else "unknown to dstack"
        raise AttestationFormatError(f"platform kind {kind!r:.60} ({known}): cvm-tune reads Intel TDX (tdx) only")
    pdata = _map(platform["data"], "platform.data", ("quote", "event_log"))
    stack = _map(top["stack"], "stack", ("kind", "data"))
    if stack["kind"] not in ("dstack", "dstack-pod"):
        raise AttestationFormatError(f"stack kind {stack['kind']!r:.60} is not dstack or dstack-pod")
    sdata = _map(stack["data"], "stack.data", ("report_data", "runtime_events", "config"))
    quote = _int_bytes(pdata["quote"], "platform.data.quote", MAX_QUOTE)
    log = pdata["event_log"]
    if not isinstance(log, list) or len(log) > MAX_EVENTS:
        raise AttestationFormatError("platform.data.event_log is not a list of at most 10000 events")
    events = [_v1_event(i, e) for i, e in enumerate(log)]
    report_data = _int_bytes(sdata["report_data"], "stack.data.report_data", 64)
    if len(report_data) != 64:
        raise AttestationFormatError(f"stack.data.report_data is {len(report_data)} bytes, not 64")
    rt = sdata["runtime_events"]
    if not isinstance(rt, list):
        raise AttestationFormatError("stack.data.runtime_events is not a list")
    runtime = []
    for i, r in enumerate(rt):
        r = _map(r, f"runtime event {i}", ("event", "payload"))
        if not isinstance(r["event"], str) or not isinstance(r["payload"], bytes):
            raise AttestationFormatError(f"runtime event {i}: event must be a string and payload bin")
        runtime.append((r["event"], r["payload"]))
    if not isinstance(sdata["config"], str):
        raise AttestationFormatError("stack.data.config is not a string")
    return VersionedAttestation("msgpack-v1", "tdx", quote, _events(events), report_data, tuple(runtime), sdata["config"])


def _only_basic_types(obj: Any) -> None:
    """Refuse what ``ext_hook`` never sees: msgpack decodes the timestamp extension (-1) itself."""
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif not isinstance(v, (str, bytes, int, float, type(None))):
            raise AttestationFormatError(f"MessagePack extension type -1 ({type(v).__name__}) is not part of a "
                                         "VersionedAttestation")


def _map(obj: Any, what: str, required: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise AttestationFormatError(f"{what} is not a MessagePack map")
    if missing := [k for k in required if k not in obj]:
        raise AttestationFormatError(f"{what} lacks {', '.join(missing)}")
    return obj


def _int_bytes(value: Any, what: str, limit: int) -> bytes:
    """A Rust ``Vec<u8>`` serialised without a serde attribute: an array of ints 0..255 (``bin`` is accepted too)."""
    if isinstance(value, bytes):
        out = value
    elif isinstance(value, list) and all(type(x) is int and 0 <= x <= 255 for x in value):
        out = bytes(value)
    else:
        raise AttestationFormatError(f"{what} is not an array of bytes")
    if len(out) > limit:
        raise AttestationFormatError(f"{what} is {len(out)} bytes (limit {limit})")
    return out


def _v1_event(i: int, e: Any) -> dict[str, Any]:
    e = _map(e, f"event {i}", ("imr", "event_type", "digest", "event", "event_payload"))
    if not isinstance(e["digest"], bytes) or not isinstance(e["event_payload"], bytes):
        raise AttestationFormatError(f"event {i}: digest and event_payload must be MessagePack bin")
    out = {"imr": e["imr"], "event_type": e["event_type"], "digest": e["digest"].hex(), "event": e["event"],
           "event_payload": e["event_payload"].hex()}
    for k in ("version", "preimage"):
        if k in e:
            out[k] = e[k]
    return out


def _events(events: list[dict[str, Any]]) -> tuple[Event, ...]:
    try:
        return parse_event_log(events)
    except AttestationError as exc:
        raise AttestationFormatError(f"event log: {exc.message}") from None


def answer_attestation(obj: dict[str, Any], source: str) -> VersionedAttestation:
    """The VersionedAttestation of an Attest answer already parsed as JSON (``{"attestation": hex, ...}``).

    Raises:
        AttestationFormatError: ``attestation`` is not hex, or not a VersionedAttestation.
    """
    text = obj.get("attestation")
    if not isinstance(text, str):
        raise AttestationFormatError(f"{source}: \"attestation\" is not a hex string")
    text = text.strip().removeprefix("0x")
    if len(text) > 2 * MAX_ATTESTATION_BYTES:
        raise AttestationFormatError(f"{source}: attestation is over {MAX_ATTESTATION_BYTES} bytes")
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise AttestationFormatError(f"{source}: \"attestation\" is not hex (odd length or a non-hex digit)") from None
    return decode_attestation(raw)
