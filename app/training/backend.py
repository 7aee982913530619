"""The training recipe: backend selection, model loading, TRL SFT with sealed checkpoints, export.

Top to bottom, :func:`train`:

1. Select the backend (``hf`` or ``unsloth``) **before** importing trl/transformers/peft: Unsloth
   monkeypatches those libraries at import time and must be imported first in the process. Only
   :func:`_import_unsloth` imports it first (the training API's ``app.api.engine.backend`` too), only on that
   branch, so importing this module on a CPU machine never touches Unsloth (GPU-only).
2. Load the base model from a local directory only (``local_files_only``, offline env vars) and
   seed everything first so the LoRA initialisation is reproducible.
3. Build an in-memory ``datasets.Dataset`` (never a cache file: plaintext stays in RAM): the token stage's
   ids when the request has them (``hf``: TRL does not tokenize again), else the rows (``sft_data.py``).
4. Decrypt the newest usable sealed checkpoint of this fingerprint into the private scratch
   directory (``checkpoints.py``); unusable ones are reported and dropped.
5. ``SFTTrainer.train(resume_from_checkpoint=<that path or None>)`` with ``output_dir`` = scratch;
   a callback seals (encrypts) every save onto the output volume and deletes the plaintext, stops
   at a step boundary with a sealed checkpoint when asked (SIGTERM, watchdog), and runs the loss
   watchdog (``watchdog.py``). Steps 2-5 are one attempt: a CUDA OOM before the first optimizer
   step reloads and retries with a smaller micro-batch at the same effective batch
   (``batch.run_with_backoff``); an eval OOM only shrinks the eval batch.
6. Export exactly ``adapter_config.json`` + ``adapter_model.safetensors`` atomically, with a
   normalised ``base_model_name_or_path`` (rank 0 only when ``launch`` runs several processes).

Both backends share everything except step 2 (``_load_hf`` / ``_load_unsloth``); the arguments
of both are built in ``options.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.errors import BaseModelError, CvmTuneError, StateError, TrainingError, disk_error

from . import TrainRequest, TrainResult, dpo, privacy, ranks, set_offline_env, threads
from .batch import BatchPlan, OutOfMemory, guard_eval, initial_plan, is_oom, retry_budget, run_with_backoff, step_watch
from .batch import summary as batch_summary
from .callback import callback_class
from .checkpoints import ResumeChoice, export_adapter, restore_checkpoint
from .options import (
    OPTIMIZER_ARGS,
    apply_unsloth_env,
    check_base_dir,
    first_line,
    check_options,
    check_triton_toolchain,
    device_label,
    gradient_checkpointing,
    hf_model_kwargs,
    imported_versions,
    library_names,
    sft_batch_kwargs,
    split_eval,
    unsloth_load_kwargs,
    unsloth_peft_kwargs,
)
from .sft_data import is_pretokenized, sft_dataset

if TYPE_CHECKING:
    from app.config import TrainingSettings

logger = logging.getLogger(__name__)


def select_backend(preference: str, *, devices: int = 1, setting: str = "training.backend") -> str:
    """Resolve the configured backend; imports torch (to look for CUDA) but never unsloth.

    Args:
        preference: ``"auto"``, ``"hf"`` or ``"unsloth"``.
        devices: ``training.gpu.devices``; multi-process training runs the HF backend.
        setting: The setting the errors name (the training API passes ``api.backend``).

    Returns:
        ``"unsloth"`` for ``auto`` when a CUDA GPU is visible, unsloth is installed and one device
        is used, else ``"hf"``.

    Raises:
        TrainingError: ``unsloth`` requested without a GPU or without the package; unknown name.
    """
    if preference == "hf":
        return "hf"
    if preference not in ("auto", "unsloth"):
        raise TrainingError(f"unknown training backend {preference!r}", fix=f"set {setting} to auto, hf or unsloth")
    import torch

    cuda = torch.cuda.is_available()
    try:
        has_unsloth = importlib.util.find_spec("unsloth") is not None  # top-level spec: does not import it
    except (ImportError, ValueError):
        has_unsloth = False
    if preference == "auto":
        return "unsloth" if cuda and has_unsloth and devices == 1 else "hf"
    if not cuda:
        raise TrainingError(f"{setting} is 'unsloth' but no CUDA GPU is visible (Unsloth is GPU-only)",
                            fix=f"set {setting} to 'auto' or 'hf' (transformers+PEFT), or run on an NVIDIA GPU")
    if not has_unsloth:
        raise TrainingError(f"{setting} is 'unsloth' but the unsloth package is not installed",
                            fix=f"install the GPU extra (pip install -e '.[gpu]') or set {setting} to 'auto'")
    return "unsloth"


@contextlib.contextmanager
def scratch_dir(requested: Path | None) -> Iterator[Path]:
    """The private plaintext-checkpoint directory: emptied first (a crash may have left one), removed after."""
    if requested is None:
        path = Path(tempfile.mkdtemp(prefix="cvm-tune-scratch-"))
    else:
        path = Path(requested)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(mode=0o700, parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def checkpoint_key(req: TrainRequest) -> bytes:
    """The key that seals this run's checkpoints (``None`` in the request: random, nothing resumable later)."""
    return req.checkpoint_key if req.checkpoint_key is not None else os.urandom(32)


