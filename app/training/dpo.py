"""Preference training (``training.objective: dpo``): TRL's ``DPOTrainer`` on the LoRA model.

What differs from supervised fine-tuning (:mod:`app.training.backend` runs both; everything else, sealed
checkpoints, resume, the loss watchdog, stop requests, OOM back-off, export, is shared):

* **rows**: ``{"prompt", "chosen", "rejected"}``, all plain strings or all conversational (a prompt of messages
  ending with a user turn, one assistant message each for chosen and rejected); validated by
  :mod:`app.dataset.rows`. TRL tokenizes them itself (prompt, prompt + chosen, prompt + rejected; EOS appended
  to plain answers), so the token stage only counts and applies the too-long policy (:func:`token_policy`).
* **reference**: the base model with the adapter disabled (TRL's PEFT path, ``ref_model=None``): no second copy
  of the weights. TRL wraps the base model with the LoRA config itself; a warm start (continual retraining, a
  federated round) loads the previous adapter's weights into that wrapper *after* the trainer is built, so the
  reference stays the base model rather than a copy of the previous adapter. With Unsloth the model arrives
  wrapped already and TRL adds a frozen copy of the freshly initialised adapter as the reference (LoRA weights
  only; its B matrices are zero, so it computes the base model).
* **loss**: ``training.dpo.loss_type`` (sigmoid, hinge, ipo) with ``training.dpo.beta``; TRL logs it as ``loss``,
  which the loss watchdog and the manifest's losses read as for SFT.
* **evaluation gate**: :func:`eval_scores` gives the mean DPO loss and the preference accuracy (share of pairs
  whose chosen answer gains more log-probability over the reference than the rejected one) on the owner's eval
  rows. The base model is its own reference, so its scores are exact constants (:func:`reference_scores`).
"""

from __future__ import annotations

import math
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.errors import AllRowsFilteredError, BaseModelError, RowError, TrainingError, ZeroTrainableTokensError

from .options import OPTIMIZER_ARGS, gradient_checkpointing, sft_batch_kwargs
from .tokens import TokenReport

if TYPE_CHECKING:
    from app.config import TrainingSettings

    from . import TrainRequest
    from .batch import BatchPlan

REFERENCE = "base model (adapter disabled)"
FIELDS = ("prompt", "chosen", "rejected")


def settings_block(s: TrainingSettings) -> dict[str, Any] | None:
    """The manifest's ``training.dpo`` (``None`` for sft)."""
    if s.objective != "dpo":
        return None
    return {"beta": s.dpo.beta, "loss_type": s.dpo.loss_type, "reference": REFERENCE}


def _conversational(rows: Sequence[Mapping[str, Any]], source: str = "dataset") -> bool:
    """Whether the preference rows are conversational; they must all be one or the other.

    Raises:
        RowError: plain and conversational rows mixed (row numbers only).
    """
    chat = [isinstance(r.get("prompt"), list) for r in rows]
    if any(chat) and not all(chat):
        first = chat.index(not chat[0]) + 1
        raise RowError(f"{source}: preference rows mix plain strings and message arrays (row {first} of the kept rows "
                       "differs from the first)", fix="use one form for every row")
    return bool(chat and chat[0])


def preference_dataset(rows: Sequence[Mapping[str, Any]]) -> Any:
    """The in-memory ``datasets.Dataset`` TRL's DPOTrainer takes (no cache files).

    Raises:
        TrainingError: no rows, or rows that are not preference rows (validate the dataset first).
    """
    from datasets import Dataset

    if not rows:
        raise TrainingError("no rows to train on", fix="provide a dataset with at least one row")
    bad = [i for i, r in enumerate(rows) if set(r) - {"split"} != set(FIELDS)]
    if bad:
        raise TrainingError(f"row {bad[0]} is not a preference row (prompt, chosen, rejected)",
                            fix="validate the dataset first, or set training.objective: sft")
    _conversational(rows)
    return Dataset.from_list([{k: r[k] for k in FIELDS} for r in rows])


