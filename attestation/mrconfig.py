"""MRCONFIGID: how dstack's VMM binds the app into the TD at launch, and what a quote's value proves.

From dstack's source at tag v0.5.11 (checked again at HEAD ``312dc605``):

* ``vmm/src/app/qemu.rs``: the VMM sets MRCONFIGID only when its host setting ``use_mrconfigid`` is on (``vmm.toml``
  default true) and the OS image is >= 0.5.2; otherwise it is all zero. The app-compose cannot ask for it.
* With ``use_mrconfigid``: **V1** when app-compose ``key_provider_id`` is empty, else **V2**
  (``dstack-types/src/mr_config.rs``):
  V1 = ``01 || compose_hash(32) || 00*15``;
  V2 = ``02 || keccak256(compose_hash(32) || app_id(20) || kind(1) || key_provider_id) || 00*15``,
  kind = none 0, local 1, kms 2, tpm 3; app_id = the deployer's id, else ``compose_hash[:20]``.
* The guest checks it at boot (``dstack-util/src/system_setup/config_id_verifier.rs``): zero passes, V1/V2 must equal
  the value recomputed from the measured compose-hash, app-id and the key provider actually used (the
  ``key-provider`` event's name and id); so a verifier recomputes it from the same RTMR3 events.
* HEAD only (unreleased, dstack >= 0.6): V3 = ``03 || sha256("dstack-mr-config-v3:" || 00 || document)`` over a JSON
  document the host supplies; it replaces V2 when ``key_provider_id`` is set. Not recomputable from a quote alone.

Real quotes: NEAR MPC's dstack 0.5.8 node and the dstack simulator fixture carry V1; the dstack-examples
rtmr3-based capture (a Phala Cloud CVM) carries all zero.
"""

from __future__ import annotations

import json
from typing import Literal

KINDS = {"none": 0, "local": 1, "local-sgx": 1, "kms": 2, "tpm": 3}  # key-provider event names -> dstack's kind byte
Outcome = Literal["pass", "fail", "skip"]


def v1(compose_hash: bytes) -> bytes:
    """MRCONFIGID V1."""
    return b"\x01" + compose_hash + bytes(15)


def v2(compose_hash: bytes, app_id: bytes, key_provider: str, key_provider_id: bytes) -> bytes:
    """MRCONFIGID V2 (Keccak-256, the Ethereum one, not SHA3-256).

    Raises:
        ValueError: wrong lengths or an unknown key provider.
    """
    from Crypto.Hash import keccak  # pycryptodome (eth-hash's backend); imported only when a V2 is computed

    if len(compose_hash) != 32 or len(app_id) != 20 or key_provider not in KINDS:
        raise ValueError(f"V2 needs a 32-byte compose hash, a 20-byte app id and a known key provider ({key_provider!r})")
    h = keccak.new(digest_bits=256)
    h.update(compose_hash + app_id + bytes([KINDS[key_provider]]) + key_provider_id)
    return b"\x02" + h.digest() + bytes(15)


def key_provider_of(app_compose: dict) -> str:
    """The key provider dstack uses for this app-compose (``dstack-types`` ``AppCompose::key_provider``)."""
    if app_compose.get("key_provider"):
        return str(app_compose["key_provider"])
    if app_compose.get("kms_enabled"):
        return "kms"
    return "local" if app_compose.get("local_key_provider_enabled") else "none"


def expected(app_compose: dict, compose_hash_hex: str, app_id_hex: str | None) -> tuple[str, str | None, str]:
    """(version, MRCONFIGID hex or None when it cannot be computed, why) for a VMM with ``use_mrconfigid`` on."""
    ch = bytes.fromhex(compose_hash_hex)
    kp_id = str(app_compose.get("key_provider_id") or "")
    if not kp_id:
        return "V1", v1(ch).hex(), "key_provider_id is empty"
    if app_id_hex is None:
        return "V2", None, "key_provider_id is set: V2 binds the app id, which a KMS deployment assigns (pass --app-id)"
    value = v2(ch, bytes.fromhex(app_id_hex), key_provider_of(app_compose), bytes.fromhex(kp_id.removeprefix("0x")))
    return "V2", value.hex(), f"key_provider_id is set (key provider {key_provider_of(app_compose)})"


def check(config_id: bytes, *, compose_hash: str | None, app_id: str | None, key_provider: bytes | None) -> tuple[Outcome, str]:
    """What a quote's MRCONFIGID proves, given the RTMR3 boot events (hex compose-hash and app-id, key-provider JSON).

    ``skip`` only for an all-zero MRCONFIGID, with the reason spelled out (the host did not bind the app);
    any other value must be recomputable and equal, else ``fail``.
    """
    if config_id == bytes(48):
        return "skip", ("MRCONFIGID is all zero: the host launched the CVM without use_mrconfigid, so it binds nothing; "
                        "the compose-hash rests on the RTMR3 event alone")
    if compose_hash is None:
        return "fail", "MRCONFIGID is set but the event log has no compose-hash to compare it with"
    version = config_id[0]
    if version == 1:
        ok = config_id == v1(bytes.fromhex(compose_hash))
        return ("pass" if ok else "fail"), f"V1 {'carries' if ok else 'does not carry'} compose-hash {compose_hash[:16]}…"
    if version == 2:
        try:
            kp = json.loads(key_provider or b"")
            want = v2(bytes.fromhex(compose_hash), bytes.fromhex(app_id or ""), str(kp["name"]), bytes.fromhex(kp.get("id") or ""))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return "fail", f"V2 cannot be recomputed from the app-id and key-provider events: {exc}"
        ok = config_id == want
        return ("pass" if ok else "fail"), (f"V2 keccak256(compose-hash, app-id, {kp['name']}, key-provider id) "
                                            f"{'matches' if ok else 'does not match'}")
    if version == 3:
        return "fail", "MRCONFIGID V3 (dstack >= 0.6 mr_config document) cannot be recomputed from the quote; not supported"
    return "fail", f"MRCONFIGID version byte {version:#04x} is unknown to dstack"