def _inputs(req: TrainRequest) -> dict[str, str]:
    """The input hashes a sealed checkpoint records (to name what differs when one is refused)."""
    return dict(req.inputs or {"fingerprint": req.fingerprint})


def restore(req: TrainRequest, key: bytes, scratch: Path) -> ResumeChoice:
    """Decrypt the newest usable sealed checkpoint into ``scratch``; report the ones skipped."""
    choice = restore_checkpoint(Path(req.run_dir) / "checkpoints", key=key, fingerprint=req.fingerprint,
                                inputs=_inputs(req), scratch=scratch)
    for name, reason in choice.rejected:
        if req.on_event is not None:
            req.on_event("checkpoint.rejected", {"checkpoint": name, "reason": reason})
    return choice


def train(req: TrainRequest, *, plan: BatchPlan | None = None, scratch: Path | None = None,
          choice: ResumeChoice | None = None) -> TrainResult:
    """Run the recipe described in the module docstring (see :func:`app.training.train`).

    Args:
        req: The job.
        plan: Batch sizes chosen by the multi-GPU launcher (``app.training.launch``), which owns the
            OOM back-off across processes; ``None`` in a single process, which backs off here
            (``app.training.batch``).
        scratch: The launcher's shared scratch directory, into which it already restored ``choice``
            (with ``req.checkpoint_key``); ``None`` in a single process, which does both here.
        choice: See ``scratch``.
    """
    if scratch is not None and choice is not None:
        return _train(req, scratch, choice, plan=plan)
    key = checkpoint_key(req)
    with scratch_dir(req.scratch_dir) as own:
        req = dataclasses.replace(req, checkpoint_key=key)
        return _train(req, own, None, plan=plan)


def prepare_backend(settings: TrainingSettings) -> str:
    """Select the backend and, for Unsloth, import it now: before anything imports trl/transformers/peft.

    The pipeline calls this before its first transformers import (the token count); :func:`train`
    calls it again (a no-op then). Returns the backend name (see :func:`select_backend`).
    """
    set_offline_env()
    backend = privacy.backend_for(settings, select_backend(settings.backend, devices=settings.gpu.devices))
    if backend == "unsloth":
        apply_unsloth_env()
        _import_unsloth()
    return backend


