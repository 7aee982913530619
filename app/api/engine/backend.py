"""The training API's backend (``api.backend``; docs/api.md, "On a GPU"): chosen as the nightly run chooses, Unsloth
imported first, and the base model loaded through Unsloth with the nightly run's arguments.

``hf`` is :class:`app.api.engine.engine.Engine`'s own transformers + PEFT path. ``unsloth`` (:func:`load_unsloth`) loads the
base with ``FastLanguageModel.from_pretrained`` and attaches the placeholder adapter with
``FastLanguageModel.get_peft_model``, which installs Unsloth's fused LoRA paths; each API model is then a plain PEFT
adapter added next to it (``add_adapter``), with the same ``LoraConfig`` as on ``hf``. Unsloth's kernels read the
*active* adapter of each projection, so switching adapters with ``set_adapter`` keeps the fused paths.

Two things Unsloth does differently are evened out here, for the engine's own calls only:

* its decode step (one token with a KV cache) reads the LoRA of the active adapter in every projection and fails on
  one the adapter does not reach (``train_attn`` or ``train_mlp`` off): :func:`route` disables the layers the active
  adapter does not reach, which is what PEFT's forward does with them anyway;
* its causal-LM head computes the logits of a one-token step as ``lm_head.weight @ h``, which skips a LoRA on
  ``lm_head`` (``train_unembed``, the SDK's default) in every decode step: :class:`OwnHead` asks the model for its
  final hidden states and applies ``lm_head`` through PEFT itself, at every length, then Unsloth's own logit
  scaling and soft-capping.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from app.errors import BaseModelError, ConfigError, CvmTuneError, TrainingError

if TYPE_CHECKING:
    from app.config import Config

# get_peft_model names its adapter "default" (it takes no name). Unsloth installs its fused paths in a layer only
# where q/k/v, o and gate/up/down all carry a LoRA (dropout 0, no bias), so the placeholder targets all seven.
PLACEHOLDER = "default"
PLACEHOLDER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HIDDEN_ENV = "UNSLOTH_RETURN_HIDDEN_STATES"  # read by Unsloth's causal-LM forward at each call


def choose(cfg: Config) -> str:
    """``hf`` or ``unsloth`` for ``api.backend``: the nightly run's choice (:func:`app.training.backend.select_backend`:
    ``auto`` = Unsloth when a CUDA GPU is visible and unsloth is installed). Imports torch, never unsloth,
    transformers or peft.

    Raises:
        ConfigError: ``unsloth`` where it cannot run (no CUDA GPU, or unsloth not installed).
    """
    from app.training.backend import select_backend

    try:
        return select_backend(cfg.api.backend, setting="api.backend")
    except TrainingError as exc:
        raise ConfigError(exc.message, fix=exc.fix) from None


def prepare(cfg: Config) -> str:
    """Choose the backend and, for Unsloth, import it now, under :mod:`app.training.options`' environment, before
    anything imports transformers, peft or trl (it patches them). Idempotent; returns the backend.

    Raises:
        ConfigError: see :func:`choose`.
        TrainingError: unsloth does not import, or Triton could not build its kernel launchers.
    """
    from app.training import set_offline_env

    set_offline_env()
    backend = choose(cfg)
    check_quantization(cfg)
    if backend == "unsloth":
        from app.training.backend import _import_unsloth
        from app.training.options import apply_unsloth_env, check_triton_toolchain

        apply_unsloth_env()
        _import_unsloth()
        check_triton_toolchain(cuda=True)
    return backend


def check_quantization(cfg: Config) -> None:
    """``training.gpu.quantization: 4bit`` loads the API's base model 4-bit on either backend (bitsandbytes QLoRA on
    the HF one, as a nightly run): refused where no CUDA GPU is visible, as a nightly run refuses it. Imports torch.

    Raises:
        ConfigError: 4-bit without a CUDA GPU.
    """
    if cfg.training.gpu.quantization != "4bit":
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("training.gpu.quantization is '4bit' but no CUDA GPU is visible: the training API would load "
                          "its base model 4-bit (bitsandbytes QLoRA is CUDA-only)",
                          fix="set training.gpu.quantization: none, or serve on an NVIDIA GPU")


def model_context(base_dir: Path, default: int) -> int:
    """The base model's ``max_position_embeddings`` (a nested ``text_config``'s too), else ``default``.

    Unsloth's ``max_seq_length``: above the model's own context it would add RoPE scaling to the base.
    """
    from app.training.options import context_limit

    try:
        config = json.loads((Path(base_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return default
    limit = context_limit(config) if isinstance(config, dict) else None
    return limit if limit is not None and limit > 0 else default


def unsloth_kwargs(base_dir: Path, cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``FastLanguageModel.from_pretrained`` arguments, ``get_peft_model`` arguments of the placeholder).

    The nightly run's (:mod:`app.training.options`: bf16 where supported, 4-bit only with
    ``training.gpu.quantization: 4bit``, local files only, its gradient checkpointing and seed), with
    ``max_seq_length`` = the model's context. The placeholder: rank 1 on the seven projections, dropout 0, no bias,
    PEFT's default initialisation (B = 0: it adds exactly nothing).
    """
    from app.training.options import gradient_checkpointing, unsloth_load_kwargs, unsloth_peft_kwargs

    s = cfg.training
    ckpt = gradient_checkpointing("unsloth", s, cuda=True)
    load = {**unsloth_load_kwargs(Path(base_dir), s, ckpt), "max_seq_length": model_context(base_dir, cfg.api.max_seq_len)}
    peft = {**unsloth_peft_kwargs(s, ckpt), "r": 1, "lora_alpha": 1, "lora_dropout": 0.0,
            "target_modules": list(PLACEHOLDER_TARGETS), "bias": "none", "init_lora_weights": True}
    return load, peft


