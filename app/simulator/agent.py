"""A protocol-faithful Python model of the dstack guest agent (``dstack.md`` §8-§9, ``dstack-0.6.md`` §1-§3), for tests.

Two agent lines: ``dstack="0.5"`` (0.5.11: EmitEvent extends RTMR3, unversioned routes only) and ``dstack="0.6"``
(0.6.7, the default: ``/v0/`` and ``/v1/`` routes, EmitEvent always refused with the exact 400, ``Attest``, 0.6's
RTMR3 boot order, MRCONFIGID v1/v3, and KMS key epochs that v0 ``GetKey`` can select).

Unlike the official simulator (a canned quote with patched report_data, so its signature never
verifies), every quote here is re-signed under a deterministic *test* PKI (``pki.py``), RTMR3 is
the replay of the live event log, MRCONFIGID / compose-hash / app-id / instance-id agree with the
served app-compose.json, and GetKey follows the real derivation and signature chain. A verifier
that trusts only Intel's root still rejects these quotes; it has to be handed the test root on
purpose (``test_root_ca_der``). Nothing here is secret: ``DEFAULT_TEST_SECRET`` is public.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from typing import Any, Literal

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from eth_keys import keys as eth_keys
from eth_utils import ValidationError as EthValidationError
from eth_utils import keccak

from attestation.compose.app_compose import key_provider_kind, mr_config_id_v1, mr_config_id_v2
from attestation.io.safe_yaml import parse_json

import app
import app.simulator.pki as pki
import app.simulator.routes as routes
import app.simulator.v06 as v06
from app.simulator.routes import SimulatorRpcError, epoch

DEFAULT_TEST_SECRET = hashlib.sha256(b"cvm-tune dstack simulator TEST secret v1").digest()
"""The public default secret. NOT SECRET: anyone can derive every simulator key from it."""

RUNTIME_EVENT_TYPE = 0x08000001
AGENT_VERSION = "0.5.11"
AGENT_VERSION_06 = "0.6.7"
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


@dataclass(frozen=True)
class SimulatorSettings:
    """How the simulated CVM behaves; every default is a safe test default."""

    secret: bytes = DEFAULT_TEST_SECRET
    app_compose: str | None = None
    emit_event: Literal["accept", "noop", "reject"] = "accept"  # 0.5 only: 0.6 always refuses EmitEvent
    strip_event_log: bool = True
    dstack: Literal["0.5", "0.6"] = "0.6"
    root_epoch: int = 0  # the KMS root key epoch the CVM booted under
    app_epoch: int = 0  # the app key epoch (0.6.4+); a 0.5 agent derives from them too but cannot select old ones
    gpu: bool = False  # 0.6: one H100 that dstack's boot gate attested (0.5 attaches GPUs unverified: no effect)

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) != 32:
            raise ValueError("SimulatorSettings.secret must be exactly 32 bytes")
        if self.emit_event not in ("accept", "noop", "reject"):
            raise ValueError(f"SimulatorSettings.emit_event must be accept, noop or reject, not {self.emit_event!r}")
        if self.dstack not in ("0.5", "0.6"):
            raise ValueError(f"SimulatorSettings.dstack must be '0.5' or '0.6', not {self.dstack!r}")
        if not isinstance(self.gpu, bool):
            raise ValueError(f"SimulatorSettings.gpu must be a bool, not {self.gpu!r}")
        for name in ("root_epoch", "app_epoch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
                raise ValueError(f"SimulatorSettings.{name} must be an integer in 0..2^32-1, not {value!r}")


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
        self._compose = compose
        self.app_compose, self.app_name = raw, str(compose.get("name", ""))
        self.compose_hash = hashlib.sha256(raw.encode()).digest()  # raw bytes, never re-serialised (#550)
        self.app_id = self.compose_hash[:20]  # no deployer-pinned app_id here (dstack.md §6)
        seed = pki.derive_secret_bytes(settings.secret, "instance-id-seed", 20)
        self.instance_id = b"" if compose.get("no_instance_id") else hashlib.sha256(seed + self.app_id).digest()[:20]
        kms = pki.KmsTestCa.build(settings.secret, self.app_id)
        self.app_cert = kms.app_cert_pem
        self.key_provider_info = json.dumps({"name": "kms", "id": kms.root_spki.hex()}, separators=(",", ":"))
        self._kms_id = kms.root_spki.hex()
        self.is_06 = settings.dstack == "0.6"
        self.event_log_version = 2 if self.is_06 and compose.get("event_log_version") == 2 else 1
        self._epoch_keys: dict[tuple[int, int], tuple[eth_keys.PrivateKey, bytes]] = {}
        self.epochs = (settings.root_epoch, settings.app_epoch)
        self.kms_k256_public_key = _k256_key(self._kms_root(0)).public_key  # root epoch 0's KMS key
        self.mr_config: str | None = None  # the MrConfigV3 document, when MRCONFIGID is v3
        # nvattest's boot-time output (the real H100 sample) that the boot gate measured; None: no attested GPU
        self.boot_gpu_evidence = _fixture("gpu_boot_evidence.json") if settings.gpu and self.is_06 else None
        body = bytearray(self._base.header_body)
        body[232:280] = self._mr_config_id(compose, self._kms_id)
        self._body_template = bytes(body)
        self.vm_config = v06.vm_config_with(_VM_CONFIG, self.mr_config, gpus=int(self.boot_gpu_evidence is not None))
        self._boot()

    def _boot(self) -> None:
        """The event log of a fresh boot: RTMR0-2 from the CCEL fixture, then dstack's RTMR3 boot sequence."""
        self._events = json.loads(_fixture("boot_event_log.json"))  # imr 0-2, from the CCEL
        self._rtmrs = [self._base.header_body[o : o + 48] for o in _RTMR_OFFSETS[:3]] + [bytes(48)]
        for imr in range(3):
            if _replay(self._events, imr) != self._rtmrs[imr]:
                raise RuntimeError(f"simulator fixture broken: boot events do not replay to RTMR{imr}")
        for name, payload in self._boot_events():
            self._append(name, payload)

    def _boot_events(self) -> list[tuple[str, bytes]]:
        storage = str(self._compose.get("storage_fs") or "zfs").encode()
        if not self.is_06:  # RTMR3 boot sequence of dstack 0.5.x with a KMS key provider (dstack.md §3.4)
            return [("system-preparing", b""), ("app-id", self.app_id), ("compose-hash", self.compose_hash),
                    ("instance-id", self.instance_id), ("boot-mr-done", b""),
                    ("key-provider", self.key_provider_info.encode()), ("storage-fs", storage), ("system-ready", b"")]
        # dstack 0.6.7 with a KMS (dstack-0.6.md §3.1); gpu-attestation only when a simulated GPU passed the gate.
        gpu = [] if self.boot_gpu_evidence is None else [("gpu-attestation", v06.gpu_attestation_payload(
            self.boot_gpu_evidence))]
        return [("system-preparing", b""), ("app-id", self.app_id), ("compose-hash", self.compose_hash),
                *[("init-script-hash", h) for h in self.init_script_hashes], ("gpu-policy-hash", self.gpu_policy_hash),
                *gpu, ("instance-id", self.instance_id), ("boot-mr-done", b""),
                ("os-image-hash", bytes.fromhex(BASE_OS_IMAGE_HASH)), ("key-provider", self.key_provider_info.encode()),
                ("app-epoch", v06.app_epoch_payload(*self.epochs)), ("storage-fs", storage), ("system-ready", b"")]

    @property
    def init_script_hashes(self) -> list[bytes]:
        """SHA-256 of each app-compose ``init_script`` (a string or a list of up to 5), in order."""
        scripts = self._compose.get("init_script") or []
        scripts = [scripts] if isinstance(scripts, str) else scripts
        if not isinstance(scripts, list) or len(scripts) > 5 or not all(isinstance(x, str) for x in scripts):
            raise ValueError("app_compose init_script must be a string or a list of at most 5 strings")
        return [hashlib.sha256(x.encode()).digest() for x in scripts]

    @property
    def gpu_policy_hash(self) -> bytes:
        """SHA-256(JCS(requirements.gpu_policy)), the ``{}`` digest when there is none."""
        policy = (self._compose.get("requirements") or {}).get("gpu_policy")
        return v06.EMPTY_GPU_POLICY_HASH if policy is None else hashlib.sha256(v06.jcs(policy)).digest()

    def _mr_config_id(self, compose: dict, kms_id: str) -> bytes:
        """MRCONFIGID as dstack-vmm sets it and the guest accepts it: v1, or with ``key_provider_id`` v2 (0.5) /
        v3 (0.6, its MrConfigV3 document kept in :attr:`mr_config` and in ``vm_config``).

        Raises:
            ValueError: a binding the real guest would refuse at boot (another key provider or id than this KMS's).
        """
        kp_id = str(compose.get("key_provider_id") or "").lower().removeprefix("0x")
        if not kp_id:
            return bytes.fromhex(mr_config_id_v1(self.compose_hash.hex()))
        if key_provider_kind(compose) != "kms" or kp_id != kms_id:
            raise ValueError("app_compose key_provider_id / key provider is not this simulator's KMS "
                             f"({kms_id[:16]}…): dstack's guest would refuse to boot (MRCONFIGID v{3 if self.is_06 else 2})")
        if not self.is_06:
            return bytes.fromhex(mr_config_id_v2(self.compose_hash.hex(), self.app_id.hex(), "kms", kp_id))
        doc: dict[str, Any] = {"version": 3, "app_id": self.app_id.hex(), "compose_hash": self.compose_hash.hex(),
                               "key_provider": "kms", "key_provider_id": kp_id}
        if (compose.get("requirements") or {}).get("gpu_policy") is not None:
            doc["gpu_policy_hash"] = self.gpu_policy_hash.hex()
        if str(compose.get("manifest_version")) == "3":
            doc["init_script_hashes"] = [h.hex() for h in self.init_script_hashes]
        self.mr_config, mr = v06.mr_config_v3(doc)
        return mr

    # ------------------------------------------------------------------ key epochs
    def _kms_root(self, root_epoch: int) -> bytes:
        label = "kms/root-k256" if root_epoch == 0 else f"kms/root-k256/epoch/{root_epoch}"
        return pki.derive_secret_bytes(self.settings.secret, label)

    def _app_root(self, epochs: tuple[int, int]) -> tuple[eth_keys.PrivateKey, bytes]:
        """``(app root k256 key, KMS signature over it)`` for ``(root_epoch, app_epoch)`` (cached, like dstack)."""
        if epochs not in self._epoch_keys:
            kms_k256 = _k256_key(self._kms_root(epochs[0]))
            k_app = _k256_key(v06.epoch_app_root(kms_k256.to_bytes(), self.app_id, epochs[1]))
            issued = b"dstack-kms-issued:" + self.app_id + k_app.public_key.to_compressed_bytes()
            self._epoch_keys[epochs] = (k_app, kms_k256.sign_msg_hash(keccak(issued)).to_bytes())
        return self._epoch_keys[epochs]

    @property
    def _k_app(self) -> eth_keys.PrivateKey:
        return self._app_root(self.epochs)[0]

    def rotate(self, *, root_epoch: int | None = None, app_epoch: int | None = None) -> None:
        """TEST admin hook: a KMS key rotation followed by a reboot of the CVM under the new epochs.

        The boot event log is rebuilt (0.6.7 measures the app epoch); runtime events emitted before are gone, as
        after a real reboot. Epochs only move forward.

        Raises:
            ValueError: an epoch lower than the current one.
        """
        new = (self.epochs[0] if root_epoch is None else root_epoch, self.epochs[1] if app_epoch is None else app_epoch)
        if new[0] < self.epochs[0] or new[1] < self.epochs[1]:
            raise ValueError(f"key epochs only move forward: {self.epochs} -> {new}")
        with self._lock:
            self.epochs = new
            self._boot()

    # ------------------------------------------------------------------ event log
    def _append(self, name: str, payload: bytes) -> None:
        version = self.event_log_version
        digest = v06.runtime_digest(name, payload, version)
        event = {"imr": 3, "event_type": RUNTIME_EVENT_TYPE, "digest": digest.hex(), "event": name,
                 "event_payload": payload.hex()}
        if version == 2:  # V2 events carry their canonical pre-image (dstack-0.6.md §3.2)
            event.update(version=2, preimage=v06.v2_preimage(name, payload).hex())
        self._events.append(event)
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
            SimulatorRpcError: dstack 0.6 (always), reject mode, an empty name, a name with ``:`` (the v1 digest would
                be ambiguous, dstack.md §3.3) or a name over 256 bytes.
        """
        if self.is_06:  # dstack/guest-agent/src/rpc_service.rs: emit_event (0.6.0+)
            raise SimulatorRpcError(v06.EMIT_EVENT_REMOVED)
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
        quote, events = self._quote(report_data)
        if self.settings.strip_event_log:  # OS >= 0.5.6 (dstack.md §3.2)
            for ev in events:
                ev["digest" if ev["imr"] == 3 else "event_payload"] = ""
        return {"quote": quote.hex(), "event_log": json.dumps(events, separators=(",", ":")),
                "report_data": report_data.ljust(64, b"\0").hex(), "vm_config": self.vm_config}

    def _quote(self, report_data: bytes) -> tuple[bytes, list[dict]]:
        if len(report_data) > 64:
            raise SimulatorRpcError("Report data is too long")
        rtmr3, events = self._snapshot()
        body = bytearray(self._body_template)
        body[520:568] = rtmr3
        body[568:632] = report_data.ljust(64, b"\0")
        return self._pki.sign_quote(bytes(body), self._base.qe_report, self._base.qe_auth), events

    def attest(self, report_data: bytes, *, v1: bool = False) -> dict:
        """``Attest``: ``{"attestation": hex(VersionedAttestation)}`` with the full log; SCALE V0 unless a runtime
        event is V2 (or ``v1``: ``/v1/Attest`` always answers MessagePack V1).

        Raises:
            SimulatorRpcError: ``report_data`` longer than 64 bytes.
        """
        quote, events = self._quote(report_data)
        versioned = v1 or any(ev.get("version") == 2 for ev in events)
        encode = v06.encode_v1 if versioned else v06.encode_v0
        return {"attestation": encode(quote, events, report_data, self.vm_config).hex()}

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
        return {"version": AGENT_VERSION_06 if self.is_06 else AGENT_VERSION, "rev": REV_PREFIX + app.__version__}

    # ------------------------------------------------------------------ keys
    def get_key(self, path: str, purpose: str, algorithm: str, *, root_epoch: int | None = None,
                app_epoch: int | None = None) -> dict:
        """GetKey (dstack.md §5.2): ``sk = HKDF(K_app, path)`` and ``[sig(purpose:pub), KMS sig]``.

        On 0.6 (guest 0.6.6+) ``root_epoch`` / ``app_epoch`` select an older key epoch (unset: the current one) and
        the answer reports the epochs used; on 0.5 the selectors are ignored and no epochs are reported (as every
        guest up to 0.5.15 does), so the key is always the current epoch's.

        Raises:
            SimulatorRpcError: an algorithm other than secp256k1 / k256 / "" / ed25519, or an epoch newer than the
                current one.
        """
        if algorithm not in ("secp256k1", "k256", "", "ed25519"):
            raise SimulatorRpcError("Unsupported algorithm")
        epochs = self.epochs
        if self.is_06:
            epochs = (epoch(root_epoch, epochs[0], "root"), epoch(app_epoch, epochs[1], "app"))
        k_app, link1 = self._app_root(epochs)
        sk = _ratls_hkdf(k_app.to_bytes(), path.encode())
        if algorithm == "ed25519":  # the same 32 bytes, used as the ed25519 seed (dstack #605)
            pub_hex = ed25519.Ed25519PrivateKey.from_private_bytes(sk).public_key().public_bytes_raw().hex()
        else:
            pub_hex = _k256_key(sk).public_key.to_compressed_bytes().hex()
        sig0 = k_app.sign_msg_hash(keccak(f"{purpose}:{pub_hex}".encode())).to_bytes()
        answer: dict[str, Any] = {"key": sk.hex(), "signature_chain": [sig0.hex(), link1.hex()]}
        if self.is_06:
            answer.update(root_epoch=epochs[0], app_epoch=epochs[1])
        return answer

    def sign(self, algorithm: str, data: bytes) -> dict:
        """Sign with the ``GetKey("vms", "signing")`` key, as the real agent does (``routes.sign``)."""
        return routes.sign(self, algorithm, data)

    # ------------------------------------------------------------------ dispatch
    def rpc(self, method: str, body: dict, api: Literal["v0", "v1"] = "v0") -> dict:
        """Dispatch one RPC by name with its decoded JSON body (``api``: the ``/v1/`` surface of a 0.6 agent).

        Raises:
            SimulatorRpcError: bad arguments or unsupported RPC (400), unknown method (404).
        """
        return routes.dispatch(self, method, body, api)


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
