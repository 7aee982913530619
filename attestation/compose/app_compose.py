"""dstack's app-compose.json: compose-hash, app-id, the exact file dstack's tools write, and what it will run.

Rules, from dstack's source (github.com/Dstack-TEE/dstack at tag v0.5.11):

* **compose-hash** = SHA-256 of the raw bytes of ``app-compose.json`` as the CVM reads them, never re-serialised
  (``dstack-util/src/system_setup.rs``, ``measure_app_info``: ``sha256_file(app_compose_file)``; issue #550). It is
  emitted to RTMR3 as the ``compose-hash`` boot event and set in MRCONFIGID (v1 = ``01 || compose_hash || 15 zero
  bytes``, ``dstack-types/src/mr_config.rs``).
* **app-id** (same function): the deployer's app id when one was given (Phala's on-chain KMS: the DstackApp contract
  address; ``vmm-cli.py deploy --app-id``), else ``compose_hash[:20]``. dstack 0.5.x ignores a pinned id when
  ``kms_enabled`` is false (the event is then always ``compose_hash[:20]``); dstack 0.6 honours it in every
  key-provider mode. So a deployment with a pinned app id cannot be derived from the file: :func:`app_id` returns the
  pin when the caller gives it, and None for a KMS deployment without one.
* **The file dstack's own tool writes** (``vmm/src/vmm-cli.py``, ``create_app_compose``): the fields below in that
  order, ``json.dumps(..., indent=4, ensure_ascii=False)``, UTF-8, no trailing newline. The SDK's
  ``get_compose_hash`` (``sdk/python/src/dstack_sdk/get_compose_hash.py``) hashes the *normalized* form instead
  (sorted keys, ``separators=(",", ":")``, ``ensure_ascii=False``; ``docs/normalized-app-compose.md``), which is
  what Phala Cloud shows; both are supported here, and either way the CVM hashes the bytes it was given.

Verified against real captures in ``tests/data/attestation/`` (a dstack 0.5.8 CVM's event log and Info).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from attestation.errors import AttestationError
from attestation.compose.mr_config import key_provider_id
from attestation.io.safe_yaml import error_text, parse_json

SERVICE = "cvm-tune"  # the compose service that runs cvm-tune (its image is recorded in every manifest)
DSTACK_SOCKET = "/var/run/dstack.sock"
DIGEST_REF = re.compile(r"^(?P<name>[^@\s]+)@(?P<digest>sha256:[0-9a-f]{64})$")
PLACEHOLDER_DIGEST = "sha256:" + "0" * 64
MAX_APP_COMPOSE = 1 << 20
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|WEBHOOK|PRIVATE", re.I)
Style = Literal["vmm-cli", "normalized"]


class ComposeError(AttestationError):
    """app-compose.json or its docker-compose text cannot be read."""

    default_fix = "pass the app-compose.json the CVM measured (Info's tcb_info.app_compose, or the file you deployed)"


def compose_hash(raw: bytes) -> str:
    """dstack's compose-hash: SHA-256 of the exact file bytes (hex)."""
    return hashlib.sha256(raw).hexdigest()


def mr_config_id_v1(compose_hash_hex: str) -> str:
    """MRCONFIGID as the VMM sets it (v1), hex."""
    return "01" + compose_hash_hex + "00" * 15


# dstack-types/src/mr_config.rs (v0.5.11): KeyProviderKind as one byte; the key-provider boot event's names.
KEY_PROVIDER_BYTE = {"none": 0, "local": 1, "kms": 2, "tpm": 3}
EVENT_KEY_PROVIDER = {"none": "none", "local-sgx": "local", "local": "local", "kms": "kms", "tpm": "tpm"}
MR_CONFIG_V3 = ("03 || SHA-256 of the MrConfigV3 document the host writes at launch (it holds the instance id, known "
                "only at boot): not predictable here; a verifier checks the document the bundle carries (mr-config.json) "
                "against the measured boot events")
