"""Attested key release: the data owner hands the dataset key only to a CVM whose quote it verified.

File-based, so it needs no network between owner and CVM::

    CVM   run (dataset.key.source: release) -> no key yet: fresh X25519 key pair, key request,
          quote with report_data = SHA-512("cvm-tune-key-request-v1:" ‖ canonical request),
          written to <output>/key-release/request.json; stops with KeyReleasePendingError (exit 4)
    owner cvm-tune dataset release request.json --policy P --dataset FILE --key-file K --owner-key O -o grant.json
          verifies the quote with attestation.verify_quote under P (trusted root, TCB, measurements,
          compose-hash allow-list: required), checks the request names this owner and dataset,
          then wraps the key to the CVM's public key (HPKE, RFC 9180: DHKEM(X25519, HKDF-SHA256),
          HKDF-SHA256, AES-256-GCM; info binds the request hash) and signs the grant (Ed25519)
    CVM   run again with the grant at dataset.key.grant_file -> checks the owner signature against
          the pinned owner key and the request hash, unwraps, checks the key opens the dataset,
          seals it on the output volume under a GetKey-derived key and deletes the pending request.
          Later runs unseal it: a restart needs no new release (until the dataset key changes).

The **request** (canonical JSON, all bound by report_data): ``schema``, ``public_key`` (X25519,
hex), ``dataset_id``, ``dataset_version``, ``owner_key_id`` (the key the CVM pins), ``app_id``,
``compose_hash``, ``instance_id``, ``created_at``, ``nonce``. The **grant**: ``schema``,
``request_sha256``, ``dataset_id``, ``dataset_version``, ``owner_public_key``, ``suite``,
``ciphertext`` (HPKE enc ‖ ct, hex) and ``signature`` = Ed25519 over ``"cvm-tune/key-grant/v1" ‖
0x00 ‖`` the canonical grant without ``signature``.

What this does NOT protect: the host sees both files (they carry no secret); it can withhold the
grant (availability) and roll back the output volume. The sealed key is bound to the **app id**
(GetKey), not to the compose-hash: any compose the app's KMS admits later can unseal it, so the
owner's compose-hash check governs each *release*, not every later use. A quote signed by the
simulator's test CA passes only a policy that names that test root.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, hpke
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from app.dataset.format import open_encrypted, read_header
from app.errors import (
    ConfigError,
    DatasetFormatError,
    KeyGrantError,
    KeyReleasePendingError,
    KeyReleaseRefusedError,
    KeySourceError,
    StateError,
    WrongKeyError,
)
from app.fsutil import atomic_write_bytes
from attestation import Policy, parse_collateral, parse_event_log, verify_quote
from attestation.dataset_sig import owner_key_id, public_key_bytes
from attestation.errors import AttestationError
from attestation.hashing import canonical_json

REQUEST_SCHEMA = "cvm-tune/key-request/v1"
REQUEST_FILE_SCHEMA = "cvm-tune/key-request-file/v1"
GRANT_SCHEMA = "cvm-tune/key-grant/v1"
REQUEST_TAG = b"cvm-tune-key-request-v1"
GRANT_DOMAIN = b"cvm-tune/key-grant/v1\x00"
SUITE_NAME = "DHKEM(X25519,HKDF-SHA256)/HKDF-SHA256/AES-256-GCM"
SEAL_GETKEY_PATH = "cvm-tune/key-release/seal/v1"
_SUITE = hpke.Suite(hpke.KEM.X25519, hpke.KDF.HKDF_SHA256, hpke.AEAD.AES_256_GCM)
_MAX_FILE = 1 << 20
_REQUEST_KEYS = {"schema", "public_key", "dataset_id", "dataset_version", "owner_key_id", "app_id", "compose_hash",
                 "instance_id", "created_at", "nonce"}
_GRANT_KEYS = {"schema", "request_sha256", "dataset_id", "dataset_version", "owner_public_key", "suite", "ciphertext",
               "signature"}


def request_report_data(request: dict) -> bytes:
    """The 64-byte report_data of a key request's quote (dstack's ``hash(tag ":" content)`` convention)."""
    return hashlib.sha512(REQUEST_TAG + b":" + canonical_json(request)).digest()


def request_sha256(request: dict) -> str:
    return hashlib.sha256(canonical_json(request)).hexdigest()


# ---------------------------------------------------------------- owner side


@dataclass(frozen=True)
class Release:
    """What :func:`release_key` produced: the grant file bytes and the quote checks it passed."""

    grant: bytes
    request: dict
    checks: tuple[tuple[str, str, str], ...]  # (name, status, detail)


def release_key(request_file: bytes, *, policy: Policy, now: int, dataset: Path, dataset_key: bytes,
                owner_key: Ed25519PrivateKey, collateral: bytes | None = None) -> Release:
    """Verify a CVM's key request under the owner's policy and wrap the dataset key to it.

    Args:
        request_file: the CVM's ``request.json``.
        policy: the owner's policy; it must list ``compose_hashes`` (release to named code only).
        now: verification time (unix seconds).
        dataset: the encrypted dataset the key is for (its header must match the request).
        dataset_key: the 32-byte dataset key (checked to open ``dataset``).
        owner_key: the owner's signing key (the CVM must pin its public key).
        collateral: fresh collateral JSON instead of the request's.

    Returns:
        The signed grant.

    Raises:
        ConfigError: malformed request file, a policy without compose_hashes, or a key that does
            not open ``dataset``.
        KeyReleaseRefusedError: the quote fails a check, or the request names another owner,
            dataset or identity than the quote shows. No key material leaves the function.
    """
    if not policy.compose_hashes:
        raise ConfigError("the release policy lists no compose_hashes: the key would go to any code on a genuine TEE",
                          fix="pin the compose-hash(es) of the training app you trust in the policy's compose_hashes")
    request, quote, events, bundled_collateral = _parse_request_file(request_file)
    try:
        coll = parse_collateral(collateral if collateral is not None else (bundled_collateral or b""))
    except AttestationError as exc:
        raise KeyReleaseRefusedError(f"no usable collateral to verify the quote: {exc.message}",
                                     fix="pass --collateral with fresh collateral from a PCCS") from None
    findings = verify_quote(quote, policy=policy, now=now, collateral=coll, events=events,
                            expected_report_data=request_report_data(request))
    checks = tuple((c.name, c.status, c.detail) for c in findings.checks)
    failed = [f"{name}: {detail}" for name, status, detail in checks if status == "fail"]
    boot = findings.boot
    if boot is not None:
        if request["compose_hash"] != boot.hex("compose-hash") or request["app_id"] != boot.hex("app-id"):
            failed.append("request: its app_id / compose_hash differ from the measured ones")
    mine = owner_key_id(public_key_bytes(owner_key))
    if request["owner_key_id"] != mine:
        failed.append(f"request: the CVM pins owner key {request['owner_key_id'][:16]}…, not this owner key {mine[:16]}…")
    header = _dataset_header(dataset)
    if (request["dataset_id"], request["dataset_version"]) != (header.dataset_id, header.dataset_version):
        failed.append(f"request: it asks for dataset {request['dataset_id']!r} v{request['dataset_version']}, "
                      f"not {header.dataset_id!r} v{header.dataset_version}")
    if failed:
        raise KeyReleaseRefusedError("key NOT released: " + "; ".join(failed))
    if not _opens(dataset, dataset_key):
        raise ConfigError(f"the dataset key does not open {dataset.name}", fix="pass the key file this dataset was encrypted with")
    req_hash = request_sha256(request)
    cvm_pub = X25519PublicKey.from_public_bytes(bytes.fromhex(request["public_key"]))
    grant: dict[str, Any] = {
        "schema": GRANT_SCHEMA, "request_sha256": req_hash, "dataset_id": header.dataset_id,
        "dataset_version": header.dataset_version, "owner_public_key": public_key_bytes(owner_key).hex(),
        "suite": SUITE_NAME,
        "ciphertext": _SUITE.encrypt(bytes(dataset_key), cvm_pub, info=GRANT_DOMAIN + bytes.fromhex(req_hash)).hex(),
    }
    grant["signature"] = owner_key.sign(GRANT_DOMAIN + canonical_json(grant)).hex()
    return Release(grant=json.dumps(grant, indent=2, sort_keys=True).encode() + b"\n", request=request, checks=checks)


def _parse_request_file(data: bytes) -> tuple[dict, bytes, Any, bytes | None]:
    try:
        obj = json.loads(data[:_MAX_FILE])
        request = obj["request"]
        if obj.get("schema") != REQUEST_FILE_SCHEMA or not isinstance(request, dict) or set(request) != _REQUEST_KEYS:
            raise ValueError("schema")
        if request["schema"] != REQUEST_SCHEMA:
            raise ValueError("request schema")
        bytes.fromhex(request["public_key"])
        if len(request["public_key"]) != 64 or not isinstance(request["dataset_version"], int):
            raise ValueError("fields")
        quote = bytes.fromhex(obj["quote"])
        events = parse_event_log(obj["event_log"])
        coll = obj.get("collateral")
        return request, quote, events, coll.encode() if isinstance(coll, str) else None
    except (ValueError, KeyError, TypeError, AttributeError, AttestationError):
        raise ConfigError("not a cvm-tune key request file (cvm-tune/key-request-file/v1)",
                          fix="pass the key-release/request.json the CVM wrote to its output volume") from None


def _dataset_header(path: Path) -> Any:
    try:
        with open(path, "rb") as fh:
            return read_header(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read dataset {path}: {exc.strerror}") from None


def _opens(path: Path, key: bytes) -> bool:
    """Whether ``key`` passes the dataset's key check (nothing is decrypted)."""
    try:
        with open(path, "rb") as fh:
            open_encrypted(fh, key)
    except WrongKeyError:
        return False
    return True


