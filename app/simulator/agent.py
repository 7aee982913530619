"""A protocol-faithful Python model of the dstack guest agent (``dstack.md`` §8-§9), for tests.

Unlike the official simulator (a canned quote with patched report_data, so its signature never
verifies), every quote here is re-signed under a deterministic *test* PKI (``pki.py``), RTMR3 is
the replay of the live event log, MRCONFIGID / compose-hash / app-id / instance-id agree with the
served app-compose.json, and GetKey follows the real derivation and signature chain. A verifier
that trusts only Intel's root still rejects these quotes; it has to be handed the test root on
purpose (``test_root_ca_der``). Nothing here is secret: ``DEFAULT_TEST_SECRET`` is public.
"""

from __future__ import annotations

import binascii
import copy
import hashlib
import json
import threading
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from typing import Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.asymmetric.utils import Prehashed, decode_dss_signature, encode_dss_signature
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from eth_keys import keys as eth_keys
from eth_utils import ValidationError as EthValidationError
from eth_utils import keccak

from attestation.compose.app_compose import key_provider_kind, mr_config_id_v1, mr_config_id_v2
from attestation.io.safe_yaml import parse_json

import app
import app.simulator.pki as pki

DEFAULT_TEST_SECRET = hashlib.sha256(b"cvm-tune dstack simulator TEST secret v1").digest()
"""The public default secret. NOT SECRET: anyone can derive every simulator key from it."""

RUNTIME_EVENT_TYPE = 0x08000001
AGENT_VERSION = "0.5.11"
REV_PREFIX = "cvm-tune-simulator/"
# The os-image-hash event of the dstack simulator fixture: the OS image MRTD/RTMR0-2 belong to.
BASE_OS_IMAGE_HASH = "e61be43dd1cc6a6f5edefd7c51b608983780839b0000ce60dd99737dcffe09b9"
# Shape of a production dstack vm_config (dstack.md §8.3), CPU-only; descriptive only.
_VM_CONFIG = json.dumps(
    {"spec_version": 1, "os_image_hash": BASE_OS_IMAGE_HASH, "cpu_count": 16, "memory_size": 68719476736,
     "qemu_single_pass_add_pages": False, "pic": False, "pci_hole64_size": 17592186044416, "num_gpus": 0,
     "num_nvswitches": 0, "hugepages": False, "hotplug_off": True, "qemu_version": "9.2.1"},
    separators=(",", ":"),
)
_RTMR_OFFSETS = (376, 424, 472, 520)  # v4 quote offsets of RTMR0..3 (attestation.md §4.2)
_MAX_EVENT_NAME = 256
_SECP256K1_N = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141


