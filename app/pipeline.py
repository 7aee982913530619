"""One attested training run, top to bottom: decrypt -> validate -> train -> export -> attest.

``run_once(cfg, progress=print)`` is the whole job. Each numbered step is one call into a small
module; read this file to know what happens in what order and what is hashed where.
Fail-closed rules: no quote, no export; the dataset is fully authenticated before training; a
bundle appears under ``exports/`` only when complete (staged, fsynced, renamed).
"""

from __future__ import annotations

import json
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
from attestation.hashing import files_digest, sha256_file, sha256_hex, tree_digest
from attestation.policy import policy_file_text, simulator_policy

import app
from app import export
from app.audit import AuditLog, AuditRecorder, utc_now
from app.build_info import build_info
from app.config import Config
from app.dataset import DerivedKeySource, KeyFileSource, KeySource, encrypt_file, open_encrypted, parse_jsonl
from app.errors import BaseModelError, ConfigError, StateError, TeeError
from app.fsutil import atomic_write_bytes, remove_stale_temps, staged_dir
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


def run_once(cfg: Config, *, progress: Progress = lambda _m: None, run_id: str | None = None) -> RunResult:
    """Run one attested fine-tune and export its bundle.

    Raises:
        CvmTuneError: any data, key, attestation, training or state failure (nothing exported).
    """
    from app.training import TrainRequest, build_tiny_model, train  # heavy stack, imported lazily

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

        # 2. Dataset key (GetKey-derived, or a key file for the demo).
        with timer.phase("key"):
            key_source = _key_source(cfg, agent)
            key = key_source.dataset_key()

        # 3. Encrypted dataset: decrypt in memory, authenticate ALL of it, then validate rows.
        with timer.phase("decrypt_validate"):
            ds_path = _dataset_file(cfg, out, key, progress)
            with open(ds_path, "rb") as fh:
                stream = open_encrypted(fh, key)
                rows, report = parse_jsonl(stream, source=ds_path.name, max_row_bytes=cfg.dataset.max_row_bytes)
            dataset = {
                "dataset_id": stream.header.dataset_id, "dataset_version": stream.header.dataset_version,
                "format": "cvm-tune encrypted dataset v1", "encrypted_sha256": stream.ciphertext_sha256,
                "encrypted_size": stream.ciphertext_size, "plaintext_sha256": stream.plaintext_sha256,
                "plaintext_size": stream.plaintext_size, "rows": report.rows_kept, "key_source": key_source.describe(),
            }
        progress(f"dataset: {ds_path.name} decrypted in memory and authenticated ({stream.chunks} chunks), "
                 f"{report.rows_kept} rows {dict(report.by_kind)}")

        # 4. Base model: built or found locally, hashed, checked against the pin.
        with timer.phase("base_model"):
            base_dir, base_name = _base_model(cfg, out, build_tiny_model)
            base_tree, base_files = tree_digest(base_dir)
        if cfg.base_model.sha256 and base_tree != cfg.base_model.sha256:
            raise BaseModelError(f"base model {base_dir} has tree sha256 {base_tree}, config pins {cfg.base_model.sha256}",
                                 fix="restore the pinned base model files (never download them at run time)")
        progress(f"base model: {base_name} tree sha256 {base_tree[:16]}…")

        # 5. Run identity: resume the newest unfinished run with the same inputs, else start one.
        config_bytes = cfg.canonical_json()
        with timer.phase("hashing"):
            code_sha = export.source_digest()
        fingerprint = sha256_hex(json.dumps([sha256_hex(config_bytes), dataset["plaintext_sha256"], base_tree]).encode())
        run_id, resuming = _pick_run(out, fingerprint, run_id)
        run_dir = out / "runs" / run_id
        started_at = json.loads((run_dir / "state.json").read_text())["started_at"] if resuming else utc_now()
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
        progress(f"run {run_id}: {'resuming' if resuming else 'started'}; audit events "
                 f"{'measured into RTMR3' if recorder.rtmr3 == 'emit_event' else 'NOT measured (' + str(recorder.note) + ')'}")

        # 7. Train (checkpoints under runs/<id>/checkpoints; resumes from the newest complete one).
        ts = cfg.training
        with timer.phase("train"):
            result = train(TrainRequest(
                base_model_dir=base_dir, base_model_name=base_name, rows=rows, run_dir=run_dir, settings=ts,
                fingerprint=fingerprint,
                on_log=lambda m: progress(f"  step {m['step']}/{ts.max_steps}  loss {m['loss']:.4f}")))
        if result.resumed_from_step:
            progress(f"training resumed from checkpoint step {result.resumed_from_step}")
        adapter_hashes = {f"adapter/{p.name}": sha256_file(p) for p in sorted(result.adapter_dir.iterdir())}
        with timer.phase("audit"):
            recorder.record(run_id, "train.done", {"global_step": result.global_step, "adapter_sha256": adapter_hashes})

        # 8. Export: stage every file, commit to them in the audit chain, bind the manifest into a quote.
        final = out / "exports" / run_id
        with timer.phase("export"), staged_dir(final) as stage:
            (stage / "adapter").mkdir()
            for p in result.adapter_dir.iterdir():
                shutil.copyfile(p, stage / "adapter" / p.name)
            (stage / B.CONFIG).write_bytes(config_bytes)
            (stage / B.APP_COMPOSE).write_bytes(compose_bytes)
            last_loss = result.losses[-1][1] if result.losses else None
            (stage / B.MODEL_CARD).write_bytes(export.model_card(
                run_id=run_id, base_model=base_name, base_tree=base_tree, dataset=dataset, backend=result.backend,
                steps=result.global_step, last_loss=last_loss, simulated=simulated))
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
                             "effective_batch_size": ts.per_device_batch_size * ts.gradient_accumulation_steps},
                "audit": {"head": entries[-1].hash, "start_prev": entries[0].prev, "first_seq": entries[0].seq,
                          "entries": len(entries), "rtmr3": recorder.rtmr3 or "unsupported"},
                "files": {**artifacts, B.AUDIT: sha256_file(stage / B.AUDIT)},
                "build": build,
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
        _write_state(run_dir, {"run_id": run_id, "fingerprint": fingerprint, "status": "exported",
                               "started_at": started_at, "bundle": str(final)})
        progress(f"exported: {final}")

        # 9. Check our own work the way a relying party will.
        with timer.phase("self_verify"):
            verdicts, policy_file = _self_verify(final, out, agent, simulated)
    timer.t["total"] = time.perf_counter() - t0
    return RunResult(run_id, final, verdicts, policy_file, result.losses, timer.t, result.train_runtime_s,
                     result.resumed_from_step)


def _describe_agent(ident: Identity, simulated: bool) -> str:
    kind = "cvm-tune SIMULATOR (test CA, not a TEE)" if simulated else "dstack"
    return f"{kind} {ident.version} app_id {ident.app_id} compose_hash {ident.compose_hash[:16]}…"


def _key_source(cfg: Config, agent: GuestAgent) -> KeySource:
    k = cfg.dataset.key
    if k.source == "file":
        return KeyFileSource(k.file)  # type: ignore[arg-type]  # validated: file is set
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
