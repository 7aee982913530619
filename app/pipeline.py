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
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

from attestation import DEFAULT_POLICY, Verdict, verify_bundle
from attestation import bundle as B
from attestation.gpu import describe as describe_gpu
from attestation.hashing import files_digest, sha256_file, sha256_hex, tree_digest
from attestation.policy import policy_file_text, simulator_policy

import app
from app import export, report
from app import gpu as gpu_evidence
from app.audit import AuditLog, AuditRecorder, utc_now
from app.build_info import build_info
from app.config import Config
from app.dataset import DerivedKeySource, KeyFileSource, KeySource, encrypt_file, open_encrypted, parse_jsonl
from app.dataset.key_request import CvmIdentity, ReleasedKeySource
from app.dataset.keys import EnvKeySource
from app.dataset.versions import check_version, record_version
from app.errors import BaseModelError, ConfigError, CvmTuneError, ExportError, StateError, TeeError
from app.fsutil import atomic_write_bytes, remove_stale_temps, staged_dir
from app.privacy_budget import record_spent
from app.tee import GuestAgent, Identity, open_guest_agent

Progress = Callable[[str], None]
SIMULATOR_POLICY_FILE = "simulator-test-policy.yaml"
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
    from app.training import TrainingStopped, TrainRequest, build_tiny_model, train  # heavy stack, imported lazily
    from app.training.backend import prepare_backend
    from app.training.checkpoints import CHECKPOINT_GETKEY_PATH
    from app.training.privacy import plan as privacy_plan
    from app.training.tokens import apply_token_policy

    hooks = hooks or RunHooks()

    if run_id is not None and not RUN_ID.fullmatch(run_id):
        raise ConfigError(f"run id {run_id!r} is not allowed", fix="use 1-100 letters, digits, '.', '_' or '-', not starting with '.' or '-'")
    timer, t0 = _Timer(), time.perf_counter()
    out = cfg.output.dir.resolve()
    for sub in ("state", "datasets", "models", "runs", "exports"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out / "exports")

    # 1. Guest agent: who are we (app id, compose hash)? Nothing runs without one.
    with ExitStack() as stack:
        with timer.phase("agent"):
            agent = stack.enter_context(open_guest_agent(cfg.tee))
        ident = agent.identity()
        simulated = cfg.tee.mode == "embedded-simulator" or ident.is_cvm_tune_simulator
        progress(f"guest agent: {_describe_agent(ident, simulated)}")
        compose_bytes = ident.app_compose.encode()
        if sha256_hex(compose_bytes) != ident.compose_hash:
            raise TeeError("the agent's app-compose text does not hash to its compose-hash", fix="report this: the guest agent is inconsistent")
        build = build_info(ident.app_compose)  # image digest from the measured compose, lock hash from the image

        # 2. Dataset key (GetKey-derived, a key file for the demo, an env var, or released by the owner).
        with timer.phase("key"):
            key_source = _key_source(cfg, agent, ident, out)
            key = key_source.dataset_key()
            # Checkpoints are sealed under their own GetKey path (bound to the app id, never on disk).
            ckpt_key = DerivedKeySource(agent.get_key, CHECKPOINT_GETKEY_PATH, "cvm-tune-checkpoint-key").dataset_key()

        # 3. Encrypted dataset: owner signature first (when pinned), then decrypt in memory,
        #    authenticate ALL of it, validate rows, drop duplicates; refuse a rolled-back version.
        dcfg = cfg.dataset
        owner_pub = bytes.fromhex(dcfg.owner_public_key) if dcfg.owner_public_key else None
        with timer.phase("decrypt_validate"):
            ds_path = _dataset_file(cfg, out, key, progress)
            with open(ds_path, "rb") as fh:
                stream = open_encrypted(fh, key, owner_public_key=owner_pub)
                rows, report_rows = parse_jsonl(stream, source=ds_path.name, max_row_bytes=dcfg.max_row_bytes,
                                           dedup=dcfg.dedup, max_plaintext_bytes=dcfg.max_plaintext_bytes)
            sig = stream.signature
            dataset = {
                "dataset_id": stream.header.dataset_id, "dataset_version": stream.header.dataset_version,
                "format": f"cvm-tune encrypted dataset v{stream.header.format_version}",
                "encrypted_sha256": stream.ciphertext_sha256,
                "encrypted_size": stream.ciphertext_size, "plaintext_sha256": stream.plaintext_sha256,
                "plaintext_size": stream.plaintext_size, "rows": report_rows.rows_kept, "key_source": key_source.describe(),
                "owner_public_key": sig.owner_public_key.hex() if sig else None,
                "owner_key_id": sig.owner_key_id if sig else None, "commitment": sig.commitment if sig else None,
                "validation": {"rows_read": report_rows.rows_total, "duplicates_dropped": report_rows.duplicates_dropped},
            }
            check_version(out / "state", dataset["dataset_id"], dataset["dataset_version"], dataset["plaintext_sha256"])
        signer = f", signed by owner key {sig.owner_key_id[:16]}…" if sig else ", not owner-signed"
        progress(f"dataset: {ds_path.name} v{dataset['dataset_version']} decrypted in memory and authenticated "
                 f"({stream.chunks} chunks{signer}), {report_rows.rows_kept} rows {dict(report_rows.by_kind)}, "
                 f"{report_rows.duplicates_dropped} duplicates dropped{_lines(report_rows.duplicate_lines)}")

        # 4. Backend first: Unsloth (GPU) must be imported before the first transformers import below.
        with timer.phase("train"):
            prepare_backend(cfg.training)

        # 4a. Base model: built or found locally, hashed, checked against the pin.
        with timer.phase("base_model"):
            base_dir, base_name = _base_model(cfg, out, build_tiny_model)
            base_tree, base_files = tree_digest(base_dir)
        if cfg.base_model.sha256 and base_tree != cfg.base_model.sha256:
            raise BaseModelError(f"base model {base_dir} has tree sha256 {base_tree}, config pins {cfg.base_model.sha256}",
                                 fix="restore the pinned base model files (never download them at run time)")
        progress(f"base model: {base_name} tree sha256 {base_tree[:16]}…")

        # 4b. Token budget: too-long policy, rows without a trainable token; counted, before training.
        with timer.phase("decrypt_validate"):
            rows, tokens = apply_token_policy(rows, base_model_dir=base_dir, max_length=cfg.training.max_length,
                                              assistant_only_loss=cfg.training.assistant_only_loss, too_long=dcfg.too_long,
                                              lines=report_rows.lines)
        dataset["rows"] = tokens.rows_out
        dataset["validation"].update(tokens.counts())
        progress(f"tokens: {tokens.rows_out} rows, {tokens.trainable_tokens} trainable tokens; {tokens.too_long} longer "
                 f"than {tokens.max_length} tokens ({dcfg.too_long}{_lines(tokens.too_long_lines)}), "
                 f"{tokens.dropped_no_trainable} without trainable tokens dropped{_lines(tokens.no_trainable_lines)}")

        # 5. Run identity: resume the newest unfinished run with the same inputs, else start one.
        config_bytes = cfg.canonical_json()
        with timer.phase("hashing"):
            code_sha = export.source_digest()
        inputs = {"config": sha256_hex(cfg.training_json()), "dataset": dataset["plaintext_sha256"], "base_model": base_tree}
        fingerprint = sha256_hex(json.dumps(inputs, sort_keys=True).encode())
        run_id, resuming = _pick_run(out, fingerprint, run_id)
        dp = privacy_plan(cfg.training, rows=len(rows), ledger=out / "state", dataset=dataset, run_id=run_id)  # DP-SGD: exit 2 if it cannot fit
        run_dir = out / "runs" / run_id
        started_at = json.loads((run_dir / "state.json").read_text())["started_at"] if resuming else utc_now()
        record_version(out / "state", dataset["dataset_id"], dataset["dataset_version"], dataset["plaintext_sha256"])
        _write_state(run_dir, {"run_id": run_id, "fingerprint": fingerprint, "status": "running", "started_at": started_at})

        # 6. Audit: run.start (or run.resume) commits to every input hash before training.
        with timer.phase("audit"):
            log = AuditLog(out / "state" / "audit.jsonl")
            recorder = AuditRecorder(log, agent, require_emit=cfg.tee.emit_events == "required")
            if resuming:
                recorder.record(run_id, "run.resume", {"fingerprint": fingerprint})
            else:
                recorder.record(run_id, "run.start", {
                    "config_sha256": sha256_hex(config_bytes),
                    "dataset_encrypted_sha256": dataset["encrypted_sha256"],
                    "dataset_plaintext_sha256": dataset["plaintext_sha256"],
                    "base_model_tree_sha256": base_tree, "code_source_sha256": code_sha})
        done: list[bool] = []  # set once the bundle is published
        stack.push(lambda _et, exc, _tb: _record_abort(recorder, run_id, exc, done))  # run.abort on any failure
        progress(f"run {run_id}: {'resuming' if resuming else 'started'}; audit events "
                 f"{'measured into RTMR3' if recorder.rtmr3 == 'emit_event' else 'NOT measured (' + str(recorder.note) + ')'}")

        # 6b. GPU evidence, fresh for this run: its nonce is the chain head (the entry just recorded).
        with timer.phase("gpu_evidence"):
            gpu = gpu_evidence.collect(log.head)
            recorder.record(run_id, "gpu.evidence", gpu.audit_data())
        progress(f"gpu: {describe_gpu(gpu.info)}")
        if cfg.tee.gpu_evidence == "required":
            gpu_evidence.require_confidential(gpu.info)

        # 7. Train (checkpoints under runs/<id>/checkpoints; resumes from the newest complete one).
        ts = cfg.training
        if (reason := hooks.should_stop()) is not None:
            raise TrainingStopped(f"{reason}: stopped before training")

        def step_end(step: int) -> str | None:
            hooks.on_step(step)
            return hooks.should_stop()

        def batch_changed(change: dict[str, Any]) -> None:  # OOM back-off / auto batch size: audited, in the manifest
            recorder.record(run_id, "train.batch", change)
            progress(f"  CUDA OOM in {change['phase']}: batch {change['from']} -> {change['to']}")

        with timer.phase("train"):
            result = train(TrainRequest(
                base_model_dir=base_dir, base_model_name=base_name, rows=rows, run_dir=run_dir, settings=ts,
                fingerprint=fingerprint, checkpoint_key=ckpt_key, inputs=inputs,
                scratch_dir=_scratch_dir(cfg, out), keep_checkpoints=cfg.output.keep_checkpoints,
                on_step_end=step_end, on_event=lambda t, d: recorder.record(run_id, t, d),
                on_log=lambda m: progress(f"  step {m['step']}/{ts.max_steps}  loss {m['loss']:.4f}"),
                on_batch_change=batch_changed, privacy=dp))
        if result.resumed_from_step:
            progress(f"training resumed from checkpoint step {result.resumed_from_step}")
        adapter_hashes = {f"adapter/{p.name}": sha256_file(p) for p in sorted(result.adapter_dir.iterdir())}
        with timer.phase("audit"):
            recorder.record(run_id, "train.done", {"global_step": result.global_step, "adapter_sha256": adapter_hashes})
            if result.privacy is not None:  # DP-SGD: (ε, δ) spent, audited and added to the dataset version's lifetime total
                recorder.record(run_id, "privacy.spent", result.privacy)
                record_spent(out / "state", dataset, run_id, result.privacy)

        # 8. Export: stage every file, commit to them in the audit chain, bind the manifest into a quote.
        final = out / "exports" / run_id
        checks = [
            f"guest agent {ident.version}: compose-hash consistent with its app-compose",
            f"dataset header and all {stream.chunks} chunks authenticated before any row was used",
            f"rows validated: {report_rows.rows_kept} of {report_rows.rows_total} kept",
            "base model tree hash " + ("matches the pinned sha256" if cfg.base_model.sha256 else "recorded (not pinned)"),
            (f"resumed from sealed checkpoint step {result.resumed_from_step} (manifest and blob hashes verified)"
             if result.resumed_from_step else "trained from step 0"),
            *(f"refused {name}: {why}" for name, why in result.rejected_checkpoints),
            "loss watchdog: " + ("no NaN/Inf or spike" if ts.loss_watchdog.enabled else "disabled"),
        ]
        with timer.phase("export"), _disk_errors(f"writing the export bundle {final}"), staged_dir(final) as stage:
            (stage / "adapter").mkdir()
            for p in result.adapter_dir.iterdir():
                shutil.copyfile(p, stage / "adapter" / p.name)
            (stage / B.CONFIG).write_bytes(config_bytes)
            (stage / B.APP_COMPOSE).write_bytes(compose_bytes)
            (stage / B.GPU_EVIDENCE).write_bytes(gpu.data)
            last_loss = result.losses[-1][1] if result.losses else None
            (stage / B.MODEL_CARD).write_bytes(export.model_card(
                run_id=run_id, base_model=base_name, base_tree=base_tree, dataset=dataset, backend=result.backend,
                steps=result.global_step, last_loss=last_loss, simulated=simulated))
            effective_batch = result.batch.get("effective", ts.per_device_batch_size * ts.gradient_accumulation_steps)
            run_report = report.build(run_id=run_id, slot=hooks.slot, timings=timer.t, train=result,
                                      effective_batch_size=effective_batch,
                                      rows=report_rows, checks=checks, validation=dataset["validation"])
            report_files = report.write(stage, run_report)
            artifacts = {rel: sha256_file(stage / rel) for rel in B.ARTIFACT_FILES}
            with timer.phase("audit"):
                recorder.record(run_id, "export", {"artifacts_sha256": files_digest(artifacts)})
            entries = log.run_slice(run_id)
            (stage / B.AUDIT).write_bytes(b"".join(e.line + b"\n" for e in entries))
            manifest = export.manifest_bytes({
                "schema": B.MANIFEST_SCHEMA, "run_id": run_id, "started_at": started_at, "created_at": utc_now(),
                "code": {"package": "cvm-tune", "version": app.__version__, "source_sha256": code_sha},
                "backend": {"name": result.backend, "device": result.device,
                            "libraries": export.library_versions(result.library_versions)},
                "base_model": {"name": base_name, "source": cfg.base_model.source, "tree_sha256": base_tree, "files": base_files},
                "dataset": dataset,
                "tee": {"mode": cfg.tee.mode, "app_id": ident.app_id, "instance_id": ident.instance_id,
                        "compose_hash": ident.compose_hash, "agent_version": ident.version, "agent_rev": ident.rev},
                "training": {"seed": ts.seed, "global_step": result.global_step, "resumed_from_step": result.resumed_from_step,
                             "losses": result.losses, "train_runtime_s": round(result.train_runtime_s, 3),
                             "tokens_seen": result.tokens_seen,
                             "effective_batch_size": effective_batch,
                             "batch": result.batch or None, "eval_losses": result.eval_losses or None},
                "audit": {"head": entries[-1].hash, "start_prev": entries[0].prev, "first_seq": entries[0].seq,
                          "entries": len(entries), "rtmr3": recorder.rtmr3 or "unsupported"},
                "files": {**artifacts, B.AUDIT: sha256_file(stage / B.AUDIT), B.GPU_EVIDENCE: gpu.info.evidence_sha256,
                          **{rel: sha256_file(p) for rel, p in report_files.items()}},
                "gpu": gpu.info.model_dump(mode="json"),
                "build": build,
                **({"privacy": result.privacy} if result.privacy is not None else {}),
            })
            (stage / B.MANIFEST).write_bytes(manifest)
            with timer.phase("quote"):
                quote, event_log = agent.quote(B.manifest_report_data(manifest))
            (stage / B.QUOTE_BIN).write_bytes(quote)
            (stage / B.QUOTE_HEX).write_text(quote.hex() + "\n")
            (stage / B.EVENT_LOG).write_text(event_log)
            with timer.phase("collateral"):
                collateral = None if cfg.tee.collateral == "none" else agent.collateral(
                    quote, pccs_url=cfg.tee.pccs_url, timeout_s=cfg.tee.timeout_s)
            if collateral is not None:
                (stage / B.COLLATERAL).write_text(collateral)
            else:
                progress("collateral: not available; verify later with --collateral (fresh collateral from a PCCS)")
        done.append(True)
        _write_state(run_dir, {"run_id": run_id, "fingerprint": fingerprint, "status": "exported",
                               "started_at": started_at, "bundle": str(final)})
        progress(f"exported: {final}")

        # 9. Check our own work the way a relying party will.
        with timer.phase("self_verify"):
            verdicts, policy_file = _self_verify(final, out, agent, simulated)
    timer.t["total"] = time.perf_counter() - t0
    return RunResult(run_id, final, verdicts, policy_file, result.losses, timer.t, result.train_runtime_s,
                     result.resumed_from_step, run_report, entries[-1].hash)


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


