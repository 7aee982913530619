"""Secure aggregation through the TEE (``federation.secure_aggregation``; docs/federated.md, "What each party sees").

1. Before round 1 the aggregator derives its age key from GetKey (``app.export.confidential.cvm_identity``) and
   attests the recipient: ``aggregator-key.json`` (``attestation.rounds.manifest.AggregatorKey``) bound by its quote,
   sent with the event log, app-compose and collateral in every train message (``aggregator-key``).
2. A client checks that quote (``app.federated.aggregator_check.aggregator_recipient``) and trains with the recipient
   added to its run's recipients: its bundle's weight files are age ciphertext to it (and to the client's own CVM key
   and its owner's recipients). The reply carries the bundle only, never plaintext tensors.
3. The aggregator decrypts each update in memory (:func:`decrypt_update`), admits, aggregates, and writes the global
   adapter encrypted to the admitted clients' CVM keys and its own (:func:`global_recipients`); the next round's
   train message carries that ciphertext (``global-adapter-age``) instead of plaintext arrays (:func:`strip_arrays`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attestation.bundle import manifest as B
from attestation.outputs import confidential as C
from attestation.rounds import manifest as R
from attestation.io.hashing import sha256_hex

from app.audit import utc_now
from app.errors import DataError
from app.export.confidential import cvm_identities, cvm_identity
from app.federated.transport import pack_bundle

KEY_FIELD = "aggregator-key"
GLOBAL_FIELD = "global-adapter-age"


@dataclass(frozen=True)
class SecureKey:
    """The aggregator CVM's age key (memory only) and the attested evidence of its recipient."""

    recipient: str
    evidence: bytes  # tar of aggregator-key.json, quote.bin, quote.hex, event_log.json, app-compose.json, collateral
    identity: str = field(repr=False)

    def identities(self) -> list[Any]:
        import pyrage

        return [pyrage.x25519.Identity.from_str(self.identity)]


def attest_key(agent: Any, ident: Any, federation_id: str, tee_mode: str, tee: Any) -> SecureKey:
    """Derive the aggregator's key and have its quote bind the recipient (``aggregator-key.json``).

    Raises:
        TeeError, KeySourceError: the guest agent failed.
    """
    identity = cvm_identity(agent.get_key)
    recipient = C.recipient_of(identity)
    doc = R.AggregatorKey.model_validate({
        "schema": R.KEY_SCHEMA, "federation_id": federation_id, "recipient": recipient, "created_at": utc_now(),
        "tee": {"mode": tee_mode, "app_id": ident.app_id, "instance_id": ident.instance_id,
                "compose_hash": ident.compose_hash, "agent_version": ident.version, "agent_rev": ident.rev}})
    raw = (json.dumps(doc.model_dump(mode="json", by_alias=True), sort_keys=True, indent=2) + "\n").encode()
    quote, event_log = agent.quote(R.key_report_data(raw))
    with tempfile.TemporaryDirectory(prefix="cvm-tune-aggregator-key-") as tmp:
        d = Path(tmp)
        (d / R.KEY_DOC).write_bytes(raw)
        (d / B.QUOTE_BIN).write_bytes(quote)
        (d / B.QUOTE_HEX).write_text(quote.hex() + "\n")
        (d / B.EVENT_LOG).write_text(event_log)
        (d / B.APP_COMPOSE).write_bytes(ident.app_compose.encode())
        coll, _missing = agent.bundle_collateral(quote, mode=tee.collateral, pccs_url=tee.pccs_url, timeout_s=tee.timeout_s)
        if coll is not None:
            (d / B.COLLATERAL).write_text(coll)
        evidence = pack_bundle(d, tuple(sorted(p.name for p in d.iterdir())))
    return SecureKey(recipient, evidence, identity)


def decrypt_update(bundle: Path, m: B.Manifest, key: SecureKey) -> bytes:
    """The plaintext adapter weights of an admitted client's bundle, decrypted in memory and checked against the
    plaintext hash its (already verified) manifest binds.

    Raises:
        DataError: the update is not encrypted to the aggregator, or does not decrypt to the bound plaintext.
    """
    conf = m.confidentiality
    if conf is None or key.recipient not in conf.recipients:
        raise DataError("the update is not encrypted to the aggregator's attested key (secure aggregation)")
    data = C.decrypt((bundle / B.weights_file(m)).read_bytes(), key.identities())
    if data is None or sha256_hex(data) != conf.plaintext_sha256.get(B.WEIGHTS):
        raise DataError("the update does not decrypt with the aggregator's key to the plaintext its manifest binds")
    return data


def global_recipients(admitted: Iterable[Any], key: SecureKey) -> tuple[str, ...]:
    """Who can read the round's global adapter: the admitted clients' CVM keys and the aggregator's."""
    return tuple(sorted({a.cvm_recipient for a in admitted if a.cvm_recipient} | {key.recipient}))


def strip_arrays(messages: Iterable[Any]) -> list[Any]:
    """The train messages without their plaintext arrays (the global adapter travels as ``global-adapter-age``)."""
    from flwr.app import RecordDict

    out = []
    for msg in messages:
        msg.content = RecordDict({name: rec for name, rec in msg.content.items() if name not in msg.content.array_records})
        out.append(msg)
    return out


def decrypt_global(cfg: Any, ciphertext: Any, ram_parent: Path) -> tuple[Path, bytes]:
    """A client: the global adapter sent as ciphertext, decrypted with this CVM's key into a new RAM directory
    (``ram_parent``: the scratch's file system); returns (that directory, the plaintext bytes).

    Raises:
        DataError: not bytes, or this CVM's key does not open it (it was not admitted in the previous round).
    """
    from app.tee import open_guest_agent

    if not isinstance(ciphertext, bytes):
        raise DataError("the aggregator's encrypted global adapter is not bytes")
    import pyrage

    with open_guest_agent(cfg.tee) as agent:
        identity = cvm_identity(agent.get_key)
        data = C.decrypt(ciphertext, [pyrage.x25519.Identity.from_str(identity)])
        if data is None:  # encrypted to this CVM's recipient of before a KMS key rotation
            older = cvm_identities(agent)[1:]
            data = C.decrypt(ciphertext, [pyrage.x25519.Identity.from_str(i) for i in older]) if older else None
    if data is None:
        raise DataError("the global adapter is not encrypted to this CVM's key (not admitted in the previous round?)")
    d = Path(tempfile.mkdtemp(prefix="cvm-tune-global-", dir=ram_parent))
    try:
        (d / "adapter_model.safetensors").write_bytes(data)
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise
    return d, data