MR_CONFIG_WHEN = ("the VMM sets it only with use_mrconfigid = true (as dstack's vmm.toml ships) on an OS image >= 0.5.2; "
                  "otherwise it is all zeros and binds nothing")


def key_provider_kind(app_compose: dict[str, Any]) -> str:
    """``AppCompose::key_provider()``: the explicit ``key_provider``, else kms / local / none from the flags."""
    if app_compose.get("key_provider"):
        return str(app_compose["key_provider"])
    return "kms" if app_compose.get("kms_enabled") else "local" if app_compose.get("local_key_provider_enabled") else "none"


def mr_config_id_v2(compose_hash_hex: str, app_id_hex: str, kind: str, key_provider_id_hex: str) -> str:
    """MRCONFIGID v2: ``02 || keccak256(compose_hash || app_id || kind byte || key_provider_id) || 15 zero bytes``."""
    from eth_hash.auto import keccak

    if kind not in KEY_PROVIDER_BYTE:
        raise ComposeError(f"key provider {kind!r} is not one of {sorted(KEY_PROVIDER_BYTE)}")
    try:
        pre = (bytes.fromhex(compose_hash_hex) + bytes.fromhex(app_id_hex.removeprefix("0x")) + bytes([KEY_PROVIDER_BYTE[kind]])
               + bytes.fromhex(key_provider_id_hex.removeprefix("0x")))
    except ValueError as exc:
        raise ComposeError(f"compose-hash, app id and key_provider_id must be hex: {exc}") from exc
    return "02" + keccak(pre).hex() + "00" * 15


def expected_mr_config_id(app_compose: dict[str, Any], compose_hash_hex: str, app_id_hex: str | None, *,
                          dstack: str = "0.6") -> tuple[str, str | None]:
    """(form, hex) of the MRCONFIGID the VMM derives for this app-compose (``vmm/src/app/mr_config.rs``).

    v1 when ``key_provider_id`` is empty. Otherwise dstack 0.5.x makes v2 (which also needs the app id; None when it
    is not known) and dstack 0.6 makes **v3**, the hash of a MrConfigV3 document that holds values only the boot
    knows (the instance id; the GPU policy hash of a GPU launch): its hex is None here, and the document must be
    taken from the host (the bundle's mr-config.json) and checked against the measured events.
    """
    kp_id = str(app_compose.get("key_provider_id") or "")
    if not kp_id:
        return "v1", mr_config_id_v1(compose_hash_hex)
    if dstack != "0.5":
        return "v3", None
    if not app_id_hex:
        return "v2", None
    return "v2", mr_config_id_v2(compose_hash_hex, app_id_hex, key_provider_kind(app_compose), kp_id)


def check_mr_config_id(config_id: bytes, compose_hash_hex: str, app_id_hex: str | None,
                       key_provider_event: bytes | None, *, boot: Any = None,
                       mr_config: bytes | None = None) -> tuple[bool, str]:
    """Does the quote's MRCONFIGID bind this compose-hash? (ok, what was checked), from measured values only.

    Zero: not bound (ok, said so: the compose-hash then rests on RTMR3 alone). v1: ``01 || compose_hash``. v2: the
    Keccak over compose-hash, the measured app-id and the ``key-provider`` boot event's kind and id (what dstack's
    guest checks, ``dstack-util/src/system_setup/config_id_verifier.rs``). v3 (dstack 0.6): ``mr_config``, the
    MrConfigV3 document, hashes to it and its fields equal the measured boot events (``boot``, a
    :class:`~attestation.tdx.eventlog.BootInfo`; ``attestation.compose.mr_config``). Any other version fails.
    """
    if config_id == bytes(48):
        return True, "MRCONFIGID is zero: the VMM did not bind the compose-hash (use_mrconfigid off); RTMR3 alone binds it"
    version = config_id[0]
    if version == 1:
        ok = config_id.hex() == mr_config_id_v1(compose_hash_hex)
        return ok, "MRCONFIGID v1 " + ("carries" if ok else "does not carry") + " the compose-hash"
    if version == 3:
        from attestation.compose.mr_config import check_v3

        measured = dict(boot.values) if boot is not None else {
            k: bytes.fromhex(v) if k == "app-id" else v for k, v in (("app-id", app_id_hex), ("key-provider", key_provider_event))
            if v is not None}
        return check_v3(config_id, compose_hash_hex, measured, boot.init_scripts if boot is not None else None, mr_config)
    if version != 2:
        return False, f"MRCONFIGID version {version} is not one dstack sets (1, 2 or 3): cannot be checked"
    try:
        kp = parse_json(key_provider_event or b"", "the key-provider event", ComposeError)
        kind, kp_id = EVENT_KEY_PROVIDER[kp["name"]], key_provider_id(kp).hex()
        want = mr_config_id_v2(compose_hash_hex, app_id_hex or "", kind, kp_id) if app_id_hex else None
    except (ValueError, KeyError, TypeError, ComposeError) as exc:
        return False, f"MRCONFIGID v2 needs the measured app-id and key-provider events: {exc}"
    ok = want == config_id.hex()
    return ok, f"MRCONFIGID v2 {'matches' if ok else 'does not match'} keccak(compose-hash, app-id, {kind} key provider id)"