# ---------------------------------------------------------------- CVM side


class Agent(Protocol):
    """What the CVM side needs from the guest agent (``app.tee.GuestAgent``)."""

    def get_key(self, path: str, purpose: str) -> bytes: ...

    def quote(self, report_data: bytes) -> tuple[bytes, str]: ...

    def collateral(self, quote: bytes, *, pccs_url: str, timeout_s: float) -> str | None: ...


@dataclass(frozen=True)
class CvmIdentity:
    app_id: str
    compose_hash: str
    instance_id: str


class ReleasedKeySource:
    """The dataset key released by the owner (module docstring), sealed on the output volume.

    Files: ``<out>/key-release/request.json`` (public: request, quote, event log, collateral) and
    ``<out>/state/key-release/`` (``pending.json``: the request with its X25519 private key sealed;
    ``dataset-<id hash>.json``: the dataset key sealed). Sealing: AES-256-GCM under
    ``HKDF-SHA256(GetKey("cvm-tune/key-release/seal/v1"))`` with the file's metadata as AAD.
    """

    def __init__(self, *, agent: Agent, identity: CvmIdentity, out_dir: Path, dataset: Path, grant_file: Path,
                 owner_public_key: bytes, pccs_url: str = "", timeout_s: float = 30.0) -> None:
        self._agent = agent
        self._id = identity
        self._out = Path(out_dir)
        self._dataset = Path(dataset)
        self._grant_file = Path(grant_file)
        self._owner_pub = bytes(owner_public_key)
        self._pccs_url, self._timeout_s = pccs_url, timeout_s
        self._state = self._out / "state" / "key-release"
        self.request_file = self._out / "key-release" / "request.json"
        self._how = "owner-release"

    def describe(self) -> str:
        """``owner-release`` plus where this run's key came from (``sealed`` or ``grant``)."""
        return self._how

    def dataset_key(self) -> bytes:
        """Unseal an earlier release, accept a grant for the pending request, or write a new request.

        Raises:
            KeyReleasePendingError: a request was written (or is still pending) and no grant for it exists.
            KeyGrantError: the grant is malformed, not for the pending request, not signed by the
                pinned owner, does not decrypt, or its key does not open the dataset.
            StateError: sealed state unreadable or unwritable.
        """
        try:
            with open(self._dataset, "rb") as fh:
                header = read_header(fh)
        except OSError as exc:
            raise DatasetFormatError(f"cannot read dataset {self._dataset.name}: {exc.strerror}") from None
        seal = self._seal_key()
        sealed = self._state / f"dataset-{hashlib.sha256(header.dataset_id.encode()).hexdigest()[:16]}.json"
        key = self._unseal_dataset_key(sealed, seal, header.dataset_id)
        if key is not None and _opens(self._dataset, key):
            self._how = "owner-release (sealed)"
            return key
        pending = self._load_pending(seal)
        if pending is not None and self._grant_file.is_file():
            request, private_key = pending
            try:
                grant = _read_limited(self._grant_file)
            except OSError as exc:
                raise KeyGrantError(f"cannot read the grant {self._grant_file.name}: {exc.strerror}") from None
            if _grant_request_hash(grant) in (request_sha256(request), None):  # None: open_grant says what is wrong
                key = open_grant(grant, request=request, private_key=private_key, owner_public_key=self._owner_pub)
                if not _opens(self._dataset, key):
                    raise KeyGrantError("the released key does not open the dataset", fix="ask the owner for a grant "
                                        "with the key of this dataset file")
                self._seal_dataset_key(sealed, seal, header.dataset_id, key, request)
                (self._state / "pending.json").unlink(missing_ok=True)
                self.request_file.unlink(missing_ok=True)
                self._how = f"owner-release (grant for request {request_sha256(request)[:16]})"
                return key
            raise KeyGrantError(f"{self._grant_file.name} is for another key request (the pending one is "
                                f"{request_sha256(request)[:16]}…)", fix=f"send {self.request_file} to the data owner "
                                "and replace the grant with the one they return")
        if pending is None or (pending[0]["dataset_id"], pending[0]["dataset_version"]) != (
                header.dataset_id, header.dataset_version):
            pending = self._new_request(header, seal)
        raise KeyReleasePendingError(
            f"no dataset key yet: key request {request_sha256(pending[0])[:16]}… for {header.dataset_id!r} "
            f"v{header.dataset_version} is in {self.request_file}",
            fix=f"send {self.request_file} to the data owner (`cvm-tune dataset release`), put the grant they return "
            f"at {self._grant_file}, and run again")

    # -- sealing

    def _seal_key(self) -> bytes:
        material = self._agent.get_key(SEAL_GETKEY_PATH, "cvm-tune-seal")
        if len(material) < 32:
            raise KeySourceError("GetKey returned no usable sealing key material")
        return HKDF(hashes.SHA256(), 32, salt=None, info=SEAL_GETKEY_PATH.encode()).derive(bytes(material))

    def _write_sealed(self, path: Path, meta: dict, secret: bytes, seal: bytes) -> None:
        nonce = secrets.token_bytes(12)
        body = {**meta, "nonce": nonce.hex(),
                "sealed": AESGCM(seal).encrypt(nonce, secret, canonical_json(meta)).hex()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, canonical_json(body), mode=0o600)
        except OSError as exc:
            raise StateError(f"cannot write {path.name} on the output volume: {exc.strerror}") from exc

    def _read_sealed(self, path: Path, seal: bytes) -> tuple[dict, bytes] | None:
        try:
            body = json.loads(_read_limited(path))
            nonce, sealed = bytes.fromhex(body.pop("nonce")), bytes.fromhex(body.pop("sealed"))
            return body, AESGCM(seal).decrypt(nonce, sealed, canonical_json(body))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError, InvalidTag):
            raise StateError(f"sealed key-release state {path.name} is unreadable or was not sealed by this app",
                             fix=f"delete {path} to request a new release from the data owner") from None

    def _unseal_dataset_key(self, path: Path, seal: bytes, dataset_id: str) -> bytes | None:
        got = self._read_sealed(path, seal)
        if got is None:
            return None
        meta, key = got
        if meta.get("dataset_id") != dataset_id or meta.get("owner_key_id") != owner_key_id(self._owner_pub):
            return None  # released for another dataset or owner: ask again
        return key

    def _seal_dataset_key(self, path: Path, seal: bytes, dataset_id: str, key: bytes, request: dict) -> None:
        meta = {"schema": "cvm-tune/sealed-dataset-key/v1", "dataset_id": dataset_id,
                "owner_key_id": owner_key_id(self._owner_pub), "request_sha256": request_sha256(request)}
        self._write_sealed(path, meta, key, seal)

    def _load_pending(self, seal: bytes) -> tuple[dict, X25519PrivateKey] | None:
        got = self._read_sealed(self._state / "pending.json", seal)
        if got is None:
            return None
        meta, raw = got
        return meta["request"], X25519PrivateKey.from_private_bytes(raw)

    # -- a new request

    def _new_request(self, header: Any, seal: bytes) -> tuple[dict, X25519PrivateKey]:
        private_key = X25519PrivateKey.generate()
        request = {
            "schema": REQUEST_SCHEMA, "public_key": private_key.public_key().public_bytes_raw().hex(),
            "dataset_id": header.dataset_id, "dataset_version": header.dataset_version,
            "owner_key_id": owner_key_id(self._owner_pub), "app_id": self._id.app_id,
            "compose_hash": self._id.compose_hash, "instance_id": self._id.instance_id,
            "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "nonce": secrets.token_hex(16),
        }
        quote, event_log = self._agent.quote(request_report_data(request))
        collateral = self._agent.collateral(quote, pccs_url=self._pccs_url, timeout_s=self._timeout_s)
        self._write_sealed(self._state / "pending.json", {"schema": "cvm-tune/pending-key-request/v1", "request": request},
                           private_key.private_bytes_raw(), seal)
        body = {"schema": REQUEST_FILE_SCHEMA, "request": request, "quote": quote.hex(), "event_log": event_log,
                "collateral": collateral}
        try:
            self.request_file.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.request_file, json.dumps(body, indent=2, sort_keys=True).encode() + b"\n")
        except OSError as exc:
            raise StateError(f"cannot write the key request {self.request_file}: {exc.strerror}") from exc
        return request, private_key