def load_unsloth(base_dir: Path, cfg: Config) -> Any:
    """The base model through Unsloth, as a PeftModel whose only adapter is the zero placeholder :data:`PLACEHOLDER`.

    Raises:
        BaseModelError: Unsloth could not load the model or attach the placeholder.
        TrainingError: the placeholder is not zero.
    """
    from app.training.options import first_line

    load, peft = unsloth_kwargs(base_dir, cfg)
    try:
        from unsloth import FastLanguageModel

        model, _tokenizer = FastLanguageModel.from_pretrained(**load)
        model = FastLanguageModel.get_peft_model(model, **peft)
    except CvmTuneError:
        raise
    except Exception as exc:
        raise BaseModelError(f"cannot load base model from {base_dir} with Unsloth: {first_line(exc)}",
                             fix="restore the base model directory, or set api.backend: hf") from exc
    check_placeholder(model)
    return model


def check_placeholder(model: Any, name: str = PLACEHOLDER) -> None:
    """Every ``lora_B`` of the placeholder is zero (so it adds nothing to the base).

    Raises:
        TrainingError: one is not.
    """
    for param_name, p in model.named_parameters():
        if f".lora_B.{name}." in param_name and bool(p.detach().ne(0).any()):
            raise TrainingError(f"the placeholder adapter is not zero ({param_name})",
                                fix="report this: the LoRA initialisation of the installed Unsloth/PEFT changed")


def route(model: Any, adapter: str) -> None:
    """Disable each LoRA layer that ``adapter`` does not reach, enable the others (after ``set_adapter(adapter)``).

    PEFT's forward runs such a layer as its base layer anyway; Unsloth's decode step would look the adapter up there.
    """
    from torch import nn

    for module in model.modules():
        lora_a = module._modules.get("lora_A") if hasattr(module, "_disable_adapters") else None
        if isinstance(lora_a, nn.ModuleDict):
            module._disable_adapters = adapter not in lora_a


class OwnHead:
    """``model`` called for its final hidden states (Unsloth's :data:`HIDDEN_ENV`), with ``lm_head`` applied here
    through PEFT (the active adapter's LoRA on it included), then ``transform`` (the logit scaling and soft-capping).

    Called like the model with the keywords the engine and :mod:`app.api.engine.sampling` pass; returns ``.logits`` and
    ``.past_key_values``.
    """

    def __init__(self, model: Any, transform: Callable[[Any], Any] = lambda logits: logits) -> None:
        self.model, self.transform = model, transform

    def __call__(self, **kwargs: Any) -> Any:
        previous = os.environ.get(HIDDEN_ENV)
        os.environ[HIDDEN_ENV] = "1"
        try:
            out = self.model(**kwargs)
        finally:
            if previous is None:
                os.environ.pop(HIDDEN_ENV, None)
            else:
                os.environ[HIDDEN_ENV] = previous
        head = self.model.get_output_embeddings()
        weight = head.weight
        hidden = out.logits
        if hidden.shape[-1] != weight.shape[-1]:
            raise TrainingError(f"the model returned {hidden.shape[-1]} features, not its final hidden states "
                                f"({weight.shape[-1]}): this Unsloth ignores {HIDDEN_ENV}", fix="set api.backend: hf")
        logits = self.transform(head(hidden.to(weight.dtype)))
        return SimpleNamespace(logits=logits, past_key_values=getattr(out, "past_key_values", None))


def unsloth_head(model: Any) -> OwnHead:
    """:class:`OwnHead` with Unsloth's own logit scaling and soft-capping for ``model``'s config."""
    from unsloth.models.llama import apply_logit_transforms, resolve_logit_scaling

    softcap, scale = resolve_logit_scaling(model.config)
    return OwnHead(model, lambda logits: apply_logit_transforms(logits, softcap, scale))
