"""The aggregator's gate: a client's reply is aggregated only if its bundle verifies and belongs to this round.

In order (the first failure is the recorded reason):

1. the reply is not a Flower error and carries a client name the federation lists (not already admitted this
   round), the bundle as tar bytes and one ``ArrayRecord`` of float tensors that decode;
2. the bundle verifies with :func:`attestation.verify_bundle` under the client policy (trusted root, TCB,
   measurements; every check, the simulator's test CA only in simulator mode);
3. its compose-hash is in ``federation.client_compose_hashes``;
4. the name the reply claims is the ``federation.client_name`` of the bundle's attested ``config.json``: a name is
   believed only when the client's own quote vouches for it;
5. its dataset was signed by one of that client's owner keys;
6. its manifest's ``federation`` block names this round, this round's nonce, the global adapter the round sent and
   the FedProx ``mu`` (a bundle replayed from another round, or trained from another adapter, fails here);
7. the adapter weights in the reply are exactly the bundle's ``adapter/adapter_model.safetensors``; with secure
   aggregation (``app.federated.secure``) the reply carries no weights at all, and the bundle's adapter
   (``adapter/adapter_model.safetensors.age``), encrypted to the aggregator's attested key, is decrypted in memory
   and must be the plaintext its manifest binds.

Any failure while checking one reply, expected or not, rejects that reply with a recorded reason: one client can
never fail the round for the others. The weight a client gets is the trainable-token count from its verified
manifest, never the number it sent, and what is aggregated is the verified bundle's own adapter file.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attestation.bundle import manifest as B
from attestation import verify_bundle
from attestation.errors import AttestationError
from attestation.io.hashing import sha256_file, sha256_hex
from attestation.policy import Policy
from attestation.rounds.manifest import client_privacy, quote_identity
from attestation.io.safe_yaml import parse_json

from app.errors import CvmTuneError
from app.config.federation import CLIENT_NAME, FederationSettings
from app.federated.transport import decode_arrays, diff_arrays, load_adapter, to_record, unpack_bundle

log = logging.getLogger("cvm-tune.federated")
WEIGHT_KEY = "trainable-tokens"
MAX_REASON = 300


@dataclass(frozen=True)
class Admitted:
    client: str
    node_id: int
    bundle: Path
    run_id: str
    manifest_sha256: str
    quote_sha256: str
    adapter_sha256: str
    trainable_tokens: int
    arrays: Any  # flwr.app.ArrayRecord: the verified bundle's adapter tensors (equal to those the client sent)
    privacy: tuple[float | None, float | None] = (None, None)  # (epsilon, delta) of the client's DP-SGD
    cvm_recipient: str | None = None  # the client CVM's age key (confidential bundle): reads the next global adapter


@dataclass(frozen=True)
class Rejected:
    client: str
    node_id: int
    reason: str


@dataclass(frozen=True)
class RoundTerms:
    """What every admitted bundle must record (the ``federation`` manifest block)."""

    round: int
    nonce: str
    global_adapter_sha256: str | None
    proximal_mu: float


class _Reject(Exception):
    pass


class Admission:
    """Checks replies against the federation's settings and client policy; unpacks bundles under ``workdir``."""

    def __init__(self, settings: FederationSettings, policy: Policy, workdir: Path, secure: Any = None) -> None:
        self.settings, self.policy, self.workdir = settings, policy, workdir
        self.secure = secure  # app.federated.secure.SecureKey: updates arrive encrypted to it

    def check(self, msg: Any, terms: RoundTerms, admitted: set[str]) -> Admitted | Rejected:
        """Admit or reject one reply (``admitted``: client names already admitted this round). Never raises for
        anything the reply holds."""
        node, name, scratch = _node_id(msg), "", None
        try:
            if msg.has_error():
                raise _Reject(f"the client failed: {str(msg.error.reason)[:200]}")
            name, tar, sent = _reply_parts(msg.content, secure=self.secure is not None)
            if name not in self.settings.clients:
                raise _Reject(f"client {name!r} is not in federation.clients")
            if name in admitted:
                raise _Reject(f"client {name!r} already has a bundle admitted in round {terms.round}")
            round_dir = self.workdir / f"round-{terms.round:04d}"
            round_dir.mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(prefix=f"node-{node}-", dir=round_dir))
            bundle = unpack_bundle(tar, scratch / "bundle")
            return self._check_bundle(name, node, bundle, sent, terms)
        except _Reject as exc:
            reason = str(exc)
        except (CvmTuneError, AttestationError) as exc:
            reason = exc.message
        except Exception as exc:  # noqa: BLE001 - one client's reply must never fail the round for the others
            log.debug("admission of node %d failed", node, exc_info=True)
            reason = f"its reply could not be checked ({type(exc).__name__}: {str(exc)[:150]})"
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        return Rejected(name, node, reason[:MAX_REASON])

    def forget(self, round_: int) -> None:
        """Remove the bundles unpacked for ``round_`` (the admitted ones are in its round bundle by now)."""
        shutil.rmtree(self.workdir / f"round-{round_:04d}", ignore_errors=True)

    def _check_bundle(self, name: str, node: int, bundle: Path, sent: dict[str, Any], terms: RoundTerms) -> Admitted:
        if not (bundle / B.MANIFEST).is_file():
            raise _Reject(f"the bundle has no {B.MANIFEST}: not a cvm-tune export bundle")
        verdict = verify_bundle(bundle, policy=self.policy, now=int(time.time()))
        if not verdict.accepted:
            c = verdict.failed[0]
            raise _Reject(f"bundle rejected under policy {self.policy.name!r}: {c.name}: {c.detail}")
        raw = (bundle / B.MANIFEST).read_bytes()
        m = B.Manifest.model_validate_json(raw)
        if m.tee.compose_hash not in self.settings.client_compose_hashes:
            raise _Reject(f"compose-hash {m.tee.compose_hash[:16]}… is not in federation.client_compose_hashes")
        if (attested := _attested_name(bundle)) != name:
            raise _Reject(f"the reply names client {name!r}, but its bundle's attested config names "
                          f"{str(attested)[:100]!r}")
        owners = self.settings.clients[name].owner_public_keys
        if m.dataset.owner_public_key not in owners:
            raise _Reject(f"its dataset is not signed by an owner key of client {name!r}")
        _check_terms(m.federation, terms)
        adapter = bundle / B.weights_file(m)  # encrypted: adapter_model.safetensors.age
        if self.secure is not None:  # decrypted in memory with the aggregator's key; nothing was sent in plaintext
            from app.federated.secure import decrypt_update

            tensors = load_adapter(decrypt_update(bundle, m, self.secure))
        else:
            tensors = load_adapter(adapter)
            if (diff := diff_arrays(sent, tensors)) is not None:
                raise _Reject(f"the adapter weights sent do not match the bundle: {diff}")
        tokens = int((m.dataset.validation or {}).get("trainable_tokens", 0))
        if tokens < 1:
            raise _Reject("the manifest records no trainable tokens")
        quote_id = quote_identity((bundle / B.QUOTE_BIN).read_bytes())
        return Admitted(name, node, bundle, m.run_id, sha256_hex(raw), quote_id, sha256_file(adapter), tokens,
                        to_record(tensors), client_privacy(m),
                        m.confidentiality.cvm_recipient if m.confidentiality else None)


