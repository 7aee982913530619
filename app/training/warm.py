"""Continual retraining on the training side: start from a previous adapter, and score adapters on eval rows.

Both import the heavy stack inside the call (the module itself is light).
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from app.errors import TrainingError

WEIGHTS = "adapter_model.safetensors"


def warm_start(model: Any, peft_config: Any, adapter_dir: Path) -> tuple[Any, None]:
    """Wrap ``model`` with LoRA (once) and load the previous adapter's weights into it.

    Returns:
        (the PEFT model, ``None``): the trainer must not wrap it again.

    Raises:
        TrainingError: the weights are unreadable or do not fit this LoRA shape (missing or extra tensors, shapes).
    """
    from peft import PeftModel, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    # transformers 5.2x warns when the trainer asks a PEFT model about gradient checkpointing (renamed API)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    if not isinstance(model, PeftModel):
        model = get_peft_model(model, peft_config)
    try:
        state = load_file(str(adapter_dir / WEIGHTS))
    except Exception as exc:
        raise TrainingError(f"cannot read the previous adapter's weights in {adapter_dir}: {type(exc).__name__}") from exc
    try:
        result = set_peft_model_state_dict(model, state)
    except RuntimeError as exc:  # tensor shape mismatch
        raise TrainingError(f"the previous adapter does not fit this LoRA shape: {str(exc).splitlines()[0][:200]}",
                            fix="set training.init: base (or restore the LoRA settings the previous adapter used)") from exc
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise TrainingError(f"the previous adapter does not fit this LoRA shape ({len(missing)} LoRA tensors missing, "
                            f"{len(result.unexpected_keys)} unexpected)",
                            fix="set training.init: base (or restore the LoRA settings the previous adapter used)")
    return model, None


def eval_loss(base_model_dir: Path, adapter_dir: Path | None, rows: Sequence[Mapping[str, Any]], settings: Any) -> float:
    """Mean eval loss of the base model, or of the base model with an adapter, on ``rows``.

    The rows go through the same dataset building, chat template, truncation (``max_length``) and loss masking
    (``assistant_only_loss``) as training, so a candidate and its parent are scored on identical tokens.

    Raises:
        TrainingError: the model cannot be loaded or evaluated.
    """
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    cuda = torch.cuda.is_available()
    with warnings.catch_warnings():  # transformers 5.2x renames gradient_checkpointing (the GPU lock pins 5.17)
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
        return _eval_loss(base_model_dir, adapter_dir, rows, settings, cuda)


def _eval_loss(base_model_dir: Path, adapter_dir: Path | None, rows: Sequence[Mapping[str, Any]], settings: Any,
               cuda: bool) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import SFTConfig, SFTTrainer

    from app.training.sft_data import build_dataset

    try:
        tok = AutoTokenizer.from_pretrained(str(base_model_dir), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(base_model_dir), local_files_only=True,
                                                     dtype=torch.bfloat16 if cuda else torch.float32)
        if adapter_dir is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False)
        dataset = build_dataset(rows, tok, assistant_only_loss=settings.assistant_only_loss)
        with tempfile.TemporaryDirectory(prefix="cvm-tune-eval-") as scratch:
            args = SFTConfig(output_dir=scratch, max_length=settings.max_length, report_to="none",
                             assistant_only_loss=settings.assistant_only_loss, use_cpu=not cuda, bf16=cuda,
                             per_device_eval_batch_size=settings.per_device_eval_batch_size or settings.per_device_batch_size,
                             disable_tqdm=True, dataloader_num_workers=0, seed=settings.seed)
            trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=dataset, processing_class=tok)
            for cb in (PrinterCallback, ProgressCallback):  # they print metrics to stdout
                trainer.remove_callback(cb)
            metrics = trainer.evaluate()
    except TrainingError:
        raise
    except Exception as exc:
        raise TrainingError(f"evaluating {'the adapter ' + str(adapter_dir.parent.name) if adapter_dir else 'the base model'} "
                            f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}") from exc
    loss = float(metrics["eval_loss"])
    if loss != loss or loss in (float("inf"), float("-inf")):
        raise TrainingError("the eval loss is not a finite number", fix="check the eval rows and the adapter")
    return loss
