"""LoRA fine-tuning of a local base model, with resumable checkpoints on the output volume.

Import-light on purpose: this module pulls in no torch/transformers/trl/peft/unsloth, so the CLI
and the ``attestation`` package stay fast. :func:`train`, :func:`select_backend` and
:func:`build_tiny_model` import the heavy stack inside the call.

Backends: ``hf`` (transformers + PEFT + TRL, CPU or GPU) and ``unsloth`` (GPU only; imported
only by :mod:`app.training.backend`, and only after the selection says so, before trl/transformers/peft).

Usage::

    from app.training import TrainRequest, train
    result = train(TrainRequest(base_model_dir=..., base_model_name="cvm-tune/tiny-llama", rows=rows,
                                run_dir=run_dir, settings=cfg.training, fingerprint=fp))
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.errors import TrainingError

if TYPE_CHECKING:
    from app.config import TrainingSettings

__all__ = [
    "LossDiverged",
    "TrainRequest",
    "TrainResult",
    "TrainingInterrupted",
    "TrainingStopped",
    "build_tiny_model",
    "select_backend",
    "set_offline_env",
    "train",
]

# Set before any HF/Unsloth import: no Hub calls, no telemetry, no Unsloth statistics download.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "UNSLOTH_DISABLE_STATISTICS": "1",
}


def set_offline_env() -> None:
    """Force the HF/Unsloth offline switches in ``os.environ`` (idempotent)."""
    os.environ.update(OFFLINE_ENV)


@dataclass(frozen=True)
class TrainRequest:
    """One training job.

    Attributes:
        base_model_dir: Local HF model directory (config.json, model.safetensors, tokenizer files).
        base_model_name: Written as ``base_model_name_or_path`` in adapter_config.json (never a path).
        base_model_revision: Written as ``revision`` in adapter_config.json when set (the base's Hub revision).
        rows: Validated rows, ``{"messages": [{"role", "content"}, ...]}`` or ``{"text": str}``; may be mixed.
            ``training.objective: dpo``: preference rows ``{"prompt", "chosen", "rejected"}`` (``app.training.dpo``).
        run_dir: Checkpoints go to ``run_dir/"checkpoints"``, the adapter to ``run_dir/"adapter"``.
        settings: Hyper-parameters (``app.config.TrainingSettings``).
        fingerprint: Hex sha256 binding config + dataset + base model; checkpoints with another
            fingerprint are never resumed.
        on_log: Called at every logging step with ``{"step", "loss", "learning_rate", "grad_norm",
            "epoch", "elapsed_s", "steps_this_run", "tokens_this_run"}`` (metrics only, never data; the last three
            count from when this process began training, so a resumed run's rates are its own).
        stop_after_step: Test/bench hook: raise :class:`TrainingInterrupted` once this optimizer
            step has been checkpointed (simulates a crash right after a checkpoint).
        checkpoint_key: 32-byte key that seals checkpoints on the output volume (GetKey-derived in
            the pipeline). ``None``: a random key for this process only (nothing resumable later).
        inputs: ``{"config"|"dataset"|"base_model": sha256}`` behind ``fingerprint``; a sealed
            checkpoint of other inputs is refused naming the one that differs.
        scratch_dir: Private directory (RAM) for the trainer's plaintext checkpoints; emptied
            first and removed at the end. ``None``: a fresh temporary directory.
        keep_checkpoints: Sealed checkpoints kept on the volume.
        on_step_end: Called after every optimizer step with the global step; a returned string is
            a reason to checkpoint now and stop (SIGTERM, watchdog): :class:`TrainingStopped`.
        on_event: Called with ``("checkpoint", {"global_step", "manifest_sha256"})`` for every
            sealed checkpoint and ``("checkpoint.rejected", {"checkpoint", "reason"})`` for every
            one skipped on resume (audit entries; no data).
        on_batch_change: Called with each micro-batch change (OOM back-off, auto batch size):
            ``{"phase", "reason", "at_step", "from", "to"}`` (``app.training.batch``).
        init_adapter: Warm start: a PEFT adapter directory of the same LoRA shape whose weights replace the fresh
            LoRA initialisation (continual retraining); a resumed checkpoint's weights still win.
        privacy: The DP-SGD plan (``app.training.privacy.plan``); ``None`` trains without DP.
        proximal: FedProx: add ``proximal / 2 * ||w - w0||^2`` over the LoRA weights to the loss, ``w0`` being the
            weights training starts from (the federated round's global adapter): ``app.training.prox``.
        tokenized: The token ids of ``rows``, aligned (``app.training.tokens.tokenize_rows``): the ``hf`` backend
            hands them to TRL, which then does not tokenize the rows again. ``None``: TRL tokenizes ``rows``.
    """

    base_model_dir: Path
    base_model_name: str
    rows: Sequence[Mapping[str, Any]]
    run_dir: Path
    settings: TrainingSettings
    fingerprint: str
    on_log: Callable[[dict[str, Any]], None] | None = None
    stop_after_step: int | None = None
    checkpoint_key: bytes | None = None
    inputs: Mapping[str, str] | None = None
    scratch_dir: Path | None = None
    keep_checkpoints: int = 3
    base_model_revision: str | None = None
    on_step_end: Callable[[int], str | None] | None = None
    on_event: Callable[[str, dict[str, Any]], None] | None = None
    on_batch_change: Callable[[dict[str, Any]], None] | None = None
    init_adapter: Path | None = None
    privacy: Any = None  # app.training.privacy.PrivacyPlan: DP-SGD (None: off)
    proximal: float | None = None
    tokenized: Sequence[Mapping[str, Sequence[int]]] | None = None


@dataclass(frozen=True)
class TrainResult:
    """What a finished training run produced.

    Attributes:
        adapter_dir: ``run_dir/"adapter"``: exactly adapter_config.json + adapter_model.safetensors.
        backend: ``"hf"`` or ``"unsloth"``.
        device: ``"cpu"`` or e.g. ``"cuda:0 NVIDIA H100 80GB HBM3"``.
        losses: ``(step, loss)`` for every logging step, including those restored from a resumed
            checkpoint's log history.
        global_step: Final optimizer step.
        resumed_from_step: Step of the checkpoint resumed from; ``None`` when trained from scratch.
        train_runtime_s: Wall seconds inside ``trainer.train()`` in this process.
        tokens_seen: Non-padding input tokens over the whole run (restored across resumes).
        library_versions: torch, transformers, peft, trl, datasets, accelerate (+ unsloth,
            unsloth_zoo, bitsandbytes when used).
        rejected_checkpoints: ``(name, reason)`` of sealed checkpoints skipped on resume.
        peak_gpu_memory_bytes: ``torch.cuda.max_memory_allocated`` (``None`` on CPU).
            unsloth_zoo, bitsandbytes, triton when used), as imported.
        batch: Configured and final micro-batch / accumulation, processes, effective batch and
            every adjustment (``app.training.batch.summary``).
        eval_losses: ``(step, eval loss)`` when ``training.eval_fraction`` > 0.
        privacy: DP-SGD only: the manifest's ``privacy`` block (``app.training.privacy.outcome``).
        cpu_threads: torch's CPU thread count and why (``app.training.threads.resolve``).
    """

    adapter_dir: Path
    backend: str
    device: str
    losses: list[tuple[int, float]]
    global_step: int
    resumed_from_step: int | None
    train_runtime_s: float
    tokens_seen: int | None
    library_versions: dict[str, str]
    rejected_checkpoints: list[tuple[str, str]] = field(default_factory=list)
    peak_gpu_memory_bytes: int | None = None
    batch: dict[str, Any] = field(default_factory=dict)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    privacy: dict[str, Any] | None = None
    cpu_threads: dict[str, Any] = field(default_factory=dict)


class TrainingInterrupted(TrainingError):
    """Raised by the ``stop_after_step`` hook right after that step's checkpoint was sealed."""

    default_fix = "run again with the same inputs: training resumes from the last complete checkpoint"


class TrainingStopped(TrainingError):
    """A stop was requested (SIGTERM, watchdog): the last step's checkpoint was sealed, then training stopped."""

    default_fix = "run again with the same inputs: training resumes from the checkpoint just sealed"


class LossDiverged(TrainingError):
    """The loss watchdog saw NaN/Inf or a lasting spike: nothing exported, the last good checkpoint kept."""

    default_fix = ("lower training.learning_rate or check the dataset; the run resumes from the last good "
                   "checkpoint (training.loss_watchdog tunes the detector)")


def select_backend(preference: str) -> str:
    """Resolve ``auto``/``hf``/``unsloth`` to the backend that will run (imports torch, not unsloth).

    Args:
        preference: ``TrainingSettings.backend``.

    Returns:
        ``"hf"`` or ``"unsloth"``.

    Raises:
        TrainingError: ``unsloth`` was requested but cannot be used here, or an unknown name.
    """
    from app.training.backend import select_backend as _select

    return _select(preference)


def train(req: TrainRequest) -> TrainResult:
    """Fine-tune a LoRA adapter; resumes from the newest complete checkpoint of the same fingerprint.

    Args:
        req: The job.

    Returns:
        The exported adapter and run metrics.

    Raises:
        BaseModelError: the base model directory is missing or cannot be loaded.
        TrainingInterrupted: the ``stop_after_step`` hook fired.
        TrainingError: anything else that stops training (wrapped, message without data).
        StateError: the adapter cannot be written to ``run_dir``.
    """
    from app.training import launch

    launch.refuse_foreign_launcher()
    if req.settings.gpu.devices > 1 and not launch.in_worker():
        return launch.train_distributed(req)  # N worker processes; this one keeps attesting
    from app.training.backend import train as _train

    return _train(req)


def build_tiny_model(out_dir: Path) -> None:
    """Build the deterministic tiny Llama demo model into ``out_dir`` (kept if already complete).

    Args:
        out_dir: Target model directory.

    Raises:
        BaseModelError: ``out_dir`` is an incomplete directory or the build failed.
    """
    from app.training.tiny_model import build_tiny_model as _build

    _build(out_dir)