def _train(req: TrainRequest, scratch: Path, choice: ResumeChoice | None, *, plan: BatchPlan | None) -> TrainResult:
    if not re.fullmatch(r"[0-9a-f]{64}", req.fingerprint):
        raise TrainingError("the run fingerprint must be 64 lowercase hex characters (a sha256)")
    if not req.base_model_name or Path(req.base_model_name).is_absolute():
        raise TrainingError("base_model_name must be a model name, not empty or an absolute path (it is exported)")
    s = req.settings
    backend = prepare_backend(s)  # Unsloth must precede every trl/transformers/peft import below
    import datasets
    import torch
    import transformers
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    # Progress bars would interleave with the CLI's own progress lines (metrics only go to on_log).
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    check_base_dir(Path(req.base_model_dir), s.max_length)
    cuda = torch.cuda.is_available()
    check_options(backend, s, cuda=cuda)
    check_triton_toolchain(cuda=cuda)
    world, rank = ranks.world_size(), ranks.rank()
    cpu = threads.apply(s.cpu_threads, world=world)  # before the first torch op of the run
    key = checkpoint_key(req)  # set by train() or the launcher: one key restores and seals
    resume = choice if choice is not None else restore(req, key, scratch)
    sealing = {"key": key, "inputs": _inputs(req), "root": Path(req.run_dir) / "checkpoints"}
    splits: list[Any] = []
    eval_records: list[dict[str, Any]] = []

    def attempt(p: BatchPlan) -> tuple[Any, float, list[BatchPlan]]:
        """Load, build the trainer and train with plan ``p`` (called again after an OOM back-off)."""
        transformers.set_seed(s.seed)  # before loading: LoRA init (and everything after) reproducible
        try:
            model, tok, peft_config = (_load_unsloth if backend == "unsloth" else _load_hf)(req, cuda)
        except CvmTuneError:
            raise
        except Exception as exc:
            raise BaseModelError(f"cannot load base model from {req.base_model_dir}: {first_line(exc)}",
                                 fix="restore the base model directory (config.json, weights, tokenizer files)") from exc
        if req.init_adapter is not None and s.objective == "sft":  # dpo: once the trainer wrapped the model (dpo.py)
            from app.training.warm import warm_start

            model, peft_config = warm_start(model, peft_config, Path(req.init_adapter))
        if not splits:
            data = dpo.preference_dataset(req.rows) if s.objective == "dpo" else sft_dataset(
                req.rows, req.tokenized, tok, assistant_only_loss=s.assistant_only_loss, backend=backend)
            splits.extend(split_eval(data, s.eval_fraction, s.seed))
        try:
            make, cb = (dpo.make_trainer, {"callbacks": [callback_class()(req, sealing)]}) if s.objective == "dpo" \
                else (_make_trainer, {"sealing": sealing})
            trainer = make(req, model, tok, peft_config, splits[0], splits[1], scratch, cuda=cuda, backend=backend,
                           plan=p, world=world, **cb)
        except CvmTuneError:
            raise
        except Exception as exc:
            raise TrainingError(f"training setup failed: {first_line(exc)}") from exc
        if req.proximal:
            from app.training.prox import add_proximal_term

            add_proximal_term(trainer, req.proximal)
        for cb in (PrinterCallback, ProgressCallback):  # they print metrics to stdout/stderr
            trainer.remove_callback(cb)
        if len(trainer.train_dataset) == 0:
            raise TrainingError("no trainable examples: every row has zero trainable tokens after masking and truncation",
                                fix="check training.max_length and training.assistant_only_loss against the dataset")
        watch = step_watch()
        trainer.add_callback(watch)
        current = [p]
        guard_eval(trainer, current, eval_records, req.on_batch_change, retry=world == 1)
        start = time.perf_counter()
        try:
            if resume.path is not None and resume.step is not None and resume.step >= s.max_steps:
                _restore_finished(trainer, resume.path)  # HF would run one extra step past max_steps
            else:
                trainer.train(resume_from_checkpoint=str(resume.path) if resume.path is not None else None)
        except CvmTuneError:  # TrainingInterrupted, TrainingStopped, LossDiverged, OutOfMemory: propagate as is
            raise
        except Exception as exc:
            if is_oom(exc):
                raise OutOfMemory(f"CUDA out of memory in training: {first_line(exc)}", phase="train",
                                  first_step=watch.steps == 0, at_step=watch.last_step) from exc
            if (disk := disk_error(exc, "writing a checkpoint or the adapter failed")) is not None:
                raise disk from exc
            raise TrainingError(f"training failed: {first_line(exc)}") from exc
        return trainer, time.perf_counter() - start, current

    if plan is not None:  # a worker of a multi-process run: the launcher retries
        (trainer, runtime, current), records = attempt(plan), []
    else:
        (trainer, runtime, current), _, records = run_with_backoff(
            initial_plan(s), attempt, retries=retry_budget(s), probing=s.gpu.auto_batch_size,
            on_change=req.on_batch_change)

    adapter_dir = Path(req.run_dir) / "adapter"
    if rank == 0:
        try:
            adapter_dir = export_adapter(trainer.model, adapter_dir, req.base_model_name, req.base_model_revision)
        except OSError as exc:
            raise StateError(f"cannot write the adapter under {req.run_dir}: {first_line(exc)}") from exc
    state = trainer.state
    losses = [(int(h["step"]), float(h["loss"])) for h in state.log_history if "loss" in h and "step" in h]
    eval_losses = [(int(h["step"]), float(h["eval_loss"])) for h in state.log_history if "eval_loss" in h]
    device = device_label(cuda)
    if world > 1:
        device = f"{world} x {device}"
    return TrainResult(
        adapter_dir=adapter_dir, backend=backend, device=device, losses=losses, global_step=int(state.global_step),
        resumed_from_step=resume.step, train_runtime_s=runtime,
        tokens_seen=int(state.num_input_tokens_seen) if state.num_input_tokens_seen else None,
        library_versions=imported_versions(library_names(backend)),
        batch=batch_summary(current[0], s, world, records + eval_records), eval_losses=eval_losses,
        rejected_checkpoints=resume.rejected,
        peak_gpu_memory_bytes=int(torch.cuda.max_memory_allocated()) if cuda else None,
        privacy=privacy.outcome(trainer, resume.path) if req.privacy is not None else None, cpu_threads=cpu,
    )


