"""MRCONFIGID v3: the MrConfigV3 document dstack 0.6's VMM binds, and its check against the measured boot events.

``dstack-types/src/mr_config.rs`` (``shared/reference/dstack-0.6.md`` §5): the host writes a JSON document (JCS form,
unknown fields rejected)::

    {"version": 3, "app_id"?, "compose_hash", "gpu_policy_hash"?, "key_provider": "none"|"kms"|"local"|"tpm",
     "key_provider_id"?, "instance_id"?, "init_script_hashes"?: [...]}        (byte fields as hex)

and sets ``MRCONFIGID = 03 ‖ SHA-256("dstack-mr-config-v3:" ‖ 00 ‖ document bytes) ‖ 15 zero bytes``. A verifier hashes
the exact bytes it was given (never a re-serialisation), then compares each field with what RTMR3 measured; an absent
optional field asserts nothing, ``init_script_hashes: []`` asserts that no init script ran. Stdlib only.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

V3_DOMAIN = b"dstack-mr-config-v3:\x00"
MAX_DOCUMENT = 64 << 10
V3_FIELDS = ("version", "app_id", "compose_hash", "gpu_policy_hash", "key_provider", "key_provider_id", "instance_id",
             "init_script_hashes")
KEY_PROVIDERS = ("none", "kms", "local", "tpm")
# The key-provider boot event's name -> MrConfigV3's key_provider (the event says local-sgx for local).
EVENT_KEY_PROVIDER = {"none": "none", "local-sgx": "local", "local": "local", "kms": "kms", "tpm": "tpm"}
HEX_FIELDS = {"app_id": "app-id", "compose_hash": "compose-hash", "gpu_policy_hash": "gpu-policy-hash",
              "instance_id": "instance-id"}  # document field -> the boot event that must carry the same bytes


def key_provider_id(event: dict[str, Any]) -> bytes:
    """The bytes of a ``key-provider`` boot event's ``id`` (verifier-spec §3): a string of hex digits (either case,
    an even number) after an optional lowercase ``0x``; absent, ``null`` or ``""``: no bytes.

    Raises:
        ValueError: ``id`` is not a string, or not hex (``0X``, whitespace, an odd number of digits included).
    """
    value = event.get("id")
    if value is None:
        return b""
    if not isinstance(value, str):
        raise ValueError("the key-provider id is not a string")
    digits = value.removeprefix("0x")
    if len(digits) % 2 or not all(c in "0123456789abcdefABCDEF" for c in digits):
        raise ValueError(f"the key-provider id {value[:80]!r} is not hex (an optional 0x, then an even number of digits)")
    return bytes.fromhex(digits)


def mr_config_id_v3(document: bytes) -> str:
    """The TDX MRCONFIGID (hex) of a MrConfigV3 document's exact bytes."""
    return "03" + hashlib.sha256(V3_DOMAIN + document).hexdigest() + "00" * 15


def v3_document(*, compose_hash: str, key_provider: str, app_id: str | None = None, key_provider_id: str | None = None,
                instance_id: str | None = None, gpu_policy_hash: str | None = None,
                init_script_hashes: list[str] | None = None) -> bytes:
    """A MrConfigV3 document as dstack's host writes it (JCS: keys sorted, no whitespace; empty values omitted)."""
    doc: dict[str, Any] = {"version": 3, "compose_hash": compose_hash.lower().removeprefix("0x"), "key_provider": key_provider}
    for k, v in (("app_id", app_id), ("key_provider_id", key_provider_id), ("instance_id", instance_id),
                 ("gpu_policy_hash", gpu_policy_hash)):
        if v:
            doc[k] = v.lower().removeprefix("0x")
    if init_script_hashes is not None:
        doc["init_script_hashes"] = [h.lower() for h in init_script_hashes]
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError("a member appears twice")
        out[k] = v
    return out


