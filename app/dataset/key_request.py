"""Attested key release, the CVM's side: key request, grant check, sealing (protocol: :mod:`app.dataset.release`).

:class:`ReleasedKeySource` is the ``release`` key source of the pipeline. Files on the output
volume: ``key-release/request.json`` (public: request, quote, event log, collateral) and
``state/key-release/`` (``pending.json``: the request with its X25519 private key sealed;
``dataset-<id hash>.json``: the released dataset key sealed). Sealing is AES-256-GCM under
``HKDF-SHA256(GetKey("cvm-tune/key-release/seal/v1"))`` with the file's metadata as AAD, so only
this app (app id) can unseal; a restart needs no new release.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from app.dataset.format import read_header
from app.dataset.release import (
    GRANT_DOMAIN,
    GRANT_SCHEMA,
    MAX_FILE,
    REQUEST_FILE_SCHEMA,
    REQUEST_SCHEMA,
    SEAL_GETKEY_PATH,
    SUITE,
    SUITE_NAME,
    key_opens,
    request_report_data,
    request_sha256,
)
from app.errors import DatasetFormatError, KeyGrantError, KeyReleasePendingError, KeySourceError, StateError
from app.fsutil import atomic_write_bytes, open_regular
from app.keys_epoch import EpochKeys, FixedKey, KeyEpochs
from attestation.bundle.dataset_sig import owner_key_id
from attestation.errors import CollateralError
from attestation.io.hashing import canonical_json

logger = logging.getLogger(__name__)

_GRANT_KEYS = {"schema", "request_sha256", "dataset_id", "dataset_version", "owner_public_key", "suite", "ciphertext",
               "signature"}


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
    """The dataset key released by the owner, sealed on the output volume (module docstring)."""

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
        self._keys: EpochKeys | FixedKey | None = None

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
            with open_regular(self._dataset) as fh:
                header = read_header(fh)
        except OSError as exc:
            raise DatasetFormatError(f"cannot read dataset {self._dataset}: {exc.strerror}") from None
        seal = self._seal_key()
        sealed = self._state / f"dataset-{hashlib.sha256(header.dataset_id.encode()).hexdigest()[:16]}.json"
        key = self._unseal_dataset_key(sealed, seal, header.dataset_id)
        if key is not None and key_opens(self._dataset, key):
            self._how = "owner-release (sealed)"
            return key
        pending = self._load_pending(seal)
        if pending is not None and (pending[0]["dataset_id"], pending[0]["dataset_version"]) != (
                header.dataset_id, header.dataset_version):
            pending = None  # that request was for another dataset (version): ask again for this one
        if pending is not None and self._grant_file.is_file():
            request, private_key = pending
            try:
                grant = _read_limited(self._grant_file)
            except OSError as exc:
                raise KeyGrantError(f"cannot read the grant {self._grant_file.name}: {exc.strerror}") from None
            if _grant_request_hash(grant) in (request_sha256(request), None):  # None: open_grant says what is wrong
                key = open_grant(grant, request=request, private_key=private_key, owner_public_key=self._owner_pub)
                if not key_opens(self._dataset, key):
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
        if pending is None:
            pending = self._new_request(header, seal)
        raise KeyReleasePendingError(
            f"no dataset key yet: key request {request_sha256(pending[0])[:16]}… for {header.dataset_id!r} "
            f"v{header.dataset_version} is in {self.request_file}",
            fix=f"send {self.request_file} to the data owner (`cvm-tune dataset release`), put the grant they return "
            f"at {self._grant_file}, and run again")

    def released_key_for(self, dataset: Path) -> bytes | None:
        """The key the owner released earlier for this dataset id, if it opens ``dataset`` (no request is written):
        a newer version under a new key awaits its grant while an older, released version can still be used."""
        try:
            with open_regular(dataset) as fh:
                header = read_header(fh)
        except OSError:
            return None
        seal = self._seal_key()
        sealed = self._state / f"dataset-{hashlib.sha256(header.dataset_id.encode()).hexdigest()[:16]}.json"
        key = self._unseal_dataset_key(sealed, seal, header.dataset_id)
        return key if key is not None and key_opens(dataset, key) else None

    # -- sealing

    def _seal_key(self) -> bytes:
        """The current sealing key; sealed files record its KMS key epochs (``key_epochs``, authenticated) and one
        sealed under older epochs is opened with that epoch's key and re-sealed (``app.keys_epoch``)."""
        if self._keys is None:
            from app.tee import GuestAgent

            if isinstance(self._agent, GuestAgent):
                self._keys = EpochKeys(self._agent, SEAL_GETKEY_PATH, "cvm-tune-seal", _derive_seal)
            else:  # a stand-in agent (tests): one key, no epochs
                self._keys = FixedKey(_derive_seal(self._agent.get_key(SEAL_GETKEY_PATH, "cvm-tune-seal")))
        return self._keys.current

    def _write_sealed(self, path: Path, meta: dict, secret: bytes, seal: bytes) -> None:
        nonce = secrets.token_bytes(12)
        epochs = self._keys.current_epochs if self._keys is not None and seal == self._keys.current else None
        meta = {k: v for k, v in meta.items() if k != "key_epochs"}
        if epochs is not None:
            meta["key_epochs"] = epochs.as_dict()
        body = {**meta, "nonce": nonce.hex(),
                "sealed": AESGCM(seal).encrypt(nonce, secret, canonical_json(meta)).hex()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, canonical_json(body), mode=0o600)
        except OSError as exc:
            raise StateError(f"cannot write {path.name} on the output volume: {exc.strerror}") from exc

    def _read_sealed(self, path: Path, seal: bytes) -> tuple[dict, bytes] | None:
        """Open a sealed file; one sealed under older key epochs is re-sealed under the current key (atomically).

        Raises:
            KeyEpochError: its epoch's key cannot be had (the agent ignores GetKey's selectors); nothing changed.
            StateError: unreadable, or sealed by another app.
        """
        try:
            body = json.loads(_read_limited(path))
            nonce, sealed = bytes.fromhex(body.pop("nonce")), bytes.fromhex(body.pop("sealed"))
            recorded = KeyEpochs.from_answer(body["key_epochs"]) if "key_epochs" in body else None
            keys = self._keys if self._keys is not None else FixedKey(seal)
            for key, _epochs in keys.candidates(recorded):
                try:
                    secret = AESGCM(key).decrypt(nonce, sealed, canonical_json(body))
                except InvalidTag:
                    continue
                if keys.stale(recorded):  # after a KMS key rotation: re-seal under the current key
                    self._write_sealed(path, body, secret, keys.current)
                return {k: v for k, v in body.items() if k != "key_epochs"}, secret
            raise InvalidTag
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
        try:
            collateral = self._agent.collateral(quote, pccs_url=self._pccs_url, timeout_s=self._timeout_s)
        except CollateralError as exc:  # the owner can still check the quote with collateral of their own
            collateral = None
            logger.warning("key request: collateral NOT included (fetching it from %s failed: %s); "
                           "`cvm-tune dataset release` then needs --collateral FILE", self._pccs_url, exc.message)
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
        key = SUITE.decrypt(ciphertext, private_key, info=GRANT_DOMAIN + bytes.fromhex(req_hash))
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
        data = fh.read(MAX_FILE + 1)
    if len(data) > MAX_FILE:
        raise OSError(0, f"{os.fspath(path)} is larger than {MAX_FILE} bytes")
    return data


def _derive_seal(material: bytes) -> bytes:
    if len(material) < 32:
        raise KeySourceError("GetKey returned no usable sealing key material")
    return HKDF(hashes.SHA256(), 32, salt=None, info=SEAL_GETKEY_PATH.encode()).derive(bytes(material))