def _restore_finished(trainer: Any, ckpt: Path) -> None:
    """Load a checkpoint taken at ``max_steps`` (training done, export not) without training.

    ``Trainer.train(resume_from_checkpoint=...)`` from such a checkpoint runs one more optimizer
    step (global_step ends at max_steps + 1), which would change the adapter.
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import TrainerState

    result = set_peft_model_state_dict(trainer.model, load_file(str(ckpt / "adapter_model.safetensors")))
    if getattr(result, "unexpected_keys", None):
        raise TrainingError(f"{ckpt.name} does not match the adapter layout", fix="delete the run's checkpoints")
    trainer.state = TrainerState.load_from_json(str(ckpt / "trainer_state.json"))


# --- step 2: model loading (the only backend-specific code) -------------------------------------


def _import_unsloth() -> None:
    """Import unsloth first so its patches of trl/transformers/peft apply (a no-op once imported)."""
    if "unsloth" in sys.modules:
        return
    late = [name for name in ("trl", "transformers", "peft") if name in sys.modules]
    if late:
        logger.warning("unsloth imported after %s: some of its optimisations may not apply", ", ".join(late))
    try:
        import unsloth  # noqa: F401
    except Exception as exc:
        raise TrainingError(
            f"cannot import unsloth: {first_line(exc)}",
            fix="check the [gpu] extra's pinned versions and the GPU driver, or set training.backend to 'hf'",
        ) from exc


def _load_hf(req: TrainRequest, cuda: bool) -> tuple[Any, Any, Any]:
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lora = req.settings.lora
    kw = hf_model_kwargs(req.settings, cuda=cuda, local_rank=ranks.local_rank())
    tok = AutoTokenizer.from_pretrained(str(req.base_model_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(req.base_model_dir), **kw)
    # The SFTTrainer wraps the model with this config exactly once; on resume it loads the
    # checkpoint's adapter weights into that wrapper (wrapping twice would silently restart).
    peft_config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=list(lora.target_modules), task_type="CAUSAL_LM", bias="none")
    return model, tok, peft_config


def _load_unsloth(req: TrainRequest, cuda: bool) -> tuple[Any, Any, Any]:
    from unsloth import FastLanguageModel

    s = req.settings
    ckpt = gradient_checkpointing("unsloth", s, cuda=cuda)
    model, tok = FastLanguageModel.from_pretrained(**unsloth_load_kwargs(req.base_model_dir, s, ckpt))
    # Wrapped once per process; on resume the trainer loads the checkpoint's adapter into it.
    model = FastLanguageModel.get_peft_model(model, **unsloth_peft_kwargs(s, ckpt))
    return model, tok, None


# --- step 5: trainer with sealed checkpoints --------------------------------------------------------


def _make_trainer(req: TrainRequest, model: Any, tok: Any, peft_config: Any, dataset: Any, eval_dataset: Any,
                  scratch: Path, *, cuda: bool, backend: str, plan: BatchPlan, world: int, sealing: dict[str, Any]) -> Any:
    import torch
    from trl import SFTConfig, SFTTrainer

    s = req.settings
    bf16 = cuda and torch.cuda.is_bf16_supported()
    # Unsloth: get_peft_model already set up its (offloaded) checkpointing. HF: on a GPU, trade compute for memory.
    ckpt = backend == "hf" and gradient_checkpointing(backend, s, cuda=cuda) is True
    extra: dict[str, Any] = {**OPTIMIZER_ARGS, **sft_batch_kwargs(s, plan, has_eval=eval_dataset is not None)}
    if ckpt:
        extra["gradient_checkpointing_kwargs"] = {"use_reentrant": False}  # DDP + PEFT safe
    if world > 1:
        extra["ddp_find_unused_parameters"] = False  # frozen base weights never get gradients
    trainer_cls = SFTTrainer if req.privacy is None else privacy.trainer_class(SFTTrainer, req.privacy, micro=plan.micro)
    extra.update(privacy.SFT_ARGS if req.privacy is not None else {})  # DP-SGD: one Poisson sample per step
    with warnings.catch_warnings():
        # transformers 5.2x renames gradient_checkpointing; the old name also works on 5.17 (GPU lock).
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
        args = SFTConfig(
            output_dir=str(scratch),  # plaintext saves stay in RAM; the callback seals them onto the volume
            max_steps=s.max_steps,
            learning_rate=s.learning_rate,
            lr_scheduler_type="constant",  # no warmup/decay state to get wrong across a resume
            logging_steps=s.logging_steps,
            save_strategy="steps",
            save_steps=s.save_steps,
            save_total_limit=3,  # >= 2 complete checkpoints survive while a new one is written
            max_length=s.max_length,
            assistant_only_loss=s.assistant_only_loss and not is_pretokenized(dataset),  # masks are in the dataset
            report_to="none",
            seed=s.seed,
            data_seed=s.seed,
            dataloader_num_workers=0,
            dataloader_pin_memory=False,  # pinned buffers buy nothing through the CC bounce buffer
            disable_tqdm=True,
            use_cpu=not cuda,
            bf16=bf16,
            fp16=cuda and not bf16,
            gradient_checkpointing=ckpt,
            include_num_input_tokens_seen="non_padding",  # kept in trainer_state: survives a resume
            logging_nan_inf_filter=False,  # HF would log a NaN/Inf loss as the running mean: hide it from the watchdog
            **extra,
        )
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset, eval_dataset=eval_dataset, processing_class=tok,
                             peft_config=peft_config, callbacks=[callback_class()(req, sealing)])
    # Unsloth's trainer lowers an eval batch of 8 to the train micro-batch: keep the plan's (the manifest records it).
    trainer.args.per_device_eval_batch_size = plan.eval_micro
    return trainer
