"""One attested training run, top to bottom: decrypt -> validate -> train -> export -> attest.

``run_once(cfg, progress=print)`` is the whole job. Each numbered step is one call into a small
module; read this file to know what happens in what order and what is hashed where. The nightly
service (``app.scheduler``) calls it with a slot-derived ``run_id`` and :class:`RunHooks` (stop
requests, step progress); a run that fails after ``run.start`` records ``run.abort`` in the audit.
Fail-closed rules: no quote, no export; the dataset is fully authenticated before training; a
bundle appears under ``exports/`` only when complete (staged, fsynced, renamed).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from attestation import Verdict
from attestation import bundle as B
from attestation.gpu import describe as describe_gpu
from attestation.hashing import sha256_file, sha256_hex, tree_digest

from app import export
from app import gpu as gpu_evidence
from app.audit import AuditLog, AuditRecorder, utc_now
from app.build_info import build_info
from app.config import Config
from app.dataset import DerivedKeySource, KeyFileSource, KeySource, encrypt_file, open_encrypted, parse_jsonl
from app.dataset.key_request import CvmIdentity, ReleasedKeySource
from app.dataset.keys import EnvKeySource
from app.dataset.versions import check_version, record_version
from app.errors import BaseModelError, ConfigError, CvmTuneError, DataError, TeeError
from app.fsutil import open_regular, remove_stale_temps, scratch_dir
from app.publish import ExportInputs, publish_bundle
from app.runs import pick_run, write_run_state
from app.state import state_dir
from app.stages import AgentStage, BaseModel, DatasetStage, Keys, RunIdentity
from app.tee import GuestAgent, Identity, open_guest_agent

Progress = Callable[[str], None]
SAMPLE_DATASET_ID = "cvm-tune-sample"
RUN_ID = re.compile(B.RUN_ID_PATTERN)


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


@dataclass(frozen=True)
class RunHooks:
    """What the service plugs into a run (all optional).

    Attributes:
        should_stop: Polled before training and after every optimizer step; a returned reason
            checkpoints at that step boundary and raises ``TrainingStopped`` (SIGTERM, watchdog).
        on_step: Called with the global step after every optimizer step (heartbeat).
        slot: The scheduled slot instant, recorded in the report.
    """

    should_stop: Callable[[], str | None] = lambda: None
    on_step: Callable[[int], None] = lambda _step: None
    slot: str | None = None


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
    from app.training import build_tiny_model  # heavy stack, imported lazily
    from app.training.backend import prepare_backend

    hooks = hooks or RunHooks()
    if run_id is not None and not RUN_ID.fullmatch(run_id):
        raise ConfigError(f"run id {run_id!r} is not allowed", fix="use 1-100 letters, digits, '.', '_' or '-', not starting with '.' or '-'")
    timer, t0 = _Timer(), time.perf_counter()
    out, scratch = _prepare_output(cfg)  # refuses a bad output.dir or a scratch_dir that is not RAM

    with ExitStack() as stack:
        # 1. Guest agent: who are we (app id, compose hash)? Nothing runs without one.
        with timer.phase("agent"):
            ag = _agent_stage(cfg, stack, progress)
        # 2. Dataset key (GetKey-derived, a key file, an env var, or released by the owner) + checkpoint key.
        with timer.phase("key"):
            keys = _key_stage(cfg, ag, out)
        # 3. Encrypted dataset: owner signature, decrypt in memory, authenticate ALL of it, validate rows,
        #    drop duplicates; refuse a rolled-back version.
        with timer.phase("decrypt_validate"):
            ds = _dataset_stage(cfg, out, keys, progress)
        # 4. Backend first (Unsloth before transformers), then the base model: built or found, hashed, pin checked.
        with timer.phase("train"):
            prepare_backend(cfg.training)
        with timer.phase("base_model"):
            base = _base_model_stage(cfg, out, build_tiny_model, progress)
        # 4b. Token budget: too-long policy, rows without a trainable token; counted, before training.
        with timer.phase("decrypt_validate"):
            rows = _token_budget_stage(cfg, ds, base, progress)
        # 5. Run identity: resume the newest unfinished run with the same inputs, else start one.
        with timer.phase("hashing"):
            run = _run_identity_stage(cfg, out, ds, base, run_id)
        # 6. Audit: run.start (or run.resume) commits to every input hash before training.
        with timer.phase("audit"):
            log, recorder = _audit_start_stage(cfg, out, ag, ds, base, run)
        done: list[bool] = []  # set once the bundle is published
        stack.push(lambda _et, exc, _tb: _record_abort(recorder, run.run_id, exc, done))  # run.abort on any failure
        progress(f"run {run.run_id}: {'resuming' if run.resuming else 'started'}; audit events "
                 f"{'measured into RTMR3' if recorder.rtmr3 == 'emit_event' else 'NOT measured (' + str(recorder.note) + ')'}")
        # 6b. GPU evidence, fresh for this run: its nonce is the chain head (the entry just recorded).
        with timer.phase("gpu_evidence"):
            gpu = _gpu_stage(cfg, log, recorder, run.run_id, progress)
        # 7. Train (checkpoints under runs/<id>/checkpoints; resumes from the newest complete one).
        with timer.phase("train"):
            result = _train_stage(cfg, scratch, run, rows, base, keys, recorder, hooks, progress)
        # 8. Export: stage every file, commit to them in the audit chain, bind the manifest into a quote,
        # 9. verify the staged bundle the way a relying party will, and publish it only if it passes.
        with timer.phase("export"):
            pub = publish_bundle(_export_inputs(cfg, ag, ds, base, run, result, gpu, hooks), out=out,
                                 agent=ag.agent, log=log, recorder=recorder, collateral_mode=cfg.tee.collateral,
                                 pccs_url=cfg.tee.pccs_url, timeout_s=cfg.tee.timeout_s, timings=timer.t,
                                 phase=timer.phase, progress=progress)
        done.append(True)
        write_run_state(run.run_dir, {"run_id": run.run_id, "fingerprint": run.fingerprint, "status": "exported",
                                   "started_at": run.started_at, "bundle": str(pub.bundle_dir)})
        progress(f"exported: {pub.bundle_dir}")
    timer.t["total"] = time.perf_counter() - t0
    return RunResult(run.run_id, pub.bundle_dir, pub.verdicts, pub.policy_file, result.losses, timer.t,
                     result.train_runtime_s, result.resumed_from_step, pub.report, pub.audit_head)


# ---- stages (each: typed inputs -> typed output; called once, in order, by run_once) -------------------------

def _prepare_output(cfg: Config) -> tuple[Path, Path]:
    """The output volume's directories (made) and the trainer's RAM scratch path (checked, not made)."""
    out = cfg.output.dir.resolve()
    scratch = scratch_dir(cfg.output.scratch_dir, out, unsafe_ok=cfg.output.scratch_unsafe_ok)
    state_dir(out)  # refuses an output.dir that is a file
    for sub in ("datasets", "models", "runs", "exports"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out / "exports")
    return out, scratch


def _agent_stage(cfg: Config, stack: ExitStack, progress: Progress) -> AgentStage:
    agent = stack.enter_context(open_guest_agent(cfg.tee))
    ident = agent.identity()
    simulated = cfg.tee.mode == "embedded-simulator" or ident.is_cvm_tune_simulator
    progress(f"guest agent: {_describe_agent(ident, simulated)}")
    compose_bytes = ident.app_compose.encode()
    if sha256_hex(compose_bytes) != ident.compose_hash:
        raise TeeError("the agent's app-compose text does not hash to its compose-hash", fix="report this: the guest agent is inconsistent")
    build = build_info(ident.app_compose)  # image digest from the measured compose, lock hash from the image
    return AgentStage(agent, ident, simulated, compose_bytes, build)


def _key_stage(cfg: Config, ag: AgentStage, out: Path) -> Keys:
    from app.training.checkpoints import CHECKPOINT_GETKEY_PATH

    source = _key_source(cfg, ag.agent, ag.ident, out)
    # Checkpoints are sealed under their own GetKey path (bound to the app id, never on disk).
    ckpt = DerivedKeySource(ag.agent.get_key, CHECKPOINT_GETKEY_PATH, "cvm-tune-checkpoint-key").dataset_key()
    return Keys(source, source.dataset_key(), ckpt)


def _dataset_stage(cfg: Config, out: Path, keys: Keys, progress: Progress) -> DatasetStage:
    dcfg = cfg.dataset
    owner_pub = bytes.fromhex(dcfg.owner_public_key) if dcfg.owner_public_key else None
    ds_path = _dataset_file(cfg, out, keys.dataset_key, progress)
    with open_regular(ds_path, DataError, "dataset", "check dataset.path: an encrypted dataset file") as fh:
        stream = open_encrypted(fh, keys.dataset_key, owner_public_key=owner_pub)
        rows, report_rows = parse_jsonl(stream, source=ds_path.name, max_row_bytes=dcfg.max_row_bytes,
                                        dedup=dcfg.dedup, max_plaintext_bytes=dcfg.max_plaintext_bytes)
    sig, h = stream.signature, stream.header
    meta = {
        "dataset_id": h.dataset_id, "dataset_version": h.dataset_version,
        "format": f"cvm-tune encrypted dataset v{h.format_version}",
        "encrypted_sha256": stream.ciphertext_sha256, "encrypted_size": stream.ciphertext_size,
        "plaintext_sha256": stream.plaintext_sha256, "plaintext_size": stream.plaintext_size,
        "rows": report_rows.rows_kept, "key_source": keys.source.describe(),
        "owner_public_key": sig.owner_public_key.hex() if sig else None,
        "owner_key_id": sig.owner_key_id if sig else None, "commitment": sig.commitment if sig else None,
        "validation": {"rows_read": report_rows.rows_total, "duplicates_dropped": report_rows.duplicates_dropped},
    }
    check_version(out / "state", meta["dataset_id"], meta["dataset_version"], meta["plaintext_sha256"])
    signer = f", signed by owner key {sig.owner_key_id[:16]}…" if sig else ", not owner-signed"
    progress(f"dataset: {ds_path.name} v{meta['dataset_version']} decrypted in memory and authenticated "
             f"({stream.chunks} chunks{signer}), {report_rows.rows_kept} rows {dict(report_rows.by_kind)}, "
             f"{report_rows.duplicates_dropped} duplicates dropped{_lines(report_rows.duplicate_lines)}")
    return DatasetStage(rows, report_rows, stream.chunks, meta)


def _base_model_stage(cfg: Config, out: Path, build_tiny_model: Callable[[Path], None], progress: Progress) -> BaseModel:
    base_dir, base_name = _base_model(cfg, out, build_tiny_model)
    tree, files = tree_digest(base_dir)
    if cfg.base_model.sha256 and tree != cfg.base_model.sha256:
        raise BaseModelError(f"base model {base_dir} has tree sha256 {tree}, config pins {cfg.base_model.sha256}",
                             fix="restore the pinned base model files (never download them at run time)")
    progress(f"base model: {base_name} tree sha256 {tree[:16]}…")
    return BaseModel(base_dir, base_name, tree, files)


def _token_budget_stage(cfg: Config, ds: DatasetStage, base: BaseModel, progress: Progress) -> list[Any]:
    """Rows that fit the token budget; updates the dataset's row count and validation counts."""
    from app.training.tokens import apply_token_policy

    dcfg = cfg.dataset
    rows, tokens = apply_token_policy(ds.rows, base_model_dir=base.dir, max_length=cfg.training.max_length,
                                      assistant_only_loss=cfg.training.assistant_only_loss, too_long=dcfg.too_long,
                                      lines=ds.report.lines)
    ds.meta["rows"] = tokens.rows_out
    ds.meta["validation"].update(tokens.counts())
    progress(f"tokens: {tokens.rows_out} rows, {tokens.trainable_tokens} trainable tokens; {tokens.too_long} longer "
             f"than {tokens.max_length} tokens ({dcfg.too_long}{_lines(tokens.too_long_lines)}), "
             f"{tokens.dropped_no_trainable} without trainable tokens dropped{_lines(tokens.no_trainable_lines)}")
    return rows