@contextmanager
def _disk_errors(what: str) -> Iterator[None]:
    """Disk full (or any OS error) while writing state: a clean StateError, nothing half-written kept."""
    try:
        yield
    except OSError as exc:
        raise ExportError(f"{what} failed: {exc.strerror or type(exc).__name__}",
                          fix="free space on the output volume and run again; no partial bundle was kept") from exc


def _scratch_dir(cfg: Config, out: Path) -> Path:
    """Private directory for the trainer's plaintext checkpoints: RAM when possible, never the volume."""
    import os
    import tempfile

    base = cfg.output.scratch_dir
    if base is None:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    path = Path(base).resolve() / f"cvm-tune-{sha256_hex(str(out).encode())[:12]}"
    if path == out or out in path.parents:
        raise ConfigError(f"output.scratch_dir {base} is on the output volume", fix="point it at /dev/shm or a tmpfs")
    return path


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


def _pick_run(out: Path, fingerprint: str, requested: str | None) -> tuple[str, bool]:
    """(run_id, resuming). Only the newest run may be resumed, and only with the same inputs."""
    runs = sorted((out / "runs").glob("*/state.json"), key=lambda p: p.stat().st_mtime)
    if requested:
        state = out / "runs" / requested / "state.json"
        if state.exists():
            s = json.loads(state.read_text())
            if s["status"] == "exported":
                raise StateError(f"run {requested} was already exported", fix="choose a new --run-id")
            if s["fingerprint"] != fingerprint:
                raise StateError(f"run {requested} was started with other inputs (config, dataset or base model)",
                                 fix="choose a new --run-id")
            return requested, True
        return requested, False
    if runs:
        s = json.loads(runs[-1].read_text())
        if s["status"] == "running" and s["fingerprint"] == fingerprint:
            return s["run_id"], True
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"run-{stamp}-{secrets.token_hex(2)}", False


def _write_state(run_dir: Path, state: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(run_dir / "state.json", json.dumps(state, sort_keys=True, indent=2).encode())


def _self_verify(bundle: Path, out: Path, agent: GuestAgent, simulated: bool) -> tuple[list[tuple[str, Verdict]], Path | None]:
    """Verify the new bundle under the default policy and, for the simulator, its test-CA policy."""
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
