"""Every save of the training API is also an export bundle under ``exports/`` that ``cvm-tune verify`` accepts.

The bundle is built by the same export stage as a nightly run (:func:`app.export.stage.export_bundle`: adapter,
tokenizer, signature, model card, report, audit slice, manifest, quote, self-verification), with what an API model
has in place of a dataset: the manifest's ``op_chain`` block (head, op count, LoRA and the last Adam parameters)
and a ``dataset`` entry that names the op chain (``dataset_id`` ``tinker-api``, both dataset hashes = the chain
head, ``rows`` = the op count). The audit slice commits to them like a run's: ``run.start`` (inputs),
``gpu.evidence``, ``train.done`` (adapter hashes), ``export``. The manifest's ``backend`` block records the API's
training backend (``api.backend``: ``hf`` or ``unsloth``), the device and the library versions as imported, as a
nightly run records its own. With ``export.recipients`` set, the bundle's weight files are age ciphertext to those
recipients and the CVM's own key, named ``<name>.age`` and built in RAM, as a nightly run's (manifest
``confidentiality``).
"""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path
from typing import Any

from attestation.io.hashing import sha256_file, sha256_hex

from app import export
from app.api.engine.engine import LORA_ALPHA, LORA_DROPOUT
from app.audit import AuditLog, AuditRecorder, utc_now
from app.config import Config
from app.dataset.rows import RowReport
from app.export import stage as export_stage
from app.export.confidential import make_plan
from app.run import gpu as gpu_evidence
from app.run.stages import Agent, BaseModel
from app.training import TrainResult
from app.training.options import device_label, imported_versions, library_names

OP_CHAIN_SCHEMA = "cvm-tune/op-chain/v1"