def _run_identity_stage(cfg: Config, out: Path, ds: DatasetStage, base: BaseModel, requested: str | None) -> RunIdentity:
    inputs = {"config": sha256_hex(cfg.training_json()), "dataset": ds.meta["plaintext_sha256"], "base_model": base.tree}
    fingerprint = sha256_hex(json.dumps(inputs, sort_keys=True).encode())
    run_id, resuming = pick_run(out, fingerprint, requested)
    run_dir = out / "runs" / run_id
    started_at = json.loads((run_dir / "state.json").read_text())["started_at"] if resuming else utc_now()
    record_version(out / "state", ds.meta["dataset_id"], ds.meta["dataset_version"], ds.meta["plaintext_sha256"])
    write_run_state(run_dir, {"run_id": run_id, "fingerprint": fingerprint, "status": "running", "started_at": started_at})
    return RunIdentity(run_id, resuming, run_dir, fingerprint, started_at, inputs, cfg.canonical_json(),
                       export.source_digest())


def _audit_start_stage(cfg: Config, out: Path, ag: AgentStage, ds: DatasetStage, base: BaseModel,
                       run: RunIdentity) -> tuple[AuditLog, AuditRecorder]:
    log = AuditLog(out / "state" / "audit.jsonl")
    recorder = AuditRecorder(log, ag.agent, require_emit=cfg.tee.emit_events == "required")
    commits = {"config_sha256": sha256_hex(run.config_bytes),
               "dataset_encrypted_sha256": ds.meta["encrypted_sha256"],
               "dataset_plaintext_sha256": ds.meta["plaintext_sha256"],
               "dataset_id": ds.meta["dataset_id"], "dataset_version": ds.meta["dataset_version"],
               "base_model_tree_sha256": base.tree, "code_source_sha256": run.code_sha}
    if run.resuming:  # inputs outside the fingerprint (output.*, schedule.*, code) may have changed: commit anew
        recorder.record(run.run_id, "run.resume", {"fingerprint": run.fingerprint, **commits})
    else:
        recorder.record(run.run_id, "run.start", commits)
    return log, recorder