def app_id(app_compose: dict[str, Any], compose_hash_hex: str, *, pinned_app_id: str | None = None,
           dstack: str = "0.6") -> str | None:
    """The app-id the CVM will measure; None when a KMS deployment's id is assigned outside the file.

    dstack 0.6 honours a deploy-time (pinned) app id in every key-provider mode; 0.5.x only with a KMS (without one it
    always measures ``compose_hash[:20]``). No pin: ``compose_hash[:20]``, except that a KMS deployment's id is then
    not known from the file (None).
    """
    pinned = pinned_app_id.lower().removeprefix("0x") if pinned_app_id else None
    if pinned is not None and not re.fullmatch(r"[0-9a-f]{40}", pinned):
        raise ComposeError(f"app id {pinned_app_id!r} is not 20 bytes of hex", fix="pass the app id the deployment printed")
    if not app_compose.get("kms_enabled", False):
        return pinned if pinned is not None and dstack != "0.5" else compose_hash_hex[:40]
    return pinned


def load(raw: bytes) -> dict[str, Any]:
    """Parse app-compose.json (a JSON object).

    Raises:
        ComposeError: not UTF-8 JSON, not an object, too large or nested too deeply.
    """
    if len(raw) > MAX_APP_COMPOSE:
        raise ComposeError(f"app-compose.json is {len(raw)} bytes (limit {MAX_APP_COMPOSE})")
    data = parse_json(raw, "app-compose.json", ComposeError, max_bytes=MAX_APP_COMPOSE)
    if not isinstance(data, dict):
        raise ComposeError("app-compose.json must be a JSON object")
    return data


def from_info(raw: bytes) -> bytes:
    """The exact app-compose.json bytes inside a guest agent ``Info`` answer or a ``phala cvms attestation --json``
    document: ``tcb_info.app_compose`` (``tcb_info`` may itself be a JSON string, as the agent sends it).

    The text is the raw file the CVM hashed (``AppComposeWrapper.raw``), so its UTF-8 bytes hash to the compose-hash.

    Raises:
        ComposeError: not JSON, or no ``tcb_info.app_compose`` text.
    """
    what = "the Info / attestation document"
    doc = parse_json(raw, what, ComposeError)
    tcb = doc.get("tcb_info") if isinstance(doc, dict) else None
    tcb = parse_json(tcb, f"{what}'s tcb_info", ComposeError) if isinstance(tcb, str) else tcb
    text = tcb.get("app_compose") if isinstance(tcb, dict) else None
    if not isinstance(text, str) or not text:
        raise ComposeError("the document has no tcb_info.app_compose (is the CVM's public_tcbinfo off?)",
                           fix="pass the guest agent's Info answer or `phala cvms attestation NAME --json` output")
    return text.encode("utf-8")


