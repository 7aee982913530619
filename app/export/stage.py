"""The export stage: stage every bundle file, commit to them in the audit chain, bind the manifest into a
quote, verify the staged bundle the way a relying party will, and only then publish it under ``exports/``.

A bundle appears under its final name complete (staged, fsynced, renamed) and only if it passes its own
verification: for the simulator, the whole test-CA policy; in a CVM, every integrity check of the default
policy (:data:`attestation.bundle.verify.INTEGRITY_CHECKS`).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attestation import DEFAULT_POLICY, Verdict, verify_bundle
from attestation.bundle import manifest as B
from attestation.bundle.anchors import of_chain
from attestation.bundle.verify import INTEGRITY_CHECKS
from attestation.io.hashing import files_digest, sha256_file
from attestation.policy import policy_file_text, simulator_policy

import app
from app import export
from app.export import confidential, report
from app.audit import AuditLog, AuditRecorder, utc_now
from app.config import Config
from app.errors import ExportError
from app.fsutil import atomic_write_bytes, staged_dir
from app.export.card import card_inputs, model_card
from app.training.dpo import settings_block as dpo_settings
from app.tee import GuestAgent, Identity

SIMULATOR_POLICY_FILE = "simulator-test-policy.yaml"
Phase = Callable[[str], AbstractContextManager[None]]


@dataclass(frozen=True)
class ExportInputs:
    """Everything the bundle records, gathered by the stages before it."""

    cfg: Config
    out: Path
    run_id: str
    started_at: str
    code_sha: str
    config_bytes: bytes
    agent: GuestAgent
    ident: Identity
    simulated: bool
    compose_bytes: bytes
    build: dict[str, Any]
    dataset: dict[str, Any]
    rows_report: Any
    chunks: int
    base_dir: Path
    base_name: str
    base_tree: str
    base_files: dict[str, str]
    train: Any  # app.training.TrainResult
    gpu: Any  # app.run.gpu evidence
    log: AuditLog
    recorder: AuditRecorder
    slot: str | None
    lineage: dict[str, str] | None = None  # the promoted bundle this run continued from (app.run.continual)
    evaluation: dict[str, Any] | None = None  # the promotion gate's scores and decision
    federation: dict[str, Any] | None = None  # the federated round this run trained for (app.federated)
    op_chain: dict[str, Any] | None = None  # a training-API checkpoint's op chain (app.api.proof.bundle)
    confidential: Any = None  # app.export.confidential.Plan: weights encrypted to recipients (None: plaintext)


@dataclass(frozen=True)
class Published:
    bundle: Path
    verdicts: list[tuple[str, Verdict]]
    policy_file: Path | None
    report: dict[str, Any]
    audit_head: str


def export_bundle(x: ExportInputs, *, phase: Phase, timings: dict[str, float],
                  progress: Callable[[str], None]) -> Published:
    """Build, attest, self-verify and publish ``exports/<run_id>``.

    Raises:
        ExportError: writing failed, or the staged bundle failed its own verification (nothing published; the run
            stays resumable).
    """
    final = x.out / "exports" / x.run_id
    ts, result = x.cfg.training, x.train
    with phase("export"), _disk_errors(f"writing the export bundle {final}"), staged_dir(final) as stage:
        if x.confidential is None:
            (stage / "adapter").mkdir()
            for p in result.adapter_dir.iterdir():
                shutil.copyfile(p, stage / "adapter" / p.name)
        (stage / B.CONFIG).write_bytes(x.config_bytes)
        (stage / B.APP_COMPOSE).write_bytes(x.compose_bytes)
        (stage / B.GPU_EVIDENCE).write_bytes(x.gpu.data)
        if x.gpu.boot is not None:  # dstack 0.6: the boot gate's evidence, bound by RTMR3, not by the manifest
            (stage / B.GPU_BOOT_EVIDENCE).write_bytes(x.gpu.boot)
        model_dirs = (finish_model_dirs(x, stage) if x.confidential is None  # tokenizer, merged/, model.sig
                      else confidential.model_dirs(x.confidential, stage, result.adapter_dir,  # built in RAM, encrypted
                                                   lambda plain: finish_model_dirs(x, plain)))
        (stage / B.MODEL_CARD).write_bytes(model_card(card_inputs_for(x, model_dirs)) + confidential.card_section(
            model_dirs.confidentiality))
        effective_batch = result.batch.get("effective", ts.per_device_batch_size * ts.gradient_accumulation_steps)
        run_report = report.build(run_id=x.run_id, slot=x.slot, timings=timings, train=result,
                                  effective_batch_size=effective_batch, rows=x.rows_report,
                                  checks=_checks(x), validation=x.dataset["validation"])
        report_files = report.write(stage, run_report)
        artifacts = {rel: sha256_file(stage / rel) for rel in B.artifact_files(x.confidential is not None)}
        with phase("audit"):
            x.recorder.record(x.run_id, "export", {"artifacts_sha256": files_digest(artifacts)})
        entries = x.log.run_slice(x.run_id)
        (stage / B.AUDIT).write_bytes(b"".join(e.line + b"\n" for e in entries))
        anchors = of_chain(x.log.anchors(), entries) if x.recorder.rtmr3 != "emit_event" else None
        if anchors is not None:  # no RTMR3 measurement: the slice's checkpoints carry their quotes
            (stage / B.AUDIT_ANCHORS).write_bytes(b"".join(a.line + b"\n" for a in anchors))
        manifest = export.manifest_bytes(_manifest(x, stage, artifacts, report_files, entries, effective_batch,
                                                    model_dirs, anchors))
        (stage / B.MANIFEST).write_bytes(manifest)
        with phase("quote"):
            quote, event_log = x.agent.quote(B.manifest_report_data(manifest))
        (stage / B.QUOTE_BIN).write_bytes(quote)
        (stage / B.QUOTE_HEX).write_text(quote.hex() + "\n")
        (stage / B.EVENT_LOG).write_text(event_log)
        if (mr_config := x.agent.mr_config_document(quote)) is not None:  # dstack 0.6, MRCONFIGID v3
            (stage / B.MR_CONFIG).write_bytes(mr_config)
        with phase("collateral"):
            collateral, missing = x.agent.bundle_collateral(quote, mode=x.cfg.tee.collateral, pccs_url=x.cfg.tee.pccs_url,
                                                            timeout_s=x.cfg.tee.timeout_s)
        if collateral is not None:
            (stage / B.COLLATERAL).write_text(collateral)
        else:
            progress(f"collateral: NOT included ({missing}); the bundle is exported without it, so its verdict "
                     "fails collateral.window until verified with --collateral FILE (`cvm-tune collateral QUOTE -o "
                     "FILE` fetches it)")
        # Check our own work the way a relying party will, before anything is published.
        with phase("self_verify"):
            verdicts, policy_file = self_verify(stage, x.out, x.agent, x.simulated,
                                                identities=x.confidential.identities() if x.confidential else None)
        publish_gate(verdicts, x.simulated, x.run_id)
    return Published(final, verdicts, policy_file, run_report, entries[-1].hash)


def finish_model_dirs(x: ExportInputs, stage: Path) -> export.ModelDirs:
    """Make ``stage/adapter`` a loadable PEFT repository (the base's tokenizer), write ``stage/merged`` when
    ``export.merged`` is set, and sign each with the run's GetKey-derived key (``model.sig``)."""
    return export.finish_model_dirs(stage, run_id=x.run_id, base_dir=x.base_dir, get_key=x.agent.get_key,
                                    merged=x.cfg.export.merged,
                                    max_shard_size=x.cfg.export.merged_max_shard_size)


def card_inputs_for(x: ExportInputs, model_dirs: export.ModelDirs) -> Any:
    """What the bundle's model card (README.md) says: values the manifest also records."""
    return card_inputs(x.cfg, x.run_id, x.simulated, x.base_name, x.base_tree, x.dataset, x.train, x.code_sha,
                       model_dirs.public_key_pem)


def _checks(x: ExportInputs) -> list[str]:
    """The report's list of what this run checked (names and counts, never data)."""
    r, ts = x.train, x.cfg.training
    return [
        f"guest agent {x.ident.version}: compose-hash consistent with its app-compose",
        f"dataset header and all {x.chunks} chunks authenticated before any row was used",
        f"rows validated: {x.rows_report.rows_kept} of {x.rows_report.rows_total} kept",
        "base model tree hash " + ("matches the pinned sha256" if x.cfg.base_model.sha256 else "recorded (not pinned)"),
        (f"resumed from sealed checkpoint step {r.resumed_from_step} (manifest and blob hashes verified)"
         if r.resumed_from_step else "trained from step 0"),
        *(f"refused {name}: {why}" for name, why in r.rejected_checkpoints),
        "loss watchdog: " + ("no NaN/Inf or spike" if ts.loss_watchdog.enabled else "disabled"),
        *([f"DP-SGD: (ε, δ) = ({r.privacy['epsilon']:.4g}, {r.privacy['delta']:.3g}) spent in {r.privacy['steps']} steps"]
          if r.privacy else []),
    ]


def _manifest(x: ExportInputs, stage: Path, artifacts: dict[str, str], report_files: dict[str, Path],
              entries: list[Any], effective_batch: int, model_dirs: export.ModelDirs,
              anchors: list[Any] | None) -> dict[str, Any]:
    r, ts, ident = x.train, x.cfg.training, x.ident
    return {
        "schema": B.MANIFEST_SCHEMA, "run_id": x.run_id, "started_at": x.started_at, "created_at": utc_now(),
        "code": {"package": "cvm-tune", "version": app.__version__, "source_sha256": x.code_sha},
        "backend": {"name": r.backend, "device": r.device, "libraries": export.library_versions(r.library_versions),
                    "cpu_threads": _torch_threads()},
        "base_model": {"name": x.base_name, "source": x.cfg.base_model.source, "tree_sha256": x.base_tree,
                       "files": x.base_files, "hub_id": x.cfg.base_model.hub_id, "revision": x.cfg.base_model.revision},
        "dataset": x.dataset,
        "tee": {"mode": x.cfg.tee.mode, "app_id": ident.app_id, "instance_id": ident.instance_id,
                "compose_hash": ident.compose_hash, "agent_version": ident.version, "agent_rev": ident.rev},
        "training": {"seed": ts.seed, "global_step": r.global_step, "resumed_from_step": r.resumed_from_step,
                     "losses": r.losses, "train_runtime_s": round(r.train_runtime_s, 3), "tokens_seen": r.tokens_seen,
                     "effective_batch_size": effective_batch, "batch": r.batch or None,
                     "eval_losses": r.eval_losses or None, "objective": ts.objective, "dpo": dpo_settings(ts)},
        "audit": {"head": entries[-1].hash, "start_prev": entries[0].prev, "first_seq": entries[0].seq,
                  "entries": len(entries), "rtmr3": x.recorder.rtmr3 or "unsupported",
                  "anchors": None if anchors is None else len(anchors)},
        "files": {**artifacts, B.AUDIT: sha256_file(stage / B.AUDIT), B.GPU_EVIDENCE: x.gpu.info.evidence_sha256,
                  **({} if anchors is None else {B.AUDIT_ANCHORS: sha256_file(stage / B.AUDIT_ANCHORS)}),
                  **{rel: sha256_file(p) for rel, p in report_files.items()}, **model_dirs.files},
        "gpu": x.gpu.info.model_dump(mode="json"),
        "build": x.build,
        "lineage": x.lineage,
        "evaluation": x.evaluation,
        "signing": model_dirs.signing,
        "privacy": r.privacy,  # DP-SGD as run (app.training.privacy.outcome); None: trained without DP
        "federation": x.federation,
        "confidentiality": model_dirs.confidentiality,
        **({"op_chain": x.op_chain} if x.op_chain is not None else {}),  # training-API checkpoints only
    }


@contextmanager
def _disk_errors(what: str) -> Iterator[None]:
    """Disk full (or any OS error) while writing the bundle: a clean ExportError, nothing half-written kept."""
    try:
        yield
    except OSError as exc:
        raise ExportError(f"{what} failed: {exc.strerror or type(exc).__name__}",
                          fix="free space on the output volume and run again; no partial bundle was kept") from exc


def self_verify(bundle: Path, out: Path, agent: GuestAgent, simulated: bool,
                identities: list[Any] | None = None) -> tuple[list[tuple[str, Verdict]], Path | None]:
    """Verify a bundle under the default policy and, for the simulator, its test-CA policy (listed first); with
    ``identities`` (the CVM's age key), also the plaintext of encrypted weights and their signature."""
    now = int(time.time())
    verdicts = []
    policy_file = None
    if simulated:
        policy = simulator_policy(agent.simulator_root_der())
        policy_file = out / SIMULATOR_POLICY_FILE
        atomic_write_bytes(policy_file, policy_file_text(policy).encode())
        verdicts.append((str(policy_file), verify_bundle(bundle, policy=policy, now=now, identities=identities)))
    verdicts.append(("default", verify_bundle(bundle, policy=DEFAULT_POLICY, now=now, identities=identities)))
    return verdicts, policy_file


def publish_gate(verdicts: list[tuple[str, Verdict]], simulated: bool, run_id: str) -> None:
    """Publish only a bundle that passes its own verification: for the simulator, the whole test-CA policy;
    in a CVM, every integrity check of the default policy (trust in roots, TCB and collateral dates is the
    relying party's policy, reported in the verdict, not a reason to withhold the bundle).

    Raises:
        ExportError: a check failed; nothing is published and the run stays resumable.
    """
    name = verdicts[0][0]
    failed = gate_failures(verdicts, simulated)
    if failed:
        detail = "; ".join(failed[:3])
        raise ExportError(f"the bundle of run {run_id} fails its own verification ({name} policy): {detail}",
                          fix="nothing was published; run again to resume (cvm-tune run --run-id "
                          f"{run_id}), or rerun with --debug and report it")


def gate_failures(verdicts: list[tuple[str, Verdict]], simulated: bool) -> list[str]:
    """``"check: detail"`` for every check that withholds a bundle (see :func:`publish_gate`)."""
    return [f"{c.name}: {c.detail}" for c in verdicts[0][1].failed if simulated or c.name in INTEGRITY_CHECKS]


def _torch_threads() -> int | None:
    """torch's CPU threads as the training ran (a replay on a CPU needs the same split of its reductions)."""
    import sys

    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else None
