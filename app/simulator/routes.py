"""The simulator's RPC surface: which method a path and body call on :class:`app.simulator.agent.GuestAgentSimulator`
(v0 of both agent lines, and the ``/v1/`` surface of dstack 0.6), argument parsing, and Sign/Verify."""

from __future__ import annotations

import binascii
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.asymmetric.utils import Prehashed, decode_dss_signature, encode_dss_signature

from attestation.tdx.gpu_dstack import BOOT_FORMAT, FRESH_FORMAT, PROVIDER

import app.simulator.v06 as v06

_SECP256K1_N = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141


class SimulatorRpcError(Exception):
    """A request the guest agent refuses; the server answers ``status`` with ``{"error": message}``."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def dispatch(agent: Any, method: str, body: dict, api: str = "v0") -> dict:
    """Dispatch one RPC by name with its decoded JSON body (``api``: the ``/v1/`` surface of a 0.6 agent).

    Raises:
        SimulatorRpcError: bad arguments or unsupported RPC (400), unknown method (404).
    """
    if not isinstance(body, dict):
        raise SimulatorRpcError("request body must be a JSON object")
    if api == "v1":
        return _dispatch_v1(agent, method, body)
    if method == "GetQuote":
        return agent.get_quote(_hex(body, "report_data"))
    if method == "Info":
        return agent.info()
    if method == "GetKey":
        return agent.get_key(_str(body, "path"), _str(body, "purpose"), _str(body, "algorithm"),
                            root_epoch=opt_int(body, "root_epoch"), app_epoch=opt_int(body, "app_epoch"))
    if method == "EmitEvent":
        agent.emit_event(_str(body, "event"), _hex(body, "payload"))
        return {}  # the SDK calls .json() on every reply
    if method == "Version":
        return agent.version()
    if method == "Sign":
        return agent.sign(_str(body, "algorithm"), _hex(body, "data"))
    if method == "Verify":
        args = (_hex(body, "data"), _hex(body, "signature"), _hex(body, "public_key"))
        return {"valid": verify(_str(body, "algorithm"), *args)}
    if method == "Attest" and agent.is_06:
        return agent.attest(_hex(body, "report_data"))
    if method in ("GetTlsKey", "Attest"):
        raise SimulatorRpcError(f"{method} is not supported by cvm-tune simulator")
    if agent.is_06:
        raise SimulatorRpcError(f"Service not found: {method}", status=404)
    raise SimulatorRpcError(f"unknown method {method!r}", status=404)

def _dispatch_v1(agent: Any, method: str, body: dict) -> dict:
    if method == "Version":
        return agent.version()
    if method == "Info":
        return info_v1(agent)
    if method == "GetKey":
        return get_key_v1(agent, _str(body, "domain"), _str(body, "algorithm"))
    if method == "Attest":
        answer = agent.attest(_hex(body, "report_data"), v1=True)
        if body.get("include_boottime_gpu_evidence") is True:  # empty: no GPU passed the boot gate
            answer["boottime_gpu_evidence"] = _gpu_bundles(agent.boot_gpu_evidence, BOOT_FORMAT)
        return answer
    if method == "AttestGpu":
        nonce = _hex(body, "nonce")
        if len(nonce) != 32:
            raise SimulatorRpcError("nonce must be exactly 32 bytes")
        fresh = None if agent.boot_gpu_evidence is None else v06.collect_evidence(nonce)  # None: no GPU attached
        return {"bundles": _gpu_bundles(fresh, FRESH_FORMAT)}
    raise SimulatorRpcError(f"Service not found: {method}", status=404)


def _gpu_bundles(evidence: bytes | None, fmt: str) -> list[dict]:
    """``GpuEvidenceBundle`` list (``{vendor, format, evidence (hex)}``): one NVIDIA bundle, or none."""
    return [] if evidence is None else [{"vendor": PROVIDER, "format": fmt, "evidence": evidence.hex()}]


def info_v1(agent: Any) -> dict:
    """v1 ``Info``: identity only (no RTMRs, event log, ``tcb_info`` or ``app_cert``)."""
    v0 = agent.info()
    keep = ("app_id", "app_name", "compose_hash", "instance_id", "device_id", "os_image_hash", "mr_aggregated",
            "vm_config", "key_provider_info", "cloud_vendor", "cloud_product")
    return {"app_compose": agent.app_compose, **{k: v0[k] for k in keep}}


def get_key_v1(agent: Any, domain: str, algorithm: str) -> dict:
    """v1 ``GetKey`` (dstack-0.6.md §2.2): another KDF than v0, ``public_key``, a v1 claim as chain link 0.

    Raises:
        SimulatorRpcError: an algorithm other than exactly secp256k1 / ed25519, or an unusable derived scalar.
    """
    if algorithm not in v06.V1_ALGORITHMS:
        raise SimulatorRpcError(f"Unsupported algorithm: {algorithm!r} (expected secp256k1 or ed25519)")
    k_app, link1 = agent._app_root(agent.epochs)
    try:
        key, public = v06.v1_key(k_app.to_bytes(), algorithm, domain.encode())
    except v06.KeyDerivationError as exc:
        raise SimulatorRpcError(f"{exc}; use another domain") from exc
    sig0 = k_app.sign_msg_hash(v06.v1_claim(algorithm, domain.encode(), public)).to_bytes()
    return {"key": key.hex(), "public_key": public.hex(), "signature_chain": [sig0.hex(), link1.hex()]}


def sign(agent: Any, algorithm: str, data: bytes) -> dict:
    """Sign with the ``GetKey("vms", "signing")`` key, as the real agent does.

    Raises:
        SimulatorRpcError: unsupported algorithm, or a prehashed digest that is not 32 bytes.
    """
    algorithm = "secp256k1" if algorithm == "k256" else algorithm
    if algorithm not in ("ed25519", "secp256k1", "secp256k1_prehashed"):
        raise SimulatorRpcError("Unsupported algorithm")
    if algorithm == "secp256k1_prehashed" and len(data) != 32:
        raise SimulatorRpcError(f"Pre-hashed signing requires a 32-byte digest, but received {len(data)} bytes")
    key = agent.get_key("vms", "signing", "ed25519" if algorithm == "ed25519" else "secp256k1")
    sk = bytes.fromhex(key["key"])
    if algorithm == "ed25519":
        signer = ed25519.Ed25519PrivateKey.from_private_bytes(sk)
        signature, public = signer.sign(data), signer.public_key().public_bytes_raw()
    else:
        priv = ec.derive_private_key(int.from_bytes(sk, "big"), ec.SECP256K1())
        r, s = decode_dss_signature(priv.sign(data, _ecdsa(algorithm)))
        signature = r.to_bytes(32, "big") + min(s, _SECP256K1_N - s).to_bytes(32, "big")  # low-S like k256
        public = priv.public_key().public_bytes(serialization.Encoding.X962, serialization.PublicFormat.CompressedPoint)
    return {"signature": signature.hex(), "signature_chain": [signature.hex(), *key["signature_chain"]],
            "public_key": public.hex()}


def epoch(selected: int | None, current: int, which: str) -> int:
    if selected is None:
        return current
    if selected > current:
        raise SimulatorRpcError(f"{which} epoch {selected} is newer than the current {which} epoch {current}")
    return selected


def opt_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
        raise SimulatorRpcError(f"{name} must be an unsigned 32-bit integer")
    return value


def _ecdsa(algorithm: str) -> ec.ECDSA:
    # k256 (the real agent) signs SHA-256 of the data; "_prehashed" takes a 32-byte digest.
    inner = Prehashed(hashes.SHA256()) if algorithm == "secp256k1_prehashed" else hashes.SHA256()
    return ec.ECDSA(inner, deterministic_signing=True)


def verify(algorithm: str, data: bytes, signature: bytes, public_key: bytes) -> bool:
    algorithm = "secp256k1" if algorithm == "k256" else algorithm
    if algorithm not in ("ed25519", "secp256k1", "secp256k1_prehashed"):
        raise SimulatorRpcError("Unsupported algorithm")
    if len(signature) != 64 or (algorithm == "secp256k1_prehashed" and len(data) != 32):
        raise SimulatorRpcError("invalid signature or digest length")
    try:
        if algorithm == "ed25519":
            ed25519.Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
            return True
        r, s = int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:], "big")
        if s > _SECP256K1_N // 2:
            return False  # k256 refuses high-S signatures
        key = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256K1(), public_key)
        key.verify(encode_dss_signature(r, s), data, _ecdsa(algorithm))
        return True
    except InvalidSignature:
        return False
    except ValueError as exc:  # a malformed public key: the real agent errors too
        raise SimulatorRpcError(f"invalid public key: {exc}") from exc


def _str(body: dict, name: str) -> str:
    value = body.get(name, "")
    if not isinstance(value, str):
        raise SimulatorRpcError(f"{name} must be a string")
    return value


def _hex(body: dict, name: str) -> bytes:
    try:  # a2b_hex, unlike bytes.fromhex, refuses embedded whitespace
        return binascii.a2b_hex(_str(body, name))
    except (binascii.Error, ValueError) as exc:
        raise SimulatorRpcError(f"{name} must be a hex string") from exc
