"""The aggregator's gate: a client's reply is aggregated only if its bundle verifies and belongs to this round.

In order (the first failure is the recorded reason):

1. the reply is not a Flower error and carries a bundle, adapter weights and a client name the federation lists,
   not already admitted this round;
2. the bundle verifies with :func:`attestation.verify_bundle` under the client policy (trusted root, TCB,
   measurements; every check, the simulator's test CA only in simulator mode);
3. its compose-hash is in ``federation.client_compose_hashes``;
4. its dataset was signed by one of that client's owner keys;
5. its manifest's ``federation`` block names this round, this round's nonce, the global adapter the round sent and
   the FedProx ``mu`` (a bundle replayed from another round, or trained from another adapter, fails here);
6. the adapter weights in the reply are exactly the bundle's ``adapter/adapter_model.safetensors``.

The weight a client gets is the trainable-token count from its verified manifest, never the number it sent.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attestation import bundle as B
from attestation import verify_bundle
from attestation.hashing import sha256_file, sha256_hex
from attestation.policy import Policy
from attestation.round_bundle import client_privacy

from app.errors import CvmTuneError
from app.federated.settings import FederationSettings
from app.federated.transport import same_arrays, unpack_bundle

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
    arrays: Any  # flwr.app.ArrayRecord
    privacy: tuple[float | None, float | None] = (None, None)  # (epsilon, delta) of the client's DP-SGD


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

    def __init__(self, settings: FederationSettings, policy: Policy, workdir: Path) -> None:
        self.settings, self.policy, self.workdir = settings, policy, workdir

    def check(self, msg: Any, terms: RoundTerms, admitted: set[str]) -> Admitted | Rejected:
        """Admit or reject one reply (``admitted``: client names already admitted this round)."""
        node = int(msg.metadata.src_node_id)
        name = ""
        try:
            if msg.has_error():
                raise _Reject(f"the client failed: {msg.error.reason}")
            content = msg.content
            meta = content.config_records.get("bundle")
            if meta is None or "client" not in meta or "tar" not in meta or len(content.array_records) != 1:
                raise _Reject("the reply carries no bundle, client name or adapter weights")
            name = str(meta["client"])[:100]
            if name not in self.settings.clients:
                raise _Reject(f"client {name!r} is not in federation.clients")
            if name in admitted:
                raise _Reject(f"client {name!r} already has a bundle admitted in round {terms.round}")
            dest = self.workdir / f"round-{terms.round:04d}" / f"node-{node}"
            bundle = unpack_bundle(bytes(meta["tar"]), dest)  # type: ignore[arg-type]
            return self._check_bundle(name, node, bundle, next(iter(content.array_records.values())), terms)
        except _Reject as exc:
            return Rejected(name, node, str(exc)[:MAX_REASON])
        except CvmTuneError as exc:
            return Rejected(name, node, exc.message[:MAX_REASON])

    def forget(self, round_: int) -> None:
        """Remove the bundles unpacked for ``round_`` (the admitted ones are in its round bundle by now)."""
        shutil.rmtree(self.workdir / f"round-{round_:04d}", ignore_errors=True)

    def _check_bundle(self, name: str, node: int, bundle: Path, arrays: Any, terms: RoundTerms) -> Admitted:
        verdict = verify_bundle(bundle, policy=self.policy, now=int(time.time()))
        if not verdict.accepted:
            c = verdict.failed[0]
            raise _Reject(f"bundle rejected under policy {self.policy.name!r}: {c.name}: {c.detail}")
        raw = (bundle / B.MANIFEST).read_bytes()
        m = B.Manifest.model_validate_json(raw)
        if m.tee.compose_hash not in self.settings.client_compose_hashes:
            raise _Reject(f"compose-hash {m.tee.compose_hash[:16]}… is not in federation.client_compose_hashes")
        owners = self.settings.clients[name].owner_public_keys
        if m.dataset.owner_public_key not in owners:
            raise _Reject(f"its dataset is not signed by an owner key of client {name!r}")
        _check_terms(m.federation, terms)
        adapter = bundle / B.ADAPTER_FILES[1]
        if (diff := same_arrays(arrays, adapter)) is not None:
            raise _Reject(f"the adapter weights sent do not match the bundle: {diff}")
        tokens = int((m.dataset.validation or {}).get("trainable_tokens", 0))
        if tokens < 1:
            raise _Reject("the manifest records no trainable tokens")
        return Admitted(name, node, bundle, m.run_id, sha256_hex(raw), sha256_file(bundle / B.QUOTE_BIN),
                        sha256_file(adapter), tokens, arrays, client_privacy(m))


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