def token_policy(rows: Sequence[Mapping[str, Any]], *, base_model_dir: Path, max_length: int, too_long: str,
                 lines: Sequence[int] | None = None) -> tuple[list[Mapping[str, Any]], TokenReport]:
    """The token stage for preference rows: count, apply ``dataset.too_long``, drop pairs with nothing to learn.

    Each pair is tokenized as TRL's DPOTrainer does (the prompt, then prompt + chosen and prompt + rejected, the
    completion starting where they diverge). A pair is too long when either sequence exceeds ``max_length``
    (``truncate``: TRL keeps the first ``max_length`` tokens; ``drop``: removed); a pair whose prompt alone fills
    ``max_length`` has no completion token left and is dropped (TRL would drop it silently). Tokens counted: both
    sequences after truncation; trainable: their completion tokens.

    Raises:
        BaseModelError: the tokenizer cannot be loaded.
        RowError: plain and conversational rows mixed.
        AllRowsFilteredError, ZeroTrainableTokensError: nothing left.
    """
    from app.training import set_offline_env

    set_offline_env()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(base_model_dir), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any loader failure: the message names the type only
        raise BaseModelError(f"cannot load the tokenizer from {base_model_dir}: {type(exc).__name__}") from None
    chat = _conversational(rows)
    keep: list[Mapping[str, Any]] = []
    long_at: list[int] = []
    zero_at: list[int] = []
    truncated = tokens = trainable = 0
    for i, row in enumerate(rows):
        prompt_len, lengths = _pair_lengths(tok, row, chat)
        line = lines[i] if lines is not None else i + 1
        if max(lengths) > max_length:
            long_at.append(line)
            if too_long == "drop":
                continue
        if prompt_len >= max_length:
            zero_at.append(line)
            continue
        truncated += max(lengths) > max_length
        tokens += sum(min(n, max_length) for n in lengths)
        trainable += sum(min(n, max_length) - prompt_len for n in lengths)
        keep.append(row)
    dropped_long = len(long_at) if too_long == "drop" else 0
    report = TokenReport(max_length=max_length, rows_in=len(rows), too_long=len(long_at), truncated=truncated,
                         dropped_too_long=dropped_long, dropped_no_trainable=len(zero_at), rows_out=len(keep),
                         tokens=tokens, trainable_tokens=trainable, too_long_lines=tuple(long_at),
                         no_trainable_lines=tuple(zero_at))
    if not keep:
        cls = ZeroTrainableTokensError if len(zero_at) == len(rows) else AllRowsFilteredError
        raise cls(f"no preference pair left to train on: of {len(rows)} pairs, {dropped_long} longer than max_length "
                  f"({max_length} tokens) were dropped and {len(zero_at)} had a prompt that fills max_length")
    return keep, report


def _pair_lengths(tok: Any, row: Mapping[str, Any], chat: bool) -> tuple[int, tuple[int, int]]:
    """(prompt tokens shared with both completions, (prompt+chosen, prompt+rejected) tokens), as TRL counts them."""
    if chat:
        def ids(messages: list[Any], gen: bool = False) -> list[int]:
            out = tok.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=gen, return_dict=True)
            return list(out["input_ids"])

        prompt = ids(row["prompt"], True)
        full = [ids(list(row["prompt"]) + list(row[k])) for k in ("chosen", "rejected")]
    else:
        eos = tok.eos_token or ""
        prompt = list(tok(text=row["prompt"])["input_ids"])
        full = [list(tok(text=row["prompt"] + (a if a.endswith(eos) else a + eos))["input_ids"])
                for a in (row["chosen"], row["rejected"])]
    shared = min(_common_prefix(prompt, f) for f in full)
    return shared, (len(full[0]), len(full[1]))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def dpo_config(s: TrainingSettings, output_dir: str, *, cuda: bool, **extra: Any) -> Any:
    """``trl.DPOConfig`` with the run's optimisation settings (as the SFT path's) and ``training.dpo``."""
    import torch
    from trl import DPOConfig

    bf16 = cuda and torch.cuda.is_bf16_supported()
    with warnings.catch_warnings():
        # transformers 5.2x renames gradient_checkpointing; the old name also works on 5.17 (GPU lock).
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
        return DPOConfig(
            output_dir=output_dir, max_steps=s.max_steps, learning_rate=s.learning_rate, lr_scheduler_type="constant",
            logging_steps=s.logging_steps, max_length=s.max_length, truncation_mode="keep_start",
            beta=s.dpo.beta, loss_type=[s.dpo.loss_type], precompute_ref_log_probs=False,
            report_to="none", seed=s.seed, data_seed=s.seed, dataloader_num_workers=0, dataloader_pin_memory=False,
            disable_tqdm=True, use_cpu=not cuda, bf16=bf16, fp16=cuda and not bf16,
            logging_nan_inf_filter=False, **extra)