def open_grant(grant: bytes, *, request: dict, private_key: X25519PrivateKey, owner_public_key: bytes) -> bytes:
    """Check and unwrap an owner's grant for ``request``; returns the 32-byte dataset key.

    Raises:
        KeyGrantError: malformed, for another request or dataset, not signed by ``owner_public_key``,
            or the ciphertext does not open.
    """
    try:
        obj = json.loads(grant)
        if not isinstance(obj, dict) or set(obj) != _GRANT_KEYS or obj["schema"] != GRANT_SCHEMA:
            raise ValueError("schema")
        signature = bytes.fromhex(obj.pop("signature"))
        ciphertext = bytes.fromhex(obj["ciphertext"])
    except (ValueError, TypeError, AttributeError):
        raise KeyGrantError("the grant file is not a cvm-tune key grant (cvm-tune/key-grant/v1)") from None
    if obj["owner_public_key"] != owner_public_key.hex():
        raise KeyGrantError("the grant is signed by another owner key than the one pinned in dataset.owner_public_key")
    try:
        Ed25519PublicKey.from_public_bytes(owner_public_key).verify(signature, GRANT_DOMAIN + canonical_json(obj))
    except InvalidSignature:
        raise KeyGrantError("the grant's owner signature does not verify (the grant was modified or forged)") from None
    req_hash = request_sha256(request)
    if obj["request_sha256"] != req_hash or (obj["dataset_id"], obj["dataset_version"]) != (
            request["dataset_id"], request["dataset_version"]):
        raise KeyGrantError("the grant is for another key request or dataset")
    if obj["suite"] != SUITE_NAME:
        raise KeyGrantError(f"unsupported grant suite (expected {SUITE_NAME})")
    try:
        key = _SUITE.decrypt(ciphertext, private_key, info=GRANT_DOMAIN + bytes.fromhex(req_hash))
    except Exception:  # noqa: BLE001 - any HPKE failure (InvalidTag, bad encapsulation) means the same
        raise KeyGrantError("the grant does not decrypt with this CVM's request key") from None
    if len(key) != 32:
        raise KeyGrantError("the grant holds no 32-byte dataset key")
    return key


def _grant_request_hash(grant: bytes) -> str | None:
    try:
        value = json.loads(grant).get("request_sha256")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _read_limited(path: Path) -> bytes:
    with open(path, "rb") as fh:
        data = fh.read(_MAX_FILE + 1)
    if len(data) > _MAX_FILE:
        raise OSError(0, f"{os.fspath(path)} is larger than {_MAX_FILE} bytes")
    return data