def _gpu_stage(cfg: Config, log: AuditLog, recorder: AuditRecorder, run_id: str, progress: Progress) -> Any:
    gpu = gpu_evidence.collect(log.head)
    recorder.record(run_id, "gpu.evidence", gpu.audit_data())
    progress(f"gpu: {describe_gpu(gpu.info)}")
    if cfg.tee.gpu_evidence == "required":
        gpu_evidence.require_confidential(gpu.info)
    return gpu


def _train_stage(cfg: Config, scratch: Path, run: RunIdentity, rows: list[Any], base: BaseModel, keys: Keys,
                 recorder: AuditRecorder, hooks: RunHooks, progress: Progress) -> Any:
    from app.training import TrainingStopped, TrainRequest, train

    ts, run_id = cfg.training, run.run_id
    if (reason := hooks.should_stop()) is not None:
        raise TrainingStopped(f"{reason}: stopped before training")

    def step_end(step: int) -> str | None:
        hooks.on_step(step)
        return hooks.should_stop()

    def batch_changed(change: dict[str, Any]) -> None:  # OOM back-off / auto batch size: audited, in the manifest
        recorder.record(run_id, "train.batch", change)
        progress(f"  CUDA OOM in {change['phase']}: batch {change['from']} -> {change['to']}")

    result = train(TrainRequest(
        base_model_dir=base.dir, base_model_name=base.name, rows=rows, run_dir=run.run_dir, settings=ts,
        fingerprint=run.fingerprint, checkpoint_key=keys.checkpoint_key, inputs=run.inputs,
        scratch_dir=scratch, keep_checkpoints=cfg.output.keep_checkpoints,
        on_step_end=step_end, on_event=lambda t, d: recorder.record(run_id, t, d),
        on_log=lambda m: progress(f"  step {m['step']}/{ts.max_steps}  loss {m['loss']:.4f}"),
        on_batch_change=batch_changed))
    if result.resumed_from_step:
        progress(f"training resumed from checkpoint step {result.resumed_from_step}")
    adapter_hashes = {f"adapter/{p.name}": sha256_file(p) for p in sorted(result.adapter_dir.iterdir())}
    recorder.record(run_id, "train.done", {"global_step": result.global_step, "adapter_sha256": adapter_hashes})
    return result