@dataclass(frozen=True)
class AppComposeSettings:
    """The fields ``vmm-cli.py compose`` sets, with cvm-tune's defaults (logs private, KMS keys)."""

    name: str = "cvm-tune"
    kms_enabled: bool = True
    gateway_enabled: bool = True
    local_key_provider_enabled: bool = False
    key_provider_id: str = ""
    public_logs: bool = False
    public_sysinfo: bool = False
    allowed_envs: tuple[str, ...] = ()
    no_instance_id: bool = False
    secure_time: bool = True
    key_provider: str | None = None
    pre_launch_script: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def render(docker_compose_text: str, s: AppComposeSettings, *, style: Style = "vmm-cli") -> bytes:
    """The app-compose.json bytes for a docker-compose file, as dstack's tools write them."""
    doc: dict[str, Any] = {
        "manifest_version": 2, "name": s.name, "runner": "docker-compose", "docker_compose_file": docker_compose_text,
        "kms_enabled": s.kms_enabled, "gateway_enabled": s.gateway_enabled,
        "local_key_provider_enabled": s.local_key_provider_enabled, "key_provider_id": s.key_provider_id,
        "public_logs": s.public_logs, "public_sysinfo": s.public_sysinfo, "allowed_envs": list(s.allowed_envs),
        "no_instance_id": s.no_instance_id, "secure_time": s.secure_time,
    }
    if s.key_provider:
        doc["key_provider"] = s.key_provider
    if s.pre_launch_script:
        doc["pre_launch_script"] = s.pre_launch_script
    doc.update(s.extra)
    if style == "normalized":
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    return json.dumps(doc, indent=4, ensure_ascii=False).encode()


def services(docker_compose_text: str) -> dict[str, dict[str, Any]]:
    """The ``services`` mapping of a docker-compose text.

    Raises:
        ComposeError: not YAML or no services mapping.
    """
    return compose_document(docker_compose_text)[1]


def compose_document(docker_compose_text: str, loader: type | None = None) -> tuple[Any, dict[str, dict[str, Any]]]:
    """The parsed docker-compose text (mappings and sequences remember their source lines: ``compose_yaml``) and its
    ``services`` mapping; ``loader``: a ``compose_yaml.make_loader`` class (default: libyaml when available).

    Raises:
        ComposeError: not YAML or no services mapping.
    """
    from attestation.compose import located_yaml as compose_yaml

    try:
        doc = compose_yaml.parse(docker_compose_text, loader or compose_yaml.LOADER)
    except yaml.YAMLError as exc:
        raise ComposeError(f"docker_compose_file is not valid YAML: {error_text(exc)}") from exc
    except RecursionError as exc:  # a long chain of aliases: the constructor recurses through them
        raise ComposeError("docker_compose_file: its aliases are chained too deeply to be a compose file") from exc
    svcs = doc.get("services") if isinstance(doc, dict) else None
    if not isinstance(svcs, dict) or not all(isinstance(v, dict) for v in svcs.values()):
        raise ComposeError("docker_compose_file has no `services` mapping")
    return doc, svcs


def images(app_compose: dict[str, Any]) -> dict[str, str | None]:
    """service -> image reference, from the docker-compose text inside app-compose.json."""
    text = app_compose.get("docker_compose_file")
    if not isinstance(text, str):
        raise ComposeError("app-compose.json has no docker_compose_file text (runner is not docker-compose)")
    return {name: (svc.get("image") if isinstance(svc.get("image"), str) else None) for name, svc in services(text).items()}


def image_digest(ref: str | None) -> str | None:
    """``sha256:<hex>`` when ``ref`` is pinned by digest, else None."""
    m = DIGEST_REF.match(ref or "")
    return m.group("digest") if m else None


def env_entries(svc: dict[str, Any]) -> dict[str, str | None]:
    """A service's ``environment`` as name -> value (None: passed through from the CVM's environment)."""
    env = svc.get("environment") or {}
    if isinstance(env, dict):
        return {str(k): (None if v is None else str(v)) for k, v in env.items()}
    out: dict[str, str | None] = {}
    for item in env:
        name, sep, value = str(item).partition("=")
        out[name] = value if sep else None
    return out