def _hex(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{field} is not a hex string")
    text = value.lower()
    if len(text) % 2 or not all(c in "0123456789abcdef" for c in text):
        raise ValueError(f"{field} is not hex")
    return text


def parse_v3(document: bytes) -> dict[str, Any]:
    """The fields of a MrConfigV3 document (hex fields lowercased; absent and null fields left out).

    Raises:
        ValueError: not UTF-8 JSON, a duplicate or unknown member, a version other than 3, or a field of the wrong type.
    """
    if len(document) > MAX_DOCUMENT:
        raise ValueError(f"the document is {len(document)} bytes (limit {MAX_DOCUMENT})")
    try:
        doc = json.loads(document.decode("utf-8"), object_pairs_hook=_unique)
    except RecursionError:
        raise ValueError("the document is nested too deeply") from None
    except UnicodeDecodeError:
        raise ValueError("the document is not UTF-8") from None
    if not isinstance(doc, dict):
        raise ValueError("the document is not a JSON object")
    if unknown := sorted(set(doc) - set(V3_FIELDS)):
        raise ValueError(f"unknown member {unknown[0]!r} (dstack rejects unknown fields; so does this verifier)")
    out = {k: v for k, v in doc.items() if v is not None}
    version = out.get("version", 3)
    if version != 3 or isinstance(version, bool):
        raise ValueError(f"version {version!r:.20} is not 3")
    out["version"] = 3
    if "compose_hash" not in out or "key_provider" not in out:
        raise ValueError("compose_hash and key_provider are required")
    for k in (*HEX_FIELDS, "key_provider_id"):
        if k in out:
            out[k] = _hex(out[k], k)
    if out["key_provider"] not in KEY_PROVIDERS:
        raise ValueError(f"key_provider {out['key_provider']!r:.40} is not one of {', '.join(KEY_PROVIDERS)}")
    if "init_script_hashes" in out:
        scripts = out["init_script_hashes"]
        if not isinstance(scripts, list) or len(scripts) > 5:
            raise ValueError("init_script_hashes is not a list of at most 5 hashes")
        out["init_script_hashes"] = [_hex(h, "init_script_hashes") for h in scripts]
    return out


def check_v3(config_id: bytes, compose_hash_hex: str, measured: dict[str, bytes], init_scripts: tuple[bytes, ...] | None,
             document: bytes | None) -> tuple[bool, str]:
    """(ok, what was checked) for a v3 MRCONFIGID: the document hashes to it and every field it asserts was measured.

    ``measured``: the once-only boot events (name -> payload); ``init_scripts``: the ``init-script-hash`` payloads in
    order (None: not known, which fails a document that pins them).
    """
    if document is None:
        return False, ("MRCONFIGID v3 binds a MrConfigV3 document and none was given (a bundle carries it as "
                       "mr-config.json; verify-quote reads --mr-config or the Attest answer's vm_config mr_config)")
    if mr_config_id_v3(document) != config_id.hex():
        return False, "MRCONFIGID v3 is not SHA-256(\"dstack-mr-config-v3:\" ‖ 00 ‖ the given MrConfigV3 document)"
    try:
        doc = parse_v3(document)
    except ValueError as exc:
        return False, f"MRCONFIGID v3: the MrConfigV3 document is not one dstack writes: {exc}"
    problems = []
    if doc["compose_hash"] != compose_hash_hex:
        problems.append("compose_hash is not the compose-hash")
    for field, event in HEX_FIELDS.items():
        if field in doc and field != "compose_hash" and (event not in measured or measured[event].hex() != doc[field]):
            problems.append(f"{field} is not the measured {event}" + ("" if event in measured else " (absent)"))
    try:
        kp = json.loads(measured["key-provider"])
        kind = EVENT_KEY_PROVIDER.get(kp["name"])
    except (KeyError, ValueError, TypeError, AttributeError, RecursionError):
        kind = None
    try:
        kp_id: str | None = key_provider_id(kp).hex() if kind is not None else None
    except ValueError:
        kp_id = None  # not hex: equals no document's key_provider_id
    if kind is None:
        problems.append("the key-provider boot event is absent or not {\"name\": …, \"id\": …} with a known name")
    elif kind != doc["key_provider"]:
        problems.append(f"key_provider {doc['key_provider']} is not the measured key provider {kind}")
    elif "key_provider_id" in doc and doc["key_provider_id"] != kp_id:
        problems.append("key_provider_id is not the measured key provider id")
    if "init_script_hashes" in doc:
        got = None if init_scripts is None else [s.hex() for s in init_scripts]
        if got != doc["init_script_hashes"]:
            problems.append(f"init_script_hashes {len(doc['init_script_hashes'])} pinned, "
                            f"{'unknown' if got is None else len(got)} measured (or in another order)")
    if problems:
        return False, "MRCONFIGID v3 document hashes to MRCONFIGID but " + "; ".join(problems)
    asserted = [k for k in V3_FIELDS if k in doc and k != "version"]
    return True, f"MRCONFIGID v3 is the hash of the MrConfigV3 document; its {', '.join(asserted)} equal the measured values"