def _export_inputs(cfg: Config, ag: AgentStage, ds: DatasetStage, base: BaseModel, run: RunIdentity, result: Any,
                   gpu: Any, hooks: RunHooks) -> ExportInputs:
    ts, ident = cfg.training, ag.ident
    checks = [
        f"guest agent {ident.version}: compose-hash consistent with its app-compose",
        f"dataset header and all {ds.chunks} chunks authenticated before any row was used",
        f"rows validated: {ds.report.rows_kept} of {ds.report.rows_total} kept",
        "base model tree hash " + ("matches the pinned sha256" if cfg.base_model.sha256 else "recorded (not pinned)"),
        (f"resumed from sealed checkpoint step {result.resumed_from_step} (manifest and blob hashes verified)"
         if result.resumed_from_step else "trained from step 0"),
        *(f"refused {name}: {why}" for name, why in result.rejected_checkpoints),
        "loss watchdog: " + ("no NaN/Inf or spike" if ts.loss_watchdog.enabled else "disabled"),
    ]
    return ExportInputs(
        run_id=run.run_id, started_at=run.started_at, slot=hooks.slot, simulated=ag.simulated,
        config_bytes=run.config_bytes, compose_bytes=ag.compose_bytes, code_sha=run.code_sha, build=ag.build,
        base_name=base.name, base_source=cfg.base_model.source, base_tree=base.tree, base_files=base.files,
        dataset=ds.meta, rows=ds.report, seed=ts.seed, train=result,
        effective_batch_size=result.batch.get("effective", ts.per_device_batch_size * ts.gradient_accumulation_steps),
        gpu=gpu, checks=checks,
        tee={"mode": cfg.tee.mode, "app_id": ident.app_id, "instance_id": ident.instance_id,
             "compose_hash": ident.compose_hash, "agent_version": ident.version, "agent_rev": ident.rev})


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


