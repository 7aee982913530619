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

This module holds the protocol and the owner's side; the CVM's side is :mod:`app.dataset.key_request`.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import hpke
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from app.dataset.format import open_encrypted, read_header
from app.errors import ConfigError, KeyReleaseRefusedError, WrongKeyError
from app.fsutil import open_regular
from attestation import Policy, parse_collateral, parse_event_log, verify_quote
from attestation.bundle.dataset_sig import owner_key_id, public_key_bytes
from attestation.errors import AttestationError
from attestation.io.hashing import canonical_json

REQUEST_SCHEMA = "cvm-tune/key-request/v1"
REQUEST_FILE_SCHEMA = "cvm-tune/key-request-file/v1"
GRANT_SCHEMA = "cvm-tune/key-grant/v1"
REQUEST_TAG = b"cvm-tune-key-request-v1"
GRANT_DOMAIN = b"cvm-tune/key-grant/v1\x00"
SUITE_NAME = "DHKEM(X25519,HKDF-SHA256)/HKDF-SHA256/AES-256-GCM"
SEAL_GETKEY_PATH = "cvm-tune/key-release/seal/v1"
SUITE = hpke.Suite(hpke.KEM.X25519, hpke.KDF.HKDF_SHA256, hpke.AEAD.AES_256_GCM)
MAX_FILE = 1 << 20
_REQUEST_KEYS = {"schema", "public_key", "dataset_id", "dataset_version", "owner_key_id", "app_id", "compose_hash",
                 "instance_id", "created_at", "nonce"}


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
    if request["owner_key_id"] == owner_key_id(bytes.fromhex(mine)):  # the CVM pinned this key's id as the key
        failed.append(f"request: the CVM's dataset.owner_public_key is this owner key's id ({mine[:16]}…), not its "
                      "public key: pin the content of the .pub file instead")
    elif request["owner_key_id"] != mine:
        failed.append(f"request: the CVM pins owner key {request['owner_key_id'][:16]}…, not this owner key {mine[:16]}…")
    header = _dataset_header(dataset)
    if (request["dataset_id"], request["dataset_version"]) != (header.dataset_id, header.dataset_version):
        failed.append(f"request: it asks for dataset {request['dataset_id']!r} v{request['dataset_version']}, "
                      f"not {header.dataset_id!r} v{header.dataset_version}")
    if failed:
        raise KeyReleaseRefusedError("key NOT released: " + "; ".join(failed))
    if not key_opens(dataset, dataset_key):
        raise ConfigError(f"the dataset key does not open {dataset.name}", fix="pass the key file this dataset was encrypted with")
    req_hash = request_sha256(request)
    cvm_pub = X25519PublicKey.from_public_bytes(bytes.fromhex(request["public_key"]))
    grant: dict[str, Any] = {
        "schema": GRANT_SCHEMA, "request_sha256": req_hash, "dataset_id": header.dataset_id,
        "dataset_version": header.dataset_version, "owner_public_key": public_key_bytes(owner_key).hex(),
        "suite": SUITE_NAME,
        "ciphertext": SUITE.encrypt(bytes(dataset_key), cvm_pub, info=GRANT_DOMAIN + bytes.fromhex(req_hash)).hex(),
    }
    grant["signature"] = owner_key.sign(GRANT_DOMAIN + canonical_json(grant)).hex()
    return Release(grant=json.dumps(grant, indent=2, sort_keys=True).encode() + b"\n", request=request, checks=checks)


def _parse_request_file(data: bytes) -> tuple[dict, bytes, Any, bytes | None]:
    try:
        obj = json.loads(data[:MAX_FILE])
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


def key_opens(path: Path, key: bytes) -> bool:
    """Whether ``key`` passes the dataset's key check (nothing is decrypted)."""
    try:
        with open_regular(path) as fh:
            open_encrypted(fh, key)
    except WrongKeyError:
        return False
    return True
