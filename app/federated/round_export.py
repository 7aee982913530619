"""Write a round bundle (``attestation.rounds.manifest``): the aggregate, the admitted client bundles, the rejections,
bound into the aggregator's own quote, verified the way a relying party will, and only then published.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attestation import DEFAULT_POLICY
from attestation.bundle import manifest as B
from attestation.rounds import manifest as R
from attestation.bundle.verify import INTEGRITY_CHECKS
from attestation.io.hashing import sha256_file, sha256_hex
from attestation.policy import Policy, simulator_policy
from attestation.rounds.verify import verify_round

import app
from app import export
from app.audit import utc_now
from app.errors import ExportError
from app.federated.admission import Admitted, Rejected
from app.federated.secure import global_recipients
from app.federated.transport import arrays_to_safetensors
from attestation.outputs import confidential as C
from app.fsutil import staged_dir
from app.tee import GuestAgent, Identity

logger = logging.getLogger(__name__)

# Integrity checks of a round bundle: its own bytes, whatever the relying party's roots and pins.
ROUND_INTEGRITY = INTEGRITY_CHECKS | {"round.files", "round.schema", "round.file_hashes", "round.terms",
                                      "round.weights", "round.aggregate"}


@dataclass(frozen=True)
class Aggregator:
    """The aggregator CVM: its guest agent and identity, and how it is configured."""

    agent: GuestAgent
    ident: Identity
    simulated: bool
    tee_mode: str
    collateral: str  # tee.collateral: auto | none
    pccs_url: str
    timeout_s: float
    client_policy: Policy
    secure: Any = None  # app.federated.secure.SecureKey: secure aggregation (the global adapter is ciphertext)


@dataclass(frozen=True)
class RoundRecord:
    federation_id: str
    round: int
    nonce: str
    strategy: dict[str, Any]
    min_clients: int
    global_in_sha256: str | None
    previous_round_sha256: str | None


def export_round(out: Path, agg: Aggregator, rec: RoundRecord, aggregate: Any, admitted: list[Admitted],
                 rejected: list[Rejected]) -> tuple[Path, str]:
    """Publish ``out/<federation_id>/round-<NNNN>``; returns (its path, sha256 of its round-manifest.json).

    Raises:
        ExportError: writing failed, or the staged round bundle fails its own verification (nothing published).
    """
    final = out / rec.federation_id / f"round-{rec.round:04d}"
    try:
        with staged_dir(final) as stage:
            (stage / "adapter").mkdir()
            weights = arrays_to_safetensors(aggregate)
            recipients = global_recipients(admitted, agg.secure) if agg.secure else ()
            stored = C.encrypt(weights, recipients) if recipients else weights  # secure: as <name>.age
            (stage / R.global_adapter(bool(recipients))).write_bytes(stored)
            (stage / B.APP_COMPOSE).write_bytes(agg.ident.app_compose.encode())
            for a in admitted:
                shutil.copytree(a.bundle, stage / R.CLIENTS_DIR / a.client)
            manifest = _manifest_bytes(agg, rec, admitted, rejected, stage, sha256_hex(weights), recipients)
            (stage / R.ROUND_MANIFEST).write_bytes(manifest)
            quote, event_log = agg.agent.quote(R.round_report_data(manifest))
            (stage / B.QUOTE_BIN).write_bytes(quote)
            (stage / B.QUOTE_HEX).write_text(quote.hex() + "\n")
            (stage / B.EVENT_LOG).write_text(event_log)
            if (mr_config := agg.agent.mr_config_document(quote)) is not None:  # dstack 0.6, MRCONFIGID v3
                (stage / B.MR_CONFIG).write_bytes(mr_config)
            coll, missing = agg.agent.bundle_collateral(quote, mode=agg.collateral, pccs_url=agg.pccs_url,
                                                        timeout_s=agg.timeout_s)
            if coll is not None:
                (stage / B.COLLATERAL).write_text(coll)
            else:
                logger.warning("round %d: collateral NOT included (%s); the round bundle is exported without it, so "
                               "its verdict fails collateral.window until verified with --collateral FILE",
                               rec.round, missing)
            _self_verify(stage, agg, rec.round)
    except OSError as exc:
        raise ExportError(f"writing the round bundle {final} failed: {exc.strerror or type(exc).__name__}",
                          fix="free space on the output volume; no partial round bundle was kept") from exc
    return final, sha256_hex(manifest)


def _manifest_bytes(agg: Aggregator, rec: RoundRecord, admitted: list[Admitted], rejected: list[Rejected],
                    stage: Path, plaintext_sha256: str, recipients: tuple[str, ...]) -> bytes:
    total = sum(a.trainable_tokens for a in admitted)
    ident = agg.ident
    adapter = R.global_adapter(bool(recipients))  # secure aggregation: adapter_model.safetensors.age
    doc = {
        "schema": R.ROUND_SCHEMA, "federation_id": rec.federation_id, "round": rec.round, "nonce": rec.nonce,
        "created_at": utc_now(),
        "code": {"package": "cvm-tune", "version": app.__version__, "source_sha256": export.source_digest()},
        "tee": {"mode": agg.tee_mode, "app_id": ident.app_id, "instance_id": ident.instance_id,
                "compose_hash": ident.compose_hash, "agent_version": ident.version, "agent_rev": ident.rev},
        "strategy": rec.strategy, "min_clients": rec.min_clients,
        "global_adapter_in_sha256": rec.global_in_sha256,
        "global_adapter_sha256": plaintext_sha256,  # = the file's hash, unless secure aggregation encrypted it
        "previous_round_sha256": rec.previous_round_sha256,
        "admitted": [{"client": a.client, "run_id": a.run_id, "manifest_sha256": a.manifest_sha256,
                      "quote_sha256": a.quote_sha256, "adapter_sha256": a.adapter_sha256,
                      "trainable_tokens": a.trainable_tokens, "weight": a.trainable_tokens / total,
                      "privacy_epsilon": a.privacy[0], "privacy_delta": a.privacy[1]} for a in admitted],
        "rejected": [{"client": r.client, "node_id": r.node_id, "reason": r.reason} for r in rejected],
        "files": {B.APP_COMPOSE: sha256_file(stage / B.APP_COMPOSE),
                  adapter: sha256_file(stage / adapter)},
        **({"aggregator_recipient": agg.secure.recipient, "confidentiality": {
            "recipients": list(recipients), "plaintext_sha256": plaintext_sha256}} if recipients else {}),
    }
    data = R.RoundManifest.model_validate(doc).model_dump(mode="json", by_alias=True)
    return (json.dumps(data, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode()


def _self_verify(stage: Path, agg: Aggregator, round_: int) -> None:
    """The simulator: every check under its test-CA policy; a CVM: every integrity check under the client policy."""
    policy = (simulator_policy(agg.agent.simulator_root_der()) if agg.simulated
              else agg.client_policy or DEFAULT_POLICY)
    verdict = verify_round(stage, policy=policy, now=int(time.time()),
                           identities=agg.secure.identities() if agg.secure else None)  # recomputes the aggregate
    failed = [f"{c.name}: {c.detail}" for c in verdict.failed if agg.simulated or c.name in ROUND_INTEGRITY
              or c.name.startswith("client.")]
    if failed:
        raise ExportError(f"the round {round_} bundle fails its own verification: {'; '.join(failed[:3])}",
                          fix="nothing was published; report this with the aggregator's log")


def head_files(round_dir: Path) -> tuple[str, ...]:
    """The files of a round bundle that attest it without its client bundles (``verify_round_head``)."""
    names = (R.ROUND_MANIFEST, B.QUOTE_BIN, B.QUOTE_HEX, B.EVENT_LOG, B.APP_COMPOSE, B.COLLATERAL, B.MR_CONFIG)
    return tuple(n for n in names if (round_dir / n).is_file())