def _lines(numbers: tuple[int, ...], most: int = 10) -> str:
    """`` (lines 3, 9, …)`` for a progress line: positions, never content."""
    if not numbers:
        return ""
    more = ", …" if len(numbers) > most else ""
    return f" (line{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers[:most]))}{more})"


def _describe_agent(ident: Identity, simulated: bool) -> str:
    kind = "cvm-tune SIMULATOR (test CA, not a TEE)" if simulated else "dstack"
    return f"{kind} {ident.version} app_id {ident.app_id} compose_hash {ident.compose_hash[:16]}…"


def _key_source(cfg: Config, agent: GuestAgent, ident: Identity, out: Path) -> KeySource:
    k = cfg.dataset.key
    if k.source == "file":
        return KeyFileSource(k.file)  # type: ignore[arg-type]  # validated: file is set
    if k.source == "env":
        return EnvKeySource(k.env_var)
    if k.source == "release":  # validated: encrypted-file with a pinned owner key
        return ReleasedKeySource(agent=agent, identity=CvmIdentity(ident.app_id, ident.compose_hash, ident.instance_id),
                                 out_dir=out, dataset=Path(cfg.dataset.path),  # type: ignore[arg-type]
                                 grant_file=k.grant_file or out / "key-release" / "grant.json",
                                 owner_public_key=bytes.fromhex(cfg.dataset.owner_public_key),  # type: ignore[arg-type]
                                 pccs_url=cfg.tee.pccs_url, timeout_s=cfg.tee.timeout_s)
    return DerivedKeySource(agent.get_key, k.getkey_path)


def _dataset_file(cfg: Config, out: Path, key: bytes, progress: Progress) -> Path:
    """The encrypted dataset; the bundled demo sample is encrypted once into the output volume."""
    if cfg.dataset.source == "encrypted-file":
        return Path(cfg.dataset.path)  # type: ignore[arg-type]  # validated: path is set
    sample = resources.files("app") / "data" / "sample.jsonl"
    with resources.as_file(sample) as sample_path:
        dst = out / "datasets" / f"sample-{sha256_file(sample_path)[:12]}.cvmds"
        if not dst.exists():
            encrypt_file(sample_path, dst, key, dataset_id=SAMPLE_DATASET_ID, dataset_version=1)
            progress(f"dataset: bundled sample encrypted on the fly to {dst} (demo; real data arrives encrypted)")
    return dst


def _base_model(cfg: Config, out: Path, build_tiny_model: Callable[[Path], None]) -> tuple[Path, str]:
    if cfg.base_model.source == "tiny-llama":
        path = out / "models" / "tiny-llama"
        build_tiny_model(path)
        return path, "cvm-tune/tiny-llama"
    path = Path(cfg.base_model.path)  # type: ignore[arg-type]  # validated: path is set
    if not (path / "config.json").is_file():
        raise BaseModelError(f"base model directory {path} has no config.json", fix="point base_model.path at a local HF model directory")
    return path, path.name
