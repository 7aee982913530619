"""What a dstack 0.6 guest agent computes, as pure functions (``shared/reference/dstack-0.6.md`` §2-§5).

* the v1 key derivation (``GetKey`` on ``/v1/``: its own HKDF salt and length-prefixed info, ``public_key``, and the
  link-0 claim the app root key signs), §2.2;
* V2 runtime-event digests and their canonical-JSON ``preimage``, §3.2;
* ``VersionedAttestation`` in both encodings: legacy SCALE V0 and MessagePack V1 (``msgpack`` is imported lazily:
  only ``Attest`` needs it), §2.4;
* MRCONFIGID v3 from an MrConfigV3 document, §5;
* a simulated GPU: the ``gpu-attestation`` boot event and the evidence ``Attest`` / ``AttestGpu`` serve, §4;
* the simulator's key epochs: how a KMS root epoch and an app epoch change the app root key. dstack does not
  publish the KMS's per-epoch derivation; the simulator's is its own (below) and only its *effect* is faithful:
  epoch (0, 0) gives the app root key of the 0.5 simulator, every other epoch a different one.

Nothing here is secret or talks to anything; the agent (``agent.py``) serves these values.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from eth_keys import keys as eth_keys
from eth_utils import ValidationError as EthValidationError
from eth_utils import keccak

from attestation.tdx.gpu_dstack import PROVIDER

RUNTIME_EVENT_TYPE = 0x08000001
V1_SALT = b"dstack-guest-v1"
V1_KEY_LABEL = b"dstack-guest-v1-key"
V1_CLAIM_LABEL = b"dstack-guest-v1-key-claim"
V1_ALGORITHMS = ("secp256k1", "ed25519")
MR_CONFIG_V3_PREFIX = b"dstack-mr-config-v3:\x00"
EMPTY_GPU_POLICY_HASH = hashlib.sha256(b"{}").digest()  # SHA-256(JCS({})): no requirements.gpu_policy
EMIT_EVENT_REMOVED = ("EmitEvent was removed in dstack 0.6.0; runtime RTMR3 events are system-owned and cannot be "
                      "extended by apps")


class KeyDerivationError(ValueError):
    """The derived bytes are not a valid key for the algorithm (probability ~2^-128: pick another domain)."""


# ---------------------------------------------------------------------------------------------------- keys
def lp(data: bytes) -> bytes:
    """``u32be(len(data)) || data``, the v1 KDF's length prefix."""
    return struct.pack(">I", len(data)) + data


def v1_key(app_root: bytes, algorithm: str, domain: bytes) -> tuple[bytes, bytes]:
    """v1 ``GetKey``: ``(key, public_key)``; secp256k1 public keys are SEC1 compressed, ed25519 raw.

    Raises:
        KeyDerivationError: a secp256k1 scalar of 0 or >= n.
        ValueError: an algorithm other than ``secp256k1`` / ``ed25519``.
    """
    if algorithm not in V1_ALGORITHMS:
        raise ValueError(f"unsupported algorithm {algorithm!r}: expected secp256k1 or ed25519")
    info = lp(V1_KEY_LABEL) + lp(algorithm.encode()) + lp(domain)
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=V1_SALT, info=info).derive(app_root)
    if algorithm == "ed25519":
        return key, ed25519.Ed25519PrivateKey.from_private_bytes(key).public_key().public_bytes_raw()
    try:
        return key, eth_keys.PrivateKey(key).public_key.to_compressed_bytes()
    except EthValidationError as exc:
        raise KeyDerivationError("derived secp256k1 scalar is out of range") from exc


def v1_claim(algorithm: str, domain: bytes, public_key: bytes) -> bytes:
    """The 32-byte hash the app root key signs as link 0 of a v1 ``GetKey`` chain."""
    return keccak(lp(V1_CLAIM_LABEL) + lp(algorithm.encode()) + lp(domain) + lp(public_key))


def epoch_app_root(kms_root: bytes, app_id: bytes, app_epoch: int) -> bytes:
    """The simulator's app root k256 key for an app epoch under one KMS root key.

    App epoch 0 is the pre-epoch derivation (``HKDF("RATLS", kms_root, app_id || "app-key")``, issue #1287), so a
    0.5 and a 0.6 simulator at epoch (0, 0) hand out the same keys, as a real upgrade does.
    """
    info = app_id + b"app-key" + (b"" if app_epoch == 0 else b":epoch:" + str(app_epoch).encode())
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"RATLS", info=info).derive(kms_root)


# ---------------------------------------------------------------------------------------------------- RTMR3
def v2_preimage(name: str, payload: bytes) -> bytes:
    """The canonical JSON a V2 runtime event's digest is over (key order name, payload, type)."""
    doc = {"name": name, "payload": payload.hex(), "type": RUNTIME_EVENT_TYPE}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def runtime_digest(name: str, payload: bytes, version: int = 1) -> bytes:
    """RTMR3 event digest: V1 ``sha384(u32le(type) ":" name ":" payload)``, V2 ``sha384(preimage)``."""
    if version == 2:
        return hashlib.sha384(v2_preimage(name, payload)).digest()
    return hashlib.sha384(RUNTIME_EVENT_TYPE.to_bytes(4, "little") + b":" + name.encode() + b":" + payload).digest()


