"""One attested training run, top to bottom: decrypt -> validate -> train -> export -> attest.

``run_once(cfg, progress=print)`` is the whole job: a list of named stages, each a function with typed inputs and
outputs (the input stages in :mod:`app.run.stages`, the rest below), in the order they run (agent -> key -> dataset -> base model -> token budget -> run identity
-> audit start -> GPU evidence -> train -> export, quote and self-verification in :mod:`app.export.stage`). The nightly
service (``app.service.scheduler``) calls it with a slot-derived ``run_id`` and :class:`RunHooks` (stop requests, step
progress); a run that fails after ``run.start`` records ``run.abort`` in the audit.
Fail-closed rules: no quote, no export; the dataset is fully authenticated before training; a bundle appears
under ``exports/`` only when complete and only if it passes its own verification.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attestation import Verdict
from attestation.tdx.gpu import describe as describe_gpu
from attestation.io.hashing import sha256_file, sha256_hex

from app import alerts, export
from app.run import confidential, continual
from app.run import privacy
from app.export import stage as export_stage
from app.run import gpu as gpu_evidence
from app.audit import AuditLog, AuditRecorder
from app.config import Config
from app.dataset.versions import record_version
from app.errors import ConfigError, CvmTuneError, InputsUnchanged, StateError
from app.fsutil import remove_stale_temps
from app.run.stages import (
    Agent,
    BaseModel,
    Dataset,
    Keys,
    Progress,
    agent_stage,
    base_model_stage,
    dataset_stage,
    key_stage,
    source_stage,
    token_stage,
)
from app.run.inputs import scratch_dir
from app.run.state import (RUN_ID, choose_run, publish_head, record_export, record_promotion, record_start,
                           resume_changes)
from app.state import check_output_dir

SIMULATOR_POLICY_FILE = export_stage.SIMULATOR_POLICY_FILE


@dataclass
class RunResult:
    """What a run produced."""

    run_id: str
    bundle_dir: Path
    verdicts: list[tuple[str, Verdict]]
    policy_file: Path | None
    losses: list[tuple[int, float]]
    timings: dict[str, float] = field(default_factory=dict)  # phase -> seconds (bench/overhead.py)
    train_runtime_s: float = 0.0
    resumed_from_step: int | None = None
    report: dict[str, Any] = field(default_factory=dict)  # report/report.json of the bundle
    audit_head: str = ""
    promoted: bool = True  # exports/PROMOTED now names this bundle
    promotion_refused: str | None = None  # why not (the promotion gate)
    note: str | None = None  # e.g. trained an older version while a key release is pending


@dataclass(frozen=True)
class RunHooks:
    """What the service plugs into a run (all optional).

    Attributes:
        should_stop: Polled before training and after every optimizer step; a returned reason
            checkpoints at that step boundary and raises ``TrainingStopped`` (SIGTERM, watchdog).
        on_step: Called with the global step after every optimizer step (heartbeat).
        slot: The scheduled slot instant, recorded in the report.
        service: Run by the nightly service (``training.init: auto`` then continues from the promoted adapter).
        federation: Train for a federated round: warm start from its global adapter, its ``federation`` block in
            the manifest (``app.federated``); no lineage or promotion.
    """

    should_stop: Callable[[], str | None] = lambda: None
    on_step: Callable[[int], None] = lambda _step: None
    slot: str | None = None
    service: bool = False
    federation: Any = None  # app.federated.round_input.RoundInput: train for that federated round


@dataclass(frozen=True)
class RunIdentity:
    run_id: str
    resuming: bool
    run_dir: Path
    fingerprint: str
    inputs: dict[str, str]
    started_at: str
    config_bytes: bytes
    code_sha: str


@dataclass(frozen=True)
class Audit:
    log: AuditLog
    recorder: AuditRecorder


class _Timer:
    def __init__(self) -> None:
        self.t: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - start


def run_once(cfg: Config, *, progress: Progress = lambda _m: None, run_id: str | None = None,
             hooks: RunHooks | None = None) -> RunResult:
    """Run one attested fine-tune and export its bundle.

    Raises:
        CvmTuneError: any data, key, attestation, training or state failure (nothing exported).
    """
    from app.training.backend import prepare_backend  # heavy stack, imported lazily

    hooks = hooks or RunHooks()
    if run_id is not None and not RUN_ID.fullmatch(run_id):
        raise ConfigError(f"run id {run_id!r} is not allowed", fix="use 1-100 letters, digits, '.', '_' or '-', not starting with '.' or '-'")
    timer, t0 = _Timer(), time.perf_counter()
    out = _prepare_volume(cfg)
    scratch = scratch_dir(cfg, out)  # refused before anything starts: plaintext checkpoints live only in RAM
    with ExitStack() as stack:
        with timer.phase("agent"):
            ag = agent_stage(cfg, stack, progress)  # 1. who are we (app id, compose hash)? nothing runs without it
        with timer.phase("decrypt_validate"):
            located = source_stage(cfg, out, progress)  # 2. tonight's version: a file, a directory, the owner's URL
        with timer.phase("key"):
            keys = key_stage(cfg, ag, out, located, progress)  # 3. dataset key (+ the checkpoint key, never on disk)
        with timer.phase("decrypt_validate"):
            ds = dataset_stage(cfg, out, keys, progress)  # 4. owner signature, decrypt in memory, rollback
        with timer.phase("train"):
            prepare_backend(cfg.training)  # 4. Unsloth (GPU) is imported before the first transformers import
        with timer.phase("base_model"):
            base = base_model_stage(cfg, out, progress)  # 5. local base model, hashed, checked against the pin
        with timer.phase("decrypt_validate"):
            token_stage(cfg, ds, base, progress)  # 6. too-long policy, rows without a trainable token
            dp = privacy.plan_stage(cfg, len(ds.rows), progress)  # DP-SGD: refused up front if it cannot fit
        with timer.phase("parent"):
            parent = parent_stage(cfg, out, ag, ds, base, hooks, progress)  # 7. warm start? (or nothing new: skip)
        with timer.phase("hashing"):
            run = identity_stage(cfg, out, ds, base, parent, run_id, hooks.federation)  # 8. resume the newest, or start
            conf, parent = confidential.prepare(cfg, ag.agent, ds, run.run_dir, scratch, stack, parent,  # recipients
                                                hooks.federation)
            progress(confidential.describe(conf))  # who will be able to read tonight's weights
            privacy.reserve_stage(cfg, out, ds.info, run.run_id, dp)  # DP-SGD: the dataset version's lifetime cap
        with timer.phase("audit"):
            audit = audit_stage(cfg, out, ag, ds, base, parent, run, progress, dp)  # 9. run.start commits to the inputs
        done: list[bool] = []  # set once the bundle is published
        stack.push(lambda _et, exc, _tb: _record_abort(audit.recorder, run.run_id, exc, done))  # run.abort on failure
        with timer.phase("gpu_evidence"):
            gpu = gpu_stage(cfg, ag, audit, run, progress)  # 9. GPU evidence, nonce = the chain head
        with timer.phase("train"):
            result = train_stage(cfg, ds, base, keys, parent, run, audit, scratch, hooks, progress, dp)  # 10. checkpoints
        with timer.phase("audit"):
            audit.recorder.record(run.run_id, "train.done", {"global_step": result.global_step, "adapter_sha256": {
                f"adapter/{p.name}": sha256_file(p) for p in sorted(result.adapter_dir.iterdir())}})
            privacy.spent_stage(audit.recorder, out, ds.info, run.run_id, result, progress)  # privacy.spent
        with timer.phase("evaluate"):
            evaluation = gate_stage(cfg, ds, base, parent, result, progress)  # 11. promotion gate (eval rows)
        published = export_stage.export_bundle(export_stage.ExportInputs(  # 11. stage, quote, self-verify, publish
            cfg=cfg, out=out, run_id=run.run_id, started_at=run.started_at, code_sha=run.code_sha,
            config_bytes=run.config_bytes, agent=ag.agent, ident=ag.ident, simulated=ag.simulated,
            compose_bytes=ag.compose_bytes, build=ag.build, dataset=ds.info, rows_report=ds.rows_report,
            chunks=ds.chunks, base_dir=base.dir, base_name=base.name, base_tree=base.tree, base_files=base.files,
            train=result, gpu=gpu, log=audit.log, recorder=audit.recorder, slot=hooks.slot,
            lineage=parent.lineage() if parent else None, evaluation=evaluation,
            federation=hooks.federation.manifest_block() if hooks.federation else None, confidential=conf),
            phase=timer.phase, timings=timer.t, progress=progress)
        done.append(True)
        record_export(out, run.run_id, bundle=published.bundle)  # the run database: exported, never run again
        lineage = hooks.federation is None and continual.init_mode(cfg, service=hooks.service) == "previous"
        promoted, refused = continual.record_outcome(out, published.bundle, lineage=lineage)  # 12. past the gate only
        record_promotion(out, run.run_id, promoted=promoted)
        if lineage and promoted:  # the chain's record of the move (PROMOTED itself is an editable file)
            audit.recorder.record(run.run_id, continual.PROMOTE, continual.promotion_data(published.bundle))
        progress(f"exported: {published.bundle}" + ("" if promoted else f" (not promoted: {refused})"))
    timer.t["total"] = time.perf_counter() - t0
    return RunResult(run.run_id, published.bundle, published.verdicts, published.policy_file, result.losses, timer.t,
                     result.train_runtime_s, result.resumed_from_step, published.report, published.audit_head,
                     promoted, refused, ds.note)


def _prepare_volume(cfg: Config) -> Path:
    out = cfg.output.dir.resolve()
    check_output_dir(out)
    for sub in ("state", "datasets", "models", "runs", "exports"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out / "exports")
    return out


def parent_stage(cfg: Config, out: Path, ag: Agent, ds: Dataset, base: BaseModel, hooks: RunHooks,
                 progress: Progress) -> continual.Parent | None:
    """``training.init`` previous (``auto`` in the service): continue from the promoted bundle, verified again and
    of the same base model and LoRA shape; nothing new since it (or since a refused candidate): skip the run."""
    if hooks.federation is not None or continual.init_mode(cfg, service=hooks.service) == "base":
        return None
    log = AuditLog(out / "state" / "audit.jsonl")
    try:  # PROMOTED must be what the audit chain promoted last (and of this dataset)
        bundle = continual.pointer(out, continual.PROMOTED)
        pending = continual.check_promoted(bundle, log.entries, ds.info["dataset_id"])
    except StateError as exc:
        alerts.send(cfg.alerts, {"event": "state.inconsistent", "reason": exc.message}, output=out)
        raise
    parent = None
    if bundle is not None:
        parent = continual.load_parent(bundle)
        verdicts, _ = export_stage.self_verify(bundle, out, ag.agent, ag.simulated)
        continual.check_parent(parent, cfg, base.tree, export_stage.gate_failures(verdicts, ag.simulated))
        if pending:  # moved by a run that died before recording it: the record, now that the bundle verified
            AuditRecorder(log, ag.agent, require_emit=cfg.tee.emit_events == "required").record(
                parent.run_id, continual.PROMOTE, continual.promotion_data(bundle))
            progress(f"state: recorded the promotion of {parent.run_id} in the audit chain (the run that promoted it "
                     "stopped before it could)")
    current = {"dataset_plaintext_sha256": ds.info["plaintext_sha256"], "base_model_tree_sha256": base.tree,
               "training_config_sha256": sha256_hex(cfg.training_json()), "code_source_sha256": export.source_digest()}
    try:
        continual.check_unchanged(out, current, parent)
    except InputsUnchanged as exc:
        raise InputsUnchanged(f"{exc.message}; {ds.note}" if ds.note else exc.message) from None
    progress(f"warm start: continuing from the promoted adapter of {parent.run_id} (verified)" if parent
             else "warm start: no promoted adapter yet; training from the base model")
    return parent


def identity_stage(cfg: Config, out: Path, ds: Dataset, base: BaseModel, parent: continual.Parent | None,
                   requested: str | None, federation: Any = None) -> RunIdentity:
    """Resume the newest unfinished run with the same inputs (fingerprint), else start one; record the version."""
    inputs = {"config": sha256_hex(cfg.training_json()), "dataset": ds.info["plaintext_sha256"], "base_model": base.tree}
    if parent is not None:
        inputs["parent"] = parent.manifest_sha256  # a checkpoint resumes only from the same parent
    if federation is not None:  # ... and only within the same federated round
        inputs["federation"] = sha256_hex(json.dumps(federation.manifest_block(), sort_keys=True).encode())
    fingerprint = sha256_hex(json.dumps(inputs, sort_keys=True).encode())
    run_id, resuming, started_at = choose_run(out, fingerprint, requested)
    run_dir = out / "runs" / run_id
    record_version(out / "state", ds.info["dataset_id"], ds.info["dataset_version"], ds.info["plaintext_sha256"])
    record_start(out, run_id, fingerprint=fingerprint, started_at=started_at)
    return RunIdentity(run_id, resuming, run_dir, fingerprint, inputs, started_at, cfg.canonical_json(),
                       export.source_digest())


def audit_stage(cfg: Config, out: Path, ag: Agent, ds: Dataset, base: BaseModel, parent: continual.Parent | None,
                run: RunIdentity, progress: Progress, dp: Any = None) -> Audit:
    """``run.start`` (or ``run.resume``) commits to every input hash before training, measured into RTMR3."""
    log = AuditLog(out / "state" / "audit.jsonl")
    recorder = AuditRecorder(log, ag.agent, require_emit=cfg.tee.emit_events == "required",
                             on_anchor=lambda head: publish_head(cfg.state.rollback_anchor, out, head))
    commitment = {
        "config_sha256": sha256_hex(run.config_bytes), "training_config_sha256": sha256_hex(cfg.training_json()),
        "dataset_id": ds.info["dataset_id"], "dataset_version": ds.info["dataset_version"],
        "dataset_encrypted_sha256": ds.info["encrypted_sha256"], "dataset_plaintext_sha256": ds.info["plaintext_sha256"],
        "base_model_tree_sha256": base.tree, "code_source_sha256": run.code_sha,
        "parent_manifest_sha256": parent.manifest_sha256 if parent else None, **privacy.commitment(dp)}
    if run.resuming:
        changed = resume_changes(log, run.run_id, commitment)
        recorder.record(run.run_id, "run.resume", {"fingerprint": run.fingerprint, **commitment})
        if changed:
            progress(f"run {run.run_id}: settings outside training changed since it started ({changed}); recorded in the audit chain")
    else:
        recorder.record(run.run_id, "run.start", commitment)
    measured = "measured into RTMR3" if recorder.rtmr3 == "emit_event" else (
        f"not measured into RTMR3 ({recorder.note}); the chain is anchored by a quote at each checkpoint and bound "
        "by the export's quote")
    progress(f"run {run.run_id}: {'resuming' if run.resuming else 'started'}; audit events {measured}")
    return Audit(log, recorder)


def gpu_stage(cfg: Config, ag: Agent, audit: Audit, run: RunIdentity, progress: Progress) -> Any:
    """GPU evidence, fresh for this run: its nonce is the chain head (the entry just recorded); on dstack 0.6 also
    the agent's (AttestGpu with that nonce, and the boot gate's evidence)."""
    gpu = gpu_evidence.collect(audit.log.head, agent=ag.agent)
    audit.recorder.record(run.run_id, "gpu.evidence", gpu.audit_data())
    progress(f"gpu: {describe_gpu(gpu.info)}" + ("" if gpu.boot is None else "; dstack's boot gate attested the "
             "GPU(s) (RTMR3 gpu-attestation; its evidence goes into the bundle as gpu-boot-evidence.json)"))
    if cfg.tee.gpu_evidence != "auto":
        gpu_evidence.require_confidential(gpu.info, attested=cfg.tee.gpu_evidence == "attested")
    return gpu


def train_stage(cfg: Config, ds: Dataset, base: BaseModel, keys: Keys, parent: continual.Parent | None,
                run: RunIdentity, audit: Audit, scratch: Path, hooks: RunHooks, progress: Progress, dp: Any = None) -> Any:
    """Train (sealed checkpoints under runs/<id>/checkpoints; resumes from the newest complete one)."""
    from app.training import TrainingStopped, TrainRequest, train

    ts = cfg.training
    if (reason := hooks.should_stop()) is not None:
        raise TrainingStopped(f"{reason}: stopped before training")

    def step_end(step: int) -> str | None:
        hooks.on_step(step)
        return hooks.should_stop()

    def batch_changed(change: dict[str, Any]) -> None:  # OOM back-off / auto batch size: audited, in the manifest
        audit.recorder.record(run.run_id, "train.batch", change)
        progress(f"  CUDA OOM in {change['phase']}: batch {change['from']} -> {change['to']}")

    from app.training.checkpoints import record_epochs

    record_epochs(run.run_dir / "checkpoints", keys.checkpoint_epochs)  # what the sealed checkpoints are under
    result = train(TrainRequest(
        base_model_dir=base.dir, base_model_name=cfg.base_model.hub_id or base.name,
        base_model_revision=cfg.base_model.revision, rows=ds.rows, run_dir=run.run_dir, settings=ts,
        fingerprint=run.fingerprint, checkpoint_key=keys.checkpoint, inputs=run.inputs, scratch_dir=scratch,
        keep_checkpoints=cfg.output.keep_checkpoints, on_step_end=step_end,
        on_event=lambda t, d: audit.recorder.record(run.run_id, t, d),
        on_log=lambda m: progress(step_line(m, ts.max_steps)),
        on_batch_change=batch_changed, init_adapter=parent.adapter_dir if parent else (
            hooks.federation.global_adapter_dir if hooks.federation else None),
        proximal=hooks.federation.proximal() if hooks.federation else None, privacy=dp,
        tokenized=ds.tokens))
    if result.resumed_from_step:
        progress(f"training resumed from checkpoint step {result.resumed_from_step}")
    return result


def step_line(m: dict[str, Any], max_steps: int) -> str:
    """One training progress line: step, loss (and ε under DP), then the input tokens a second, the time this process
    has trained and the time left at that pace (``on_log``'s metrics; a resumed run paces its own steps)."""
    line = f"  step {m['step']}/{max_steps}  loss {m['loss']:.4f}" + (f"  ε {m['epsilon']:.4g}" if "epsilon" in m else "")
    elapsed, done = m.get("elapsed_s"), m.get("steps_this_run")
    if not elapsed or not done:
        return line
    rate = f"  {m['tokens_this_run'] / elapsed:,.0f} tokens/s" if m.get("tokens_this_run") else ""
    left = elapsed / done * max(0, max_steps - m["step"])
    return f"{line}{rate}  elapsed {_clock(elapsed)}  ETA {_clock(left)}"


def _clock(seconds: float) -> str:
    """``m:ss`` (``h:mm:ss`` from an hour)."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def gate_stage(cfg: Config, ds: Dataset, base: BaseModel, parent: continual.Parent | None, result: Any,
               progress: Progress) -> dict[str, Any] | None:
    """``evaluation.gate: loss``: score the candidate and its parent (the promoted adapter, or the base model) on the
    owner's eval rows; the decision goes into the attested manifest (the verifier recomputes it)."""
    from app.training.warm import eval_loss

    ev = cfg.evaluation
    if ev.gate == "off":
        return None
    if cfg.training.objective == "dpo":  # DPO loss and preference accuracy against the base model
        return continual.dpo_gate(base.dir, result.adapter_dir, parent, ds.eval_rows, cfg, progress)
    candidate = eval_loss(base.dir, result.adapter_dir, ds.eval_rows, cfg.training)
    reference = eval_loss(base.dir, parent.adapter_dir if parent else None, ds.eval_rows, cfg.training)
    promote = continual.decide(candidate, reference, ev.max_regression)
    against = f"run {parent.run_id}" if parent else "the base model"
    progress(f"evaluation: eval loss {candidate:.4f} vs {reference:.4f} ({against}) on {len(ds.eval_rows)} eval rows: "
             + ("promote" if promote else f"promotion refused (allowed regression {ev.max_regression:g})"))
    return {"metric": "loss", "rows": len(ds.eval_rows), "candidate_loss": candidate, "parent_loss": reference,
            "parent": against, "max_regression": ev.max_regression, "promote": promote}


def _record_abort(recorder: AuditRecorder, run_id: str, exc: BaseException | None, done: list[bool]) -> bool:
    """Audit ``run.abort`` (error class and category only) when a started run fails before its export."""
    if exc is None or done:
        return False
    category = exc.category if isinstance(exc, CvmTuneError) else "internal"
    try:
        recorder.record(run_id, "run.abort", {"error": type(exc).__name__, "category": category})
    except Exception:  # the agent or the volume may be what failed: never mask the original error
        logging.getLogger(__name__).warning("could not record run.abort for %s", run_id)
    return False