def make_trainer(req: TrainRequest, model: Any, tok: Any, peft_config: Any, dataset: Any, eval_dataset: Any,
                 scratch: Path, *, cuda: bool, backend: str, plan: BatchPlan, world: int, callbacks: list[Any]) -> Any:
    """The DPOTrainer of one attempt (the counterpart of ``backend._make_trainer``), warm-started when asked."""
    from trl import DPOTrainer

    s = req.settings
    # transformers 5.2x renamed the gradient-checkpointing API; TRL's reference pass calls the old names every step
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.* is deprecated.*", category=FutureWarning)
    ckpt = backend == "hf" and gradient_checkpointing(backend, s, cuda=cuda) is True
    batch = sft_batch_kwargs(s, plan, has_eval=eval_dataset is not None)
    batch.pop("packing", None)  # DPOConfig has no packing; objective dpo allows padded batching only
    extra: dict[str, Any] = {**OPTIMIZER_ARGS, **batch}
    if ckpt:
        extra["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    if world > 1:
        extra["ddp_find_unused_parameters"] = False
    args = dpo_config(s, str(scratch), cuda=cuda, save_strategy="steps", save_steps=s.save_steps, save_total_limit=3,
                      gradient_checkpointing=ckpt, include_num_input_tokens_seen="non_padding", **extra)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
        trainer = DPOTrainer(model=model, ref_model=None, args=args, train_dataset=dataset, eval_dataset=eval_dataset,
                             processing_class=tok, peft_config=peft_config, callbacks=callbacks)
    if req.init_adapter is not None:  # after TRL wrapped the model: the reference stays the base model
        from app.training.warm import warm_start

        warm_start(trainer.model, None, Path(req.init_adapter))
    trainer.args.per_device_eval_batch_size = plan.eval_micro
    return trainer


def reference_scores(s: TrainingSettings) -> tuple[float, float]:
    """(DPO loss, preference accuracy) of the reference itself: every margin is 0, so the loss is a constant of the
    loss type (sigmoid: ln 2; hinge: 1; ipo: (1 / (2 beta))^2) and no pair is preferred (accuracy 0)."""
    beta = s.dpo.beta
    loss = {"sigmoid": math.log(2.0), "hinge": 1.0, "ipo": (1.0 / (2.0 * beta)) ** 2}[s.dpo.loss_type]
    return loss, 0.0


def eval_scores(base_model_dir: Path, adapter_dir: Path | None, rows: Sequence[Mapping[str, Any]],
                settings: TrainingSettings) -> tuple[float, float]:
    """(mean DPO loss, preference accuracy) of the base model with ``adapter_dir`` on the preference ``rows``, the
    base model being the reference (``adapter_dir`` None: :func:`reference_scores`).

    Raises:
        TrainingError: the model cannot be loaded or evaluated, or the loss is not finite.
    """
    if adapter_dir is None:
        return reference_scores(settings)
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    cuda = torch.cuda.is_available()
    try:
        metrics = _evaluate(base_model_dir, Path(adapter_dir), rows, settings, cuda)
    except TrainingError:
        raise
    except Exception as exc:
        raise TrainingError(f"evaluating the adapter {Path(adapter_dir).parent.name} failed: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}") from exc
    loss, acc = float(metrics["eval_loss"]), float(metrics.get("eval_rewards/accuracies", float("nan")))
    if not (math.isfinite(loss) and math.isfinite(acc)):
        raise TrainingError("the eval DPO loss is not a finite number", fix="check the eval rows and the adapter")
    return loss, acc


def _evaluate(base_model_dir: Path, adapter_dir: Path, rows: Sequence[Mapping[str, Any]], s: TrainingSettings,
              cuda: bool) -> dict[str, float]:
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import DPOTrainer

    from app.training.warm import warm_start

    tok = AutoTokenizer.from_pretrained(str(base_model_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(base_model_dir), local_files_only=True,
                                                 dtype=torch.bfloat16 if cuda else torch.float32)
    lora = LoraConfig.from_pretrained(str(adapter_dir))
    dataset = preference_dataset(rows)
    with tempfile.TemporaryDirectory(prefix="cvm-tune-eval-") as scratch, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*base_model_name_or_path.*", category=UserWarning)
        args = dpo_config(s, scratch, cuda=cuda, per_device_eval_batch_size=s.per_device_eval_batch_size
                          or s.per_device_batch_size, eval_strategy="no")
        trainer = DPOTrainer(model=model, ref_model=None, args=args, train_dataset=dataset, eval_dataset=dataset,
                             processing_class=tok, peft_config=lora)
        warm_start(trainer.model, None, adapter_dir)  # the adapter's weights; the reference: adapter disabled
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        return trainer.evaluate()