def jcs(value: Any) -> bytes:
    """Canonical JSON (RFC 8785 for the strings, integers and objects used here)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def mr_config_v3(document: dict[str, Any]) -> tuple[str, bytes]:
    """``(MrConfigV3 document text, 48-byte MRCONFIGID)``: ``03 || SHA-256(prefix || 00 || doc) || 0 x 15``."""
    text = jcs(document)
    return text.decode(), b"\x03" + hashlib.sha256(MR_CONFIG_V3_PREFIX + text).digest() + bytes(15)


# ---------------------------------------------------------------------------------------------------- Attest
def _compact(n: int) -> bytes:
    if n < 1 << 6:
        return bytes([n << 2])
    if n < 1 << 14:
        return struct.pack("<H", n << 2 | 1)
    if n < 1 << 30:
        return struct.pack("<I", n << 2 | 2)
    raise ValueError("SCALE length over 2^30")


def _vec(data: bytes) -> bytes:
    return _compact(len(data)) + data


def encode_v0(quote: bytes, events: list[dict], report_data: bytes, config: str) -> bytes:
    """Legacy SCALE ``VersionedAttestation`` V0 (TDX). ``events`` is the full log (hex fields, as in GetQuote);
    ``version``/``preimage`` cannot be encoded (the reason V2 logs switch to V1)."""
    out = bytearray(b"\x00\x00") + _vec(quote) + _compact(len(events))
    for ev in events:
        out += struct.pack("<II", ev["imr"], ev["event_type"]) + _vec(bytes.fromhex(ev["digest"]))
        out += _vec(ev["event"].encode()) + _vec(bytes.fromhex(ev["event_payload"]))
    runtime = [ev for ev in events if ev["imr"] == 3]
    out += _compact(len(runtime))
    for ev in runtime:
        out += _vec(ev["event"].encode()) + _vec(bytes.fromhex(ev["event_payload"]))
    return bytes(out + report_data.ljust(64, b"\0") + _vec(config.encode()))


def encode_v1(quote: bytes, events: list[dict], report_data: bytes, config: str) -> bytes:
    """MessagePack ``VersionedAttestation`` V1 (``rmp_serde::to_vec_named``): ``quote`` and ``report_data`` are
    arrays of ints, digests and payloads ``bin``; V2 events keep ``version`` and ``preimage``."""
    import msgpack  # lazily: only Attest needs it (requirements: msgpack)

    log, runtime = [], []
    for ev in events:
        item: dict[str, Any] = {"imr": ev["imr"], "event_type": ev["event_type"], "digest": bytes.fromhex(ev["digest"]),
                                "event": ev["event"], "event_payload": bytes.fromhex(ev["event_payload"])}
        if ev.get("version") == 2:
            item["version"] = 2
            item["preimage"] = ev["preimage"]
        log.append(item)
        if ev["imr"] == 3:
            entry: dict[str, Any] = {"event": ev["event"], "payload": bytes.fromhex(ev["event_payload"])}
            if ev.get("version") == 2:
                entry["version"] = 2
            runtime.append(entry)
    doc = {"version": 1,
           "platform": {"kind": "tdx", "data": {"quote": list(quote), "event_log": log}},
           "stack": {"kind": "dstack", "data": {"report_data": list(report_data.ljust(64, b"\0")),
                                                "runtime_events": runtime, "config": config}}}
    return bytes(msgpack.packb(doc, use_bin_type=True))


def app_epoch_payload(root_epoch: int, app_epoch: int) -> bytes:
    """The simulator's ``app-epoch`` event payload. dstack 0.6.7 measures the app key epoch but the sources read do
    not publish the payload format (dstack-0.6.md §3.1); the simulator writes ``{"app_epoch":N,"root_epoch":N}``."""
    return jcs({"app_epoch": app_epoch, "root_epoch": root_epoch})


def vm_config_with(vm_config: str, mr_config: str | None, gpus: int = 0) -> str:
    """``vm_config`` carrying the MrConfigV3 document (where hosts before the top-level ``mr_config`` put it) and
    the number of GPUs attached (``vm_config`` unchanged when there is neither)."""
    if mr_config is None and not gpus:
        return vm_config
    doc = {**json.loads(vm_config), "num_gpus": gpus}
    return json.dumps(doc if mr_config is None else {**doc, "mr_config": mr_config}, separators=(",", ":"))


# ---------------------------------------------------------------------------------------------------- GPU


def gpu_attestation_payload(evidence: bytes, devices: int = 1) -> bytes:
    """The ``gpu-attestation`` RTMR3 event dstack's boot gate measures (compact JSON, dstack's field order, §4)."""
    doc = {"version": 2, "provider": PROVIDER, "devices": devices, "cc_mode": "on", "devtools": False,
           "evidence_sha256": hashlib.sha256(evidence).hexdigest()}
    return json.dumps(doc, separators=(",", ":")).encode()


def collect_evidence(nonce: bytes) -> bytes:
    """A stand-in for ``nvattest collect-evidence`` (the shape of §4, one H100 with the boot sample's driver and
    VBIOS): ``evidence`` and ``certificate`` are labelled TEST bytes, not an NVIDIA report; only ``nonce`` is real."""
    label = base64.b64encode(b"cvm-tune simulator TEST: not an NVIDIA attestation report").decode()
    return json.dumps({"evidences": [{"version": "1.0", "arch": "HOPPER", "nonce": nonce.hex(),
                                      "vbios_version": "96.00.D9.00.01", "driver_version": "580.159.03",
                                      "evidence": label, "certificate": label}],
                       "result_code": 0, "result_message": "Ok"}, separators=(",", ":")).encode()
