"""The export stage: stage every file of a bundle, bind it into a quote, verify it, then publish it.

``publish_bundle`` builds ``exports/.tmp-<run_id>-*`` (adapter, config, compose, GPU evidence, model
card, report, audit slice, manifest, quote, event log, collateral), verifies the staged directory
the way a relying party will, and renames it to ``exports/<run_id>`` only when that verification
passes under the run's policy. A bundle that fails its own verification is an :class:`ExportError`
(exit 7): nothing is published and the run stays resumable.

The run's policy: the simulator's test-CA policy for simulator runs (every check must pass); the
built-in default policy otherwise, where the checks that are the relying party's to judge (platform
TCB, collateral freshness, pinned measurements and build pins) may fail but every check of the
bundle's own consistency (files, manifest, report_data, audit chain, event-log replay, compose and
GPU evidence binding) must pass.
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
from attestation import bundle as B
from attestation.hashing import files_digest, sha256_file
from attestation.policy import policy_file_text, simulator_policy

import app
from app import export, report
from app.audit import AuditLog, AuditRecorder, utc_now
from app.errors import ExportError
from app.fsutil import atomic_write_bytes, staged_dir

SIMULATOR_POLICY_FILE = "simulator-test-policy.yaml"
# Failed under the default policy, these are the relying party's call (platform and freshness), not a broken bundle.
RELYING_PARTY_CHECKS = frozenset({
    "collateral.parse", "collateral.window", "collateral.chains", "collateral.tcb_evaluation", "quote.cert_chain",
    "quote.signature", "quote.tcb_status", "quote.td_attributes", "policy.measurements", "build.image", "build.lock",
    "audit.rtmr3"})


@dataclass(frozen=True)
class ExportInputs:
    """Everything the bundle records, gathered by the earlier stages of ``run_once``."""

    run_id: str
    started_at: str
    slot: str | None
    simulated: bool
    config_bytes: bytes
    compose_bytes: bytes
    code_sha: str
    build: dict[str, Any]
    base_name: str
    base_source: str
    base_tree: str
    base_files: dict[str, str]
    dataset: dict[str, Any]
    rows: Any  # RowReport
    tee: dict[str, Any]
    seed: int
    train: Any  # TrainResult
    effective_batch_size: int
    gpu: Any  # GpuEvidence
    checks: list[str]


@dataclass(frozen=True)
class Published:
    """A published bundle and the verdicts it passed before it was renamed into place."""

    bundle_dir: Path
    verdicts: list[tuple[str, Verdict]]
    policy_file: Path | None
    report: dict[str, Any]
    audit_head: str


Phase = Callable[[str], AbstractContextManager[None]]


def publish_bundle(x: ExportInputs, *, out: Path, agent: Any, log: AuditLog, recorder: AuditRecorder,
                   collateral_mode: str, pccs_url: str, timeout_s: float, timings: dict[str, float], phase: Phase,
                   progress: Callable[[str], None]) -> Published:
    """Stage, quote, self-verify and publish ``exports/<run_id>``.

    Raises:
        ExportError: a write failed (disk full) or the staged bundle fails its own verification;
            nothing is published either way.
    """
    final = out / "exports" / x.run_id
    t = x.train
    with _disk_errors(f"writing the export bundle {final}"), staged_dir(final) as stage:
        (stage / "adapter").mkdir()
        for p in t.adapter_dir.iterdir():
            shutil.copyfile(p, stage / "adapter" / p.name)
        (stage / B.CONFIG).write_bytes(x.config_bytes)
        (stage / B.APP_COMPOSE).write_bytes(x.compose_bytes)
        (stage / B.GPU_EVIDENCE).write_bytes(x.gpu.data)
        last_loss = t.losses[-1][1] if t.losses else None
        (stage / B.MODEL_CARD).write_bytes(export.model_card(
            run_id=x.run_id, base_model=x.base_name, base_tree=x.base_tree, dataset=x.dataset, backend=t.backend,
            steps=t.global_step, last_loss=last_loss, simulated=x.simulated))
        run_report = report.build(run_id=x.run_id, slot=x.slot, timings=timings, train=t,
                                  effective_batch_size=x.effective_batch_size, rows=x.rows, checks=x.checks,
                                  validation=x.dataset["validation"])
        report_files = report.write(stage, run_report)
        artifacts = {rel: sha256_file(stage / rel) for rel in B.ARTIFACT_FILES}
        with phase("audit"):
            recorder.record(x.run_id, "export", {"artifacts_sha256": files_digest(artifacts)})
        entries = log.run_slice(x.run_id)
        (stage / B.AUDIT).write_bytes(b"".join(e.line + b"\n" for e in entries))
        manifest = _manifest(x, entries, recorder.rtmr3 or "unsupported", {
            **artifacts, B.AUDIT: sha256_file(stage / B.AUDIT), B.GPU_EVIDENCE: x.gpu.info.evidence_sha256,
            **{rel: sha256_file(p) for rel, p in report_files.items()}})
        (stage / B.MANIFEST).write_bytes(manifest)
        with phase("quote"):
            quote, event_log = agent.quote(B.manifest_report_data(manifest))
        (stage / B.QUOTE_BIN).write_bytes(quote)
        (stage / B.QUOTE_HEX).write_text(quote.hex() + "\n")
        (stage / B.EVENT_LOG).write_text(event_log)
        with phase("collateral"):
            collateral = None if collateral_mode == "none" else agent.collateral(quote, pccs_url=pccs_url, timeout_s=timeout_s)
        if collateral is not None:
            (stage / B.COLLATERAL).write_text(collateral)
        else:
            progress("collateral: not available; verify later with --collateral (fresh collateral from a PCCS)")
        with phase("self_verify"):
            verdicts, policy_file = self_verify(stage, out, agent, x.simulated)
        gate_problems(verdicts, x.simulated)  # raises ExportError: the rename below never happens
    return Published(final, verdicts, policy_file, run_report, entries[-1].hash)


def _manifest(x: ExportInputs, entries: list[Any], rtmr3: str, files: dict[str, str]) -> bytes:
    t = x.train
    return export.manifest_bytes({
        "schema": B.MANIFEST_SCHEMA, "run_id": x.run_id, "started_at": x.started_at, "created_at": utc_now(),
        "code": {"package": "cvm-tune", "version": app.__version__, "source_sha256": x.code_sha},
        "backend": {"name": t.backend, "device": t.device, "libraries": export.library_versions(t.library_versions)},
        "base_model": {"name": x.base_name, "source": x.base_source, "tree_sha256": x.base_tree, "files": x.base_files},
        "dataset": x.dataset,
        "tee": x.tee,
        "training": {"seed": x.seed, "global_step": t.global_step, "resumed_from_step": t.resumed_from_step,
                     "losses": t.losses, "train_runtime_s": round(t.train_runtime_s, 3), "tokens_seen": t.tokens_seen,
                     "effective_batch_size": x.effective_batch_size, "batch": t.batch or None,
                     "eval_losses": t.eval_losses or None},
        "audit": {"head": entries[-1].hash, "start_prev": entries[0].prev, "first_seq": entries[0].seq,
                  "entries": len(entries), "rtmr3": rtmr3},
        "files": files,
        "gpu": x.gpu.info.model_dump(mode="json"),
        "build": x.build,
    })


def self_verify(bundle: Path, out: Path, agent: Any, simulated: bool) -> tuple[list[tuple[str, Verdict]], Path | None]:
    """Verify a bundle under the default policy and, for the simulator, its test-CA policy (written to ``out``)."""
    now = int(time.time())
    verdicts = []
    policy_file = None
    if simulated:
        policy = simulator_policy(agent.simulator_root_der())
        policy_file = out / SIMULATOR_POLICY_FILE
        atomic_write_bytes(policy_file, policy_file_text(policy).encode())
        verdicts.append((str(policy_file), verify_bundle(bundle, policy=policy, now=now)))
    verdicts.append(("default", verify_bundle(bundle, policy=DEFAULT_POLICY, now=now)))
    return verdicts, policy_file


def gate_problems(verdicts: list[tuple[str, Verdict]], simulated: bool) -> None:
    """Refuse to publish a bundle that fails its own verification under the run's policy.

    Raises:
        ExportError: the failed checks, by name.
    """
    name, verdict = verdicts[0]  # simulator runs: the test-CA policy first; otherwise the default policy
    failed = [c for c in verdict.failed if simulated or c.name not in RELYING_PARTY_CHECKS]
    if failed:
        detail = "; ".join(f"{c.name}: {c.detail}" for c in failed[:3])
        raise ExportError(f"the staged bundle fails its own verification ({name}): {detail}",
                          fix="nothing was published; run again to resume from the last checkpoint, and report this "
                              "if it repeats")


@contextmanager
def _disk_errors(what: str) -> Iterator[None]:
    """Disk full (or any OS error) while writing the bundle: a clean ExportError, nothing half-written kept."""
    try:
        yield
    except OSError as exc:
        raise ExportError(f"{what} failed: {exc.strerror or type(exc).__name__}",
                          fix="free space on the output volume and run again; no partial bundle was kept") from exc