class SimulatorRpcError(Exception):
    """A request the guest agent refuses; the server answers ``status`` with ``{"error": message}``."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True)
class SimulatorSettings:
    """How the simulated CVM behaves; every default is a safe test default."""

    secret: bytes = DEFAULT_TEST_SECRET
    app_compose: str | None = None
    emit_event: Literal["accept", "noop", "reject"] = "accept"
    strip_event_log: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) != 32:
            raise ValueError("SimulatorSettings.secret must be exactly 32 bytes")
        if self.emit_event not in ("accept", "noop", "reject"):
            raise ValueError(f"SimulatorSettings.emit_event must be accept, noop or reject, not {self.emit_event!r}")


def runtime_digest(name: str, payload: bytes) -> bytes:
    """v1 RTMR3 event digest: ``sha384(u32le(0x08000001) || ":" || name || ":" || payload)``."""
    return hashlib.sha384(RUNTIME_EVENT_TYPE.to_bytes(4, "little") + b":" + name.encode() + b":" + payload).digest()


class GuestAgentSimulator:
    """In-process guest agent: Info, GetQuote, GetKey, EmitEvent, Version, Sign, Verify.

    Thread-safe: one lock serialises event-log appends with the RTMR3 snapshot a quote signs
    (the real agent gained the same mutex in dstack PR #706).
    """

    def __init__(self, settings: SimulatorSettings = SimulatorSettings()) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._base = pki.BaseQuote.parse(_fixture("base_quote.bin"))
        self._pki = pki.DcapTestPki.build(settings.secret, self._base.sgx_extension)
        raw = settings.app_compose if settings.app_compose is not None else _fixture("app-compose.json").decode()
        compose = parse_json(raw, "app_compose", ValueError)
        if not isinstance(compose, dict):
            raise ValueError("app_compose must be a JSON object")
        self.app_compose, self.app_name = raw, str(compose.get("name", ""))
        self.compose_hash = hashlib.sha256(raw.encode()).digest()  # raw bytes, never re-serialised (#550)
        self.app_id = self.compose_hash[:20]  # no deployer-pinned app_id here (dstack.md §6)
        seed = pki.derive_secret_bytes(settings.secret, "instance-id-seed", 20)
        self.instance_id = b"" if compose.get("no_instance_id") else hashlib.sha256(seed + self.app_id).digest()[:20]
        kms = pki.KmsTestCa.build(settings.secret, self.app_id)
        self.app_cert = kms.app_cert_pem
        self.key_provider_info = json.dumps({"name": "kms", "id": kms.root_spki.hex()}, separators=(",", ":"))
        # KMS mode (dstack.md §5.1): K_app = HKDF(K_kms_root, app_id || "app-key"); the KMS root
        # signs K_app's public key and that signature is the second link of every GetKey chain.
        kms_k256 = _k256_key(pki.derive_secret_bytes(settings.secret, "kms/root-k256"))
        self._k_app = _k256_key(_ratls_hkdf(kms_k256.to_bytes(), self.app_id + b"app-key"))
        issued = b"dstack-kms-issued:" + self.app_id + self._k_app.public_key.to_compressed_bytes()
        self._k256_signature = kms_k256.sign_msg_hash(keccak(issued)).to_bytes()
        self.kms_k256_public_key = kms_k256.public_key
        self._events = json.loads(_fixture("boot_event_log.json"))  # imr 0-2, from the CCEL
        self._rtmrs = [self._base.header_body[o : o + 48] for o in _RTMR_OFFSETS[:3]] + [bytes(48)]
        for imr in range(3):
            if _replay(self._events, imr) != self._rtmrs[imr]:
                raise RuntimeError(f"simulator fixture broken: boot events do not replay to RTMR{imr}")
        # RTMR3 boot sequence of dstack 0.5.x with a KMS key provider (dstack.md §3.4).
        for name, payload in (
            ("system-preparing", b""), ("app-id", self.app_id), ("compose-hash", self.compose_hash),
            ("instance-id", self.instance_id), ("boot-mr-done", b""),
            ("key-provider", self.key_provider_info.encode()),
            ("storage-fs", str(compose.get("storage_fs") or "zfs").encode()), ("system-ready", b""),
        ):
            self._append(name, payload)
        body = bytearray(self._base.header_body)
        body[232:280] = self._mr_config_id(compose, kms.root_spki.hex())
        self._body_template = bytes(body)
        self.vm_config = _VM_CONFIG

    def _mr_config_id(self, compose: dict, kms_id: str) -> bytes:
        """MRCONFIGID as dstack-vmm sets it (v1, or v2 with ``key_provider_id``) and as the guest accepts it.

        Raises:
            ValueError: a v2 binding the real guest would refuse at boot (another key provider or id than this KMS's).
        """
        kp_id = str(compose.get("key_provider_id") or "").lower().removeprefix("0x")
        if not kp_id:
            return bytes.fromhex(mr_config_id_v1(self.compose_hash.hex()))
        if key_provider_kind(compose) != "kms" or kp_id != kms_id:
            raise ValueError("app_compose key_provider_id / key provider is not this simulator's KMS "
                             f"({kms_id[:16]}…): dstack's guest would refuse to boot (MRCONFIGID v2)")
        return bytes.fromhex(mr_config_id_v2(self.compose_hash.hex(), self.app_id.hex(), "kms", kp_id))

    # ------------------------------------------------------------------ event log
    def _append(self, name: str, payload: bytes) -> None:
        digest = runtime_digest(name, payload)
        self._events.append({"imr": 3, "event_type": RUNTIME_EVENT_TYPE, "digest": digest.hex(),
                             "event": name, "event_payload": payload.hex()})
        self._rtmrs[3] = hashlib.sha384(self._rtmrs[3] + digest).digest()

    def _snapshot(self) -> tuple[bytes, list[dict]]:
        with self._lock:
            return self._rtmrs[3], copy.deepcopy(self._events)

    @property
    def event_log(self) -> list[dict]:
        """A copy of the full (unstripped) current event log."""
        return self._snapshot()[1]

    def emit_event(self, event: str, payload: bytes) -> None:
        """EmitEvent: append a runtime event and extend RTMR3 (or no-op / refuse, per settings).

        Raises:
            SimulatorRpcError: reject mode, an empty name, a name with ``:`` (the v1 digest would
                be ambiguous, dstack.md §3.3) or a name over 256 bytes.
        """
        if self.settings.emit_event == "reject":  # wording of dstack's simulator >= 0.5.9
            raise SimulatorRpcError(f"runtime event emission is unavailable in simulator mode: {event}")
        if not event:
            raise SimulatorRpcError("event name cannot be empty")
        if ":" in event or len(event.encode()) > _MAX_EVENT_NAME:
            raise SimulatorRpcError("event name must not contain ':' and must be at most 256 bytes")
        if self.settings.emit_event == "accept":
            with self._lock:  # log append and RTMR3 extend are one atomic step
                self._append(event, payload)

    # ------------------------------------------------------------------ quotes
    def get_quote(self, report_data: bytes) -> dict:
        """GetQuote: a quote over ``report_data`` right-padded to 64 bytes, plus the event log.

        Returns:
            ``{"quote", "event_log" (JSON string, stripped per settings), "report_data", "vm_config"}``.

        Raises:
            SimulatorRpcError: ``report_data`` longer than 64 bytes.
        """
        if len(report_data) > 64:
            raise SimulatorRpcError("Report data is too long")
        rtmr3, events = self._snapshot()
        body = bytearray(self._body_template)
        body[520:568] = rtmr3
        body[568:632] = report_data.ljust(64, b"\0")
        quote = self._pki.sign_quote(bytes(body), self._base.qe_report, self._base.qe_auth)
        if self.settings.strip_event_log:  # OS >= 0.5.6 (dstack.md §3.2)
            for ev in events:
                ev["digest" if ev["imr"] == 3 else "event_payload"] = ""
        return {"quote": quote.hex(), "event_log": json.dumps(events, separators=(",", ":")),
                "report_data": bytes(body[568:632]).hex(), "vm_config": self.vm_config}

    @property
    def test_root_ca_der(self) -> bytes:
        """DER of the TEST root CA every simulator quote chains to."""
        return self._pki.root_der

    @cached_property
    def _collateral(self) -> str:
        return self._pki.collateral(_fixture("tcb_info.json").decode(), _fixture("qe_identity.json").decode())

    def collateral_json(self) -> str:
        """dcap-qvl ``QuoteCollateralV3`` JSON for simulator quotes (test PKI, valid 2020..2099)."""
        return self._collateral

    # ------------------------------------------------------------------ info
    def info(self) -> dict:
        """Info: the real agent's JSON; ``tcb_info`` is a JSON string with the unstripped log."""
        rtmr3, events = self._snapshot()
        body = self._body_template
        mrs = [body[184:232]] + [body[o : o + 48] for o in _RTMR_OFFSETS[:3]] + [rtmr3]
        # MRTD || RTMR0-3, plus MRCONFIGID || MROWNER || MROWNERCONFIG since one is non-zero (§3.4).
        mr_aggregated = hashlib.sha256(b"".join(mrs) + body[232:376]).hexdigest()
        device_id = hashlib.sha256(b"").hexdigest()  # the agent's value for an unverified attestation
        tcb_info = {"mrtd": mrs[0].hex(), "rtmr0": mrs[1].hex(), "rtmr1": mrs[2].hex(), "rtmr2": mrs[3].hex(),
                    "rtmr3": mrs[4].hex(), "mr_aggregated": mr_aggregated, "os_image_hash": BASE_OS_IMAGE_HASH,
                    "compose_hash": self.compose_hash.hex(), "device_id": device_id, "event_log": events,
                    "app_compose": self.app_compose}
        return {
            "app_id": self.app_id.hex(), "instance_id": self.instance_id.hex(), "app_cert": self.app_cert,
            "tcb_info": json.dumps(tcb_info, indent=2), "app_name": self.app_name, "device_id": device_id,
            "mr_aggregated": mr_aggregated, "os_image_hash": BASE_OS_IMAGE_HASH,
            "key_provider_info": self.key_provider_info, "compose_hash": self.compose_hash.hex(),
            "vm_config": self.vm_config, "cloud_vendor": "", "cloud_product": "",
        }

    def version(self) -> dict:
        """Version: the app recognises the simulator by the ``cvm-tune-simulator/`` rev prefix."""
        return {"version": AGENT_VERSION, "rev": REV_PREFIX + app.__version__}

    # ------------------------------------------------------------------ keys
    def get_key(self, path: str, purpose: str, algorithm: str) -> dict:
        """GetKey (dstack.md §5.2): ``sk = HKDF(K_app, path)`` and ``[sig(purpose:pub), KMS sig]``.

        Raises:
            SimulatorRpcError: an algorithm other than secp256k1 / k256 / "" / ed25519.
        """
        if algorithm not in ("secp256k1", "k256", "", "ed25519"):
            raise SimulatorRpcError("Unsupported algorithm")
        sk = _ratls_hkdf(self._k_app.to_bytes(), path.encode())
        if algorithm == "ed25519":  # the same 32 bytes, used as the ed25519 seed (dstack #605)
            pub_hex = ed25519.Ed25519PrivateKey.from_private_bytes(sk).public_key().public_bytes_raw().hex()
        else:
            pub_hex = _k256_key(sk).public_key.to_compressed_bytes().hex()
        sig0 = self._k_app.sign_msg_hash(keccak(f"{purpose}:{pub_hex}".encode())).to_bytes()
        return {"key": sk.hex(), "signature_chain": [sig0.hex(), self._k256_signature.hex()]}

    def sign(self, algorithm: str, data: bytes) -> dict:
        """Sign with the ``GetKey("vms", "signing")`` key, as the real agent does.

        Raises:
            SimulatorRpcError: unsupported algorithm, or a prehashed digest that is not 32 bytes.
        """
        algorithm = "secp256k1" if algorithm == "k256" else algorithm
        if algorithm not in ("ed25519", "secp256k1", "secp256k1_prehashed"):
            raise SimulatorRpcError("Unsupported algorithm")
        if algorithm == "secp256k1_prehashed" and len(data) != 32:
            raise SimulatorRpcError(f"Pre-hashed signing requires a 32-byte digest, but received {len(data)} bytes")
        key = self.get_key("vms", "signing", "ed25519" if algorithm == "ed25519" else "secp256k1")
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

    # ------------------------------------------------------------------ dispatch
    def rpc(self, method: str, body: dict) -> dict:
        """Dispatch one RPC by name with its decoded JSON body.

        Raises:
            SimulatorRpcError: bad arguments or unsupported RPC (400), unknown method (404).
        """
        if not isinstance(body, dict):
            raise SimulatorRpcError("request body must be a JSON object")
        if method == "GetQuote":
            return self.get_quote(_hex(body, "report_data"))
        if method == "Info":
            return self.info()
        if method == "GetKey":
            return self.get_key(_str(body, "path"), _str(body, "purpose"), _str(body, "algorithm"))
        if method == "EmitEvent":
            self.emit_event(_str(body, "event"), _hex(body, "payload"))
            return {}  # the SDK calls .json() on every reply
        if method == "Version":
            return self.version()
        if method == "Sign":
            return self.sign(_str(body, "algorithm"), _hex(body, "data"))
        if method == "Verify":
            args = (_hex(body, "data"), _hex(body, "signature"), _hex(body, "public_key"))
            return {"valid": _verify(_str(body, "algorithm"), *args)}
        if method in ("GetTlsKey", "Attest"):
            raise SimulatorRpcError(f"{method} is not supported by cvm-tune simulator")
        raise SimulatorRpcError(f"unknown method {method!r}", status=404)


def _fixture(name: str) -> bytes:
    return resources.files("app.simulator").joinpath("fixtures", name).read_bytes()


def _replay(events: list[dict], imr: int) -> bytes:
    mr = bytes(48)
    for ev in events:
        if ev["imr"] == imr:
            mr = hashlib.sha384(mr + bytes.fromhex(ev["digest"])).digest()
    return mr


def _ratls_hkdf(ikm: bytes, info: bytes) -> bytes:
    # dstack's kdf::derive_key: HKDF-SHA256 with salt "RATLS" (dstack.md §5.1-§5.2).
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"RATLS", info=info).derive(ikm)


def _k256_key(raw: bytes) -> eth_keys.PrivateKey:
    try:  # eth_keys rejects 0 and values >= n (HKDF output hits that with probability ~2^-128)
        return eth_keys.PrivateKey(raw)
    except EthValidationError as exc:
        raise SimulatorRpcError("Failed to parse k256 key") from exc


def _ecdsa(algorithm: str) -> ec.ECDSA:
    # k256 (the real agent) signs SHA-256 of the data; "_prehashed" takes a 32-byte digest.
    inner = Prehashed(hashes.SHA256()) if algorithm == "secp256k1_prehashed" else hashes.SHA256()
    return ec.ECDSA(inner, deterministic_signing=True)


def _verify(algorithm: str, data: bytes, signature: bytes, public_key: bytes) -> bool:
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