class Exporter:
    def __init__(self, cfg: Config, out: Path, agent: Agent, base: BaseModel, *, backend: str = "hf") -> None:
        self.cfg, self.out, self.ag, self.base, self.backend = cfg, Path(out), agent, base, backend
        self.log = AuditLog(self.out / "state" / "audit.jsonl")
        self.recorder = AuditRecorder(self.log, agent.agent, require_emit=cfg.tee.emit_events == "required")

    def export(self, m: Any, adapter_dir: Path, path: str) -> Path:
        """Publish ``exports/<run id>`` for model ``m`` saved at ``adapter_dir`` as ``path``; returns the bundle."""
        run_id = "api-" + re.sub(r"[^A-Za-z0-9._-]", "-", path.removeprefix("tinker://"))[:90] + f"-{int(time.time())}"
        lora = m.lora
        ts = self.cfg.training.model_copy(update={"seed": lora.get("seed") or 0, "lora": self.cfg.training.lora.model_copy(
            update={"r": lora["rank"], "alpha": LORA_ALPHA, "dropout": LORA_DROPOUT,
                    "target_modules": tuple(self._targets(adapter_dir))})})
        cfg = self.cfg.model_copy(update={"training": ts})
        config_bytes = cfg.canonical_json()
        op_chain = {"schema": OP_CHAIN_SCHEMA, "head": m.op_head, "ops": m.ops, "optimizer_steps": m.steps,
                    "checkpoint": path, "lora": lora, "adam_params": m.last_adam,
                    **({"dp": dict(m.dp)} if m.dp is not None else {}), "determinism": _determinism(),
                    **({"custom_losses": dict(m.custom_losses)} if getattr(m, "custom_losses", None) else {})}
        dataset = {"dataset_id": "tinker-api", "dataset_version": m.ops, "format": "tinker-ops/v1",
                   "encrypted_sha256": m.op_head, "encrypted_size": 0, "plaintext_sha256": m.op_head,
                   "plaintext_size": 0, "rows": m.ops, "key_source": "none", "validation": None}
        code_sha = export.source_digest()
        self.recorder.record(run_id, "run.start", {
            "config_sha256": sha256_hex(config_bytes), "training_config_sha256": sha256_hex(cfg.training_json()),
            "dataset_id": "tinker-api", "dataset_version": m.ops, "dataset_encrypted_sha256": m.op_head,
            "dataset_plaintext_sha256": m.op_head, "base_model_tree_sha256": self.base.tree,
            "code_source_sha256": code_sha, "parent_manifest_sha256": None, "op_chain": op_chain})
        gpu = gpu_evidence.collect(self.log.head, agent=self.ag.agent)  # dstack 0.6: its GPU evidence too
        self.recorder.record(run_id, "gpu.evidence", gpu.audit_data())
        self.recorder.record(run_id, "train.done", {"global_step": m.steps, "adapter_sha256": {
            f"adapter/{n}": sha256_file(adapter_dir / n) for n in ("adapter_config.json", "adapter_model.safetensors")}})
        train = _Adapter(adapter_dir)  # in RAM beside the saved state
        plan = None
        if self.cfg.export.recipients:  # weights encrypted to them and to the CVM, built in RAM (as a nightly run)
            train.plain.mkdir(mode=0o700)
            plan = make_plan(self.ag.agent.get_key, (), tuple(sorted(self.cfg.export.recipients)), train.plain)
        result = TrainResult(adapter_dir=train.dir, backend=self.backend, device=_device(),
                             losses=list(m.losses), global_step=m.steps, resumed_from_step=None, train_runtime_s=0.0,
                             tokens_seen=m.tokens_seen,
                             library_versions=imported_versions(library_names(self.backend)))
        inputs = export_stage.ExportInputs(
            cfg=cfg, out=self.out, run_id=run_id, started_at=utc_now(), code_sha=code_sha, config_bytes=config_bytes,
            agent=self.ag.agent, ident=self.ag.ident, simulated=self.ag.simulated,
            compose_bytes=self.ag.compose_bytes, build=self.ag.build, dataset=dataset,
            rows_report=RowReport(rows_total=m.ops, rows_kept=m.ops, by_kind={"op": m.ops}), chunks=0,
            base_dir=self.base.dir, base_name=self.base.name, base_tree=self.base.tree, base_files=self.base.files,
            train=result, gpu=gpu, log=self.log, recorder=self.recorder, slot=None, op_chain=op_chain,
            confidential=plan)
        try:
            published = export_stage.export_bundle(inputs, phase=lambda _n: contextlib.nullcontext(), timings={},
                                                   progress=lambda _m: None)
        finally:
            train.cleanup()
        return published.bundle

    @staticmethod
    def _targets(adapter_dir: Path) -> list[str]:
        import json

        return sorted(json.loads((adapter_dir / "adapter_config.json").read_text())["target_modules"])


class _Adapter:
    """The adapter files alone (the export copies every file of ``adapter_dir``; the optimizer state stays out), in
    a sibling of ``src``: the saved state is in RAM, and so is this copy (never the system's temporary directory,
    which may be a disk). ``plain``: the sibling a confidential export builds its plaintext in (created by the caller)."""

    def __init__(self, src: Path) -> None:
        import shutil

        self.dir = src.with_name(src.name + "-adapter")
        self.plain = src.with_name(src.name + "-plain")
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(mode=0o700)
        for n in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copyfile(src / n, self.dir / n)

    def cleanup(self) -> None:
        import shutil

        for d in (self.dir, self.plain):
            shutil.rmtree(d, ignore_errors=True)


def _determinism() -> dict[str, int | str]:
    """What replaying the ops bit for bit needs besides the library versions (``backend``): the device the engine
    computed on, torch's CPU threads (reductions are split by thread), and on a CPU the rows every packed pass was
    padded to (``pass_rows``, :func:`app.api.engine.packed.rows_min`; 0: no packed passes, as this CPU cannot make them
    exact)."""
    import torch

    from app.api.engine.packed import pad_rows

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {"device": device, "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            **({"pass_rows": pad_rows(device) or 0} if device == "cpu" else {})}


def _device() -> str:
    """As a nightly run records it (:func:`app.training.options.device_label`)."""
    import torch

    return device_label(torch.cuda.is_available())