def _node_id(msg: Any) -> int:
    try:
        return int(msg.metadata.src_node_id)
    except Exception:  # noqa: BLE001 - Flower sets it; a reply without one is recorded as node 0
        return 0


def _reply_parts(content: Any, *, secure: bool = False) -> tuple[str, bytes, dict[str, Any]]:
    """The claimed client name, the bundle's tar bytes and the decoded adapter tensors of a reply (secure
    aggregation: none; a reply that sends plaintext weights is refused)."""
    meta = content.config_records.get("bundle")
    arrays = [r for r in content.array_records.values() if len(r)]
    if secure and arrays:
        raise _Reject("the reply sends plaintext adapter weights in a secure-aggregation round")
    if meta is None or (not secure and len(content.array_records) != 1):
        raise _Reject("the reply carries no bundle or adapter weights")
    if not secure and not arrays:
        raise _Reject("the reply carries no plaintext weights (the client's weights are encrypted: its dataset names "
                      "recipients): run the federation with federation.secure_aggregation")
    name, tar = meta.get("client"), meta.get("tar")
    if not isinstance(name, str) or not re.fullmatch(CLIENT_NAME, name):
        raise _Reject("the reply carries no valid client name")
    if not isinstance(tar, bytes):
        raise _Reject(f"the reply's bundle is a {type(tar).__name__}, not tar bytes")
    return name, tar, {} if secure else decode_arrays(arrays[0])


def _attested_name(bundle: Path) -> object:
    """``federation.client_name`` in the bundle's ``config.json`` (hashed in the quote-bound manifest)."""
    doc = parse_json((bundle / B.CONFIG).read_bytes(), "the bundle's config.json", _Reject, max_bytes=1 << 20)
    fed = doc.get("federation") if isinstance(doc, dict) else None
    return fed.get("client_name") if isinstance(fed, dict) else None


def _check_terms(fed: B.FederationInfo | None, terms: RoundTerms) -> None:
    if fed is None:
        raise _Reject("the bundle was not trained for a federated round (no federation block)")
    if (fed.round, fed.nonce) != (terms.round, terms.nonce):
        raise _Reject(f"the bundle is for round {fed.round} nonce {fed.nonce[:16]}…, not round {terms.round} nonce "
                      f"{terms.nonce[:16]}… (replayed or stale)")
    if fed.global_adapter_sha256 != terms.global_adapter_sha256:
        raise _Reject("the bundle started from another global adapter than this round's")
    if fed.proximal_mu != terms.proximal_mu:
        raise _Reject(f"the bundle trained with proximal_mu {fed.proximal_mu}, not {terms.proximal_mu}")
